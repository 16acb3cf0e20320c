"""Attention fusion the ONNX Runtime transformer optimizer does not find in this export.

The optimizer fuses LayerNorm (+ residual) and GELU here but not the attention: its matcher wants
HF BERT's mask input, and a ViT encoder has none. :func:`fuse_attention` rewrites each
``MatMul(Q, Kᵀ) · scale → Softmax → MatMul(·, V)`` block, with its head split and merge, into one
``com.microsoft.MultiHeadAttention`` node (ONNX Runtime's CPU kernel, no 1024×1024 score tensor
written back to memory between ops). Contrib ops: ``ort_cpu`` only.
"""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

log = logging.getLogger(__name__)


class _Graph:
    """Producer / consumer / constant look-ups over one graph."""

    def __init__(self, model: onnx.ModelProto):
        g = model.graph
        self.producer = {o: n for n in g.node for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in g.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.inits = {t.name: t for t in g.initializer}
        self.consts = {n.output[0]: n.attribute[0].t for n in g.node
                       if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"}

    def const(self, name: str) -> Optional[np.ndarray]:
        t = self.inits.get(name)
        if t is None:
            t = self.consts.get(name)
        return None if t is None else numpy_helper.to_array(t)

    def only_consumer(self, name: str) -> Optional[onnx.NodeProto]:
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 else None


def _perm(node: onnx.NodeProto) -> list[int]:
    return list(next(a.ints for a in node.attribute if a.name == "perm"))


def _transpose_chain(g: _Graph, name: str) -> tuple[Optional[onnx.NodeProto], list[int]]:
    """Walk back through consecutive Transposes; returns the node before them and the composed perm."""
    perm: Optional[list[int]] = None
    node = g.producer.get(name)
    while node is not None and node.op_type == "Transpose":
        p = _perm(node)
        perm = p if perm is None else [p[i] for i in perm]
        node = g.producer.get(node.input[0])
    return node, perm or []


def _heads(g: _Graph, reshape: onnx.NodeProto) -> Optional[int]:
    """Head count from the split Reshape's target shape [B, N, H, d] (constant, or Concat of parts)."""
    shape = g.const(reshape.input[1])
    if shape is not None and shape.size == 4:
        return int(shape[2])
    concat = g.producer.get(reshape.input[1])
    if concat is not None and concat.op_type == "Concat":
        tail = g.const(concat.input[-1])
        if tail is not None and tail.size == 2:
            return int(tail[0])
    return None


def fuse_attention(model: onnx.ModelProto) -> int:
    """Rewrite every unmasked scaled-dot-product attention block into ``MultiHeadAttention`` in place;
    returns how many were fused. Blocks with a mask (the decoder's) are left as they are."""
    g = _Graph(model)
    fused: dict[int, onnx.NodeProto] = {}  # id(output Transpose) -> MHA node taking its place
    for sm in [n for n in model.graph.node if n.op_type == "Softmax"]:
        scale_node = g.producer.get(sm.input[0])
        if scale_node is None or scale_node.op_type not in ("Mul", "Div"):
            continue
        s = g.const(scale_node.input[1])
        qk = g.producer.get(scale_node.input[0])
        if s is None or s.size != 1 or qk is None or qk.op_type != "MatMul":
            continue
        scale = float(s.reshape(-1)[0]) if scale_node.op_type == "Mul" else 1.0 / float(s.reshape(-1)[0])
        rq, pq = _transpose_chain(g, qk.input[0])
        rk, pk = _transpose_chain(g, qk.input[1])
        av = g.only_consumer(sm.output[0])
        if av is None or av.op_type != "MatMul" or av.input[0] != sm.output[0]:
            continue
        rv, pv = _transpose_chain(g, av.input[1])
        out_t = g.only_consumer(av.output[0])
        if out_t is None:  # the head merge may share its input with Shape nodes (raw export)
            out_t = next((c for c in g.consumers.get(av.output[0], []) if c.op_type == "Transpose"), None)
        if not (rq is not None and rk is not None and rv is not None and out_t is not None
                and out_t.op_type == "Transpose" and _perm(out_t) == [0, 2, 1, 3]
                and pq == [0, 2, 1, 3] and pk == [0, 2, 3, 1] and pv == [0, 2, 1, 3]
                and rq.op_type == rk.op_type == rv.op_type == "Reshape"):
            continue
        heads = _heads(g, rq)
        if not heads:
            continue
        name = (sm.name.rsplit("/", 1)[0] if "/" in sm.name else sm.name) + f"/MultiHeadAttention_{len(fused)}"
        mha = helper.make_node("MultiHeadAttention", [rq.input[0], rk.input[0], rv.input[0]], [f"{name}_output_0"],
                               name=name, domain="com.microsoft", num_heads=heads, scale=scale)
        for user in g.consumers.get(out_t.output[0], []):
            for k, i in enumerate(user.input):
                if i == out_t.output[0]:
                    user.input[k] = mha.output[0]
        fused[id(out_t)] = mha
    if not fused:
        return 0
    nodes = [fused.get(id(n), n) for n in model.graph.node]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    remove_dead_nodes(model)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    log.debug("fused %d attention blocks into MultiHeadAttention", len(fused))
    return len(fused)


def remove_dead_nodes(model: onnx.ModelProto) -> None:
    """Drop nodes (and initializers) no graph output depends on."""
    g = model.graph
    needed = {o.name for o in g.output}
    keep = []
    for n in reversed(list(g.node)):
        if any(o in needed for o in n.output):
            keep.append(n)
            needed.update(i for i in n.input if i)
    del g.node[:]
    g.node.extend(reversed(keep))
    inits = [t for t in g.initializer if t.name in needed]
    del g.initializer[:]
    g.initializer.extend(inits)
