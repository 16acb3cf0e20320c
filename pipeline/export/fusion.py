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
        parts = [g.const(i) for i in concat.input[2:]]  # [B, N, H, d] concatenated from four parts
        if len(concat.input) == 4 and all(p is not None and p.size == 1 and int(p.reshape(-1)[0]) > 0 for p in parts):
            return int(parts[0].reshape(-1)[0])  # (not a head count left to infer: -1)
    return None


_MERGE_SHAPE = "MultiHeadAttention/merge_heads_shape"
_HEADS_FIRST = "MultiHeadAttention/heads_first"


def _shape_of_context(shape: onnx.NodeProto, split_q: str) -> list[onnx.NodeProto]:
    """Nodes computing what ``shape`` (Shape of an attention's context [B, H, N, d]) computed, from the
    query's head split [B, N, H, d]: its shape with the middle axes swapped. A Shape that slices
    (opset 15's start / end) is left as it is."""
    if shape.attribute:
        return [shape]
    whole = f"{shape.name}/of_query"
    return [helper.make_node("Shape", [split_q], [whole], name=whole),
            helper.make_node("Gather", [whole, _HEADS_FIRST], [shape.output[0]], name=f"{whole}/heads_first", axis=0)]


def fuse_attention(model: onnx.ModelProto) -> int:
    """Rewrite every unmasked scaled-dot-product attention block into ``MultiHeadAttention`` in place;
    returns how many were fused. Blocks with a mask (the decoder's) are left as they are."""
    g = _Graph(model)
    fused: dict[int, onnx.NodeProto] = {}  # id(output Transpose) -> MHA node taking its place
    retarget: dict[int, list[onnx.NodeProto]] = {}  # id(Shape of a context) -> the nodes taking its place
    merges: list[onnx.NodeProto] = []  # Reshapes [B, N, H, d] -> [B, N, H·d] some inputs need
    for sm in [n for n in model.graph.node if n.op_type == "Softmax"]:
        scale_node, bias = _biased(g, sm.input[0])
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
        inputs = []
        for tag, r in (("q", rq), ("k", rk), ("v", rv)):
            src = g.producer.get(r.input[0])
            if src is not None and src.op_type == "Gemm":
                # a projection run as a 2-D Gemm ([B·N, H·d]; seen where the keys are pooled): the
                # [B, N, H, d] split merged back to the [B, N, H·d] MultiHeadAttention reads
                merges.append(helper.make_node("Reshape", [r.output[0], _MERGE_SHAPE], [f"{name}/{tag}_3d"],
                                               name=f"{name}/{tag}_merge"))
                inputs.append(merges[-1].output[0])
            else:
                inputs.append(r.input[0])
        if bias is not None:  # a bias on the scores [B, 1, N, N] (proportional attention): MHA's attention_bias
            inputs += ["", "", bias]
        mha = helper.make_node("MultiHeadAttention", inputs, [f"{name}_output_0"],
                               name=name, domain="com.microsoft", num_heads=heads, scale=scale)
        for user in g.consumers.get(out_t.output[0], []):
            for k, i in enumerate(user.input):
                if i == out_t.output[0]:
                    user.input[k] = mha.output[0]
        fused[id(out_t)] = mha
        for shape in [c for c in g.consumers.get(av.output[0], []) if c.op_type == "Shape"]:
            # a dynamic token count: the head merge's target shape is read off the context [B, H, N, d];
            # read it off the query's split [B, N, H, d] instead, or the unfused attention stays alive for it
            retarget[id(shape)] = _shape_of_context(shape, rq.output[0])
    if not fused:
        return 0
    by_mha = {m.output[0]: [r for r in merges if r.output[0] in m.input] for m in fused.values()}
    nodes = [x for n in model.graph.node
             for x in ([*by_mha[fused[id(n)].output[0]], fused[id(n)]] if id(n) in fused
                       else retarget.get(id(n), [n]))]
    if merges:
        model.graph.initializer.append(numpy_helper.from_array(np.array([0, 0, -1], dtype=np.int64), _MERGE_SHAPE))
    if retarget:
        model.graph.initializer.append(numpy_helper.from_array(np.array([0, 2, 1, 3], dtype=np.int64), _HEADS_FIRST))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    remove_dead_nodes(model)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    log.debug("fused %d attention blocks into MultiHeadAttention", len(fused))
    return len(fused)


def _biased(g: _Graph, scores: str) -> tuple[Optional[onnx.NodeProto], Optional[str]]:
    """The node scaling ``scores`` (a Softmax's input) and the bias added after it, if any: ``Add(scale
    node, bias)`` -> (scale node, bias); otherwise (the producer, None)."""
    node = g.producer.get(scores)
    if node is None or node.op_type != "Add":
        return node, None
    for i, other in ((0, 1), (1, 0)):
        scaled = g.producer.get(node.input[i])
        if scaled is not None and scaled.op_type in ("Mul", "Div") and g.const(node.input[other]) is None:
            return scaled, node.input[other]
    return node, None


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


def _source(g: _Graph, name: str) -> tuple[str, list[int]]:
    """The tensor before a chain of Transposes (a graph input or another node's output) and the
    composed perm of the chain ([] when there is none)."""
    perm: Optional[list[int]] = None
    node = g.producer.get(name)
    while node is not None and node.op_type == "Transpose":
        p = _perm(node)
        perm = p if perm is None else [p[i] for i in perm]
        name = node.input[0]
        node = g.producer.get(name)
    return name, perm or []


def _split_heads(g: _Graph, name: str) -> Optional[tuple[str, int]]:
    """``name`` = Transpose(0,2,1,3)(Reshape(x3d, [B, N, H, d])) -> (x3d, H)."""
    src, perm = _source(g, name)
    reshape = g.producer.get(src)
    if perm != [0, 2, 1, 3] or reshape is None or reshape.op_type != "Reshape":
        return None
    heads = _heads(g, reshape)
    return (reshape.output[0], heads) if heads else None


def fuse_cached_attention(model: onnx.ModelProto, causal: bool = False) -> int:
    """The decoder step's attention blocks -> ``MultiHeadAttention`` in place; returns how many.

    Self-attention: ``present = Concat(past, new K/V)`` and the score/context products become one
    node with ``past_key``/``past_value`` inputs and ``present_key``/``present_value`` outputs.
    Cross-attention: the cached K/V ([B, H, N, d], computed once by the first step) go in as they
    are, so the step no longer transposes the whole cross key (1024 x 256 per layer) every token.
    ``causal`` (the verify graph: T new tokens after the past): the self-attention scores pass a
    ``Where(mask, -inf, scores)`` whose mask is the causal one offset by the past (the graph's only
    mask, kv_cache.py); it becomes ``unidirectional=1``, which ORT applies with the past's offset.
    """
    g = _Graph(model)
    outputs = {o.name for o in model.graph.output}
    flat = "CachedMultiHeadAttention/merge_heads_shape"
    replace: dict[int, list[onnx.NodeProto]] = {}   # id(node to replace) -> the nodes taking its place
    drop: set[int] = set()
    for sm in [n for n in model.graph.node if n.op_type == "Softmax"]:
        scale_node = g.producer.get(sm.input[0])
        masked = False
        if causal and scale_node is not None and scale_node.op_type == "Where":
            fill = g.const(scale_node.input[1])
            if fill is None or fill.size != 1 or not np.isneginf(fill.reshape(-1)[0]):
                continue
            scale_node, masked = g.producer.get(scale_node.input[2]), True
        if scale_node is None or scale_node.op_type != "Mul":
            continue
        s = g.const(scale_node.input[1])
        qk = g.producer.get(scale_node.input[0])
        av = g.only_consumer(sm.output[0])
        if s is None or s.size != 1 or qk is None or qk.op_type != "MatMul" or av is None or av.op_type != "MatMul":
            continue
        q = _split_heads(g, qk.input[0])
        key, kperm = _source(g, qk.input[1])
        value, vperm = _source(g, av.input[1])
        out_t = g.only_consumer(av.output[0])
        if q is None or kperm != [0, 1, 3, 2] or vperm or out_t is None or out_t.op_type != "Transpose" \
                or _perm(out_t) != [0, 2, 1, 3]:
            continue
        heads = q[1]
        name = (sm.name.rsplit("/", 1)[0] if "/" in sm.name else "") + f"/CachedMultiHeadAttention_{len(replace)}"
        out = f"{name}_output_0"
        merged: list[onnx.NodeProto] = []

        def merge_heads(bsnh: str, tag: str) -> str:
            """[B, S, H, d] -> [B, S, H·d]: the layout MultiHeadAttention reads (a projection run as
            a 2-D Gemm left no 3-D tensor to take)."""
            merged.append(helper.make_node("Reshape", [bsnh, flat], [f"{name}/{tag}_3d"], name=f"{name}/{tag}_merge"))
            return merged[-1].output[0]

        q3d = merge_heads(q[0], "q")
        kcat, vcat = g.producer.get(key), g.producer.get(value)
        if kcat is not None and kcat.op_type == "Concat" and vcat is not None and vcat.op_type == "Concat":
            # self-attention over the cache: Concat(past, new) on the sequence axis
            if len(kcat.input) != 2 or len(vcat.input) != 2 or key not in outputs or value not in outputs:
                continue
            new_k, new_v = _split_heads(g, kcat.input[1]), _split_heads(g, vcat.input[1])
            if new_k is None or new_v is None:
                continue
            mha = helper.make_node("MultiHeadAttention",
                                   [q3d, merge_heads(new_k[0], "k"), merge_heads(new_v[0], "v"), "", "", "",
                                    kcat.input[0], vcat.input[0]],
                                   [out, key, value], name=name, domain="com.microsoft", num_heads=heads,
                                   scale=float(s.reshape(-1)[0]), **({"unidirectional": 1} if masked else {}))
            drop.update({id(kcat), id(vcat)})
        elif kcat is None and vcat is None and not masked:
            # cross-attention on the cached encoder K/V (graph inputs, [B, H, N, d])
            mha = helper.make_node("MultiHeadAttention", [q3d, key, value], [out], name=name, domain="com.microsoft",
                                   num_heads=heads, scale=float(s.reshape(-1)[0]))
        else:
            continue
        for user in g.consumers.get(out_t.output[0], []):
            for k, i in enumerate(user.input):
                if i == out_t.output[0]:
                    user.input[k] = out
        replace[id(out_t)] = [*merged, mha]
    if not replace:
        return 0
    model.graph.initializer.append(numpy_helper.from_array(np.array([0, 0, -1], dtype=np.int64), flat))
    nodes = [m for n in model.graph.node if id(n) not in drop for m in replace.get(id(n), [n])]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    remove_dead_nodes(model)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return len(replace)
