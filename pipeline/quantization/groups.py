"""Quantizable node groups of an ONNX graph, named in the model's own module words.

A group is one matrix multiply: a projection with weights (``encoder_blocks.0.attn.out_proj``,
``...mlp.0``) or, separately, an attention-score product of two activations
(``encoder_blocks.0.attn.scores`` = Q·Kᵀ, ``...attn.context`` = softmax·V). onnxsim renames the
nodes it rewrites (a merged q/k/v MatMul becomes ``MatMul_0``), so a group takes its name from the
torch module path the exporter wrote on the tensors next to it. The same model gives the same names
in the plain graph (TensorRT, Metax) and in the fused one (ONNX Runtime CPU), so one plan serves both.
"""
from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass

import numpy as np
import onnx

QUANTIZABLE_OPS = ("MatMul", "Gemm")


@dataclass(frozen=True)
class Group:
    name: str            # module-path label, e.g. "encoder_blocks.0.attn.qkv_proj"
    node: str            # ONNX node name
    op_type: str
    kind: str            # "weights" (x · W) or "activations" (attention scores / context)
    macs: int = 0        # multiply-accumulates per image (0 when shapes are unknown)

    @property
    def block(self) -> str:
        """The transformer block the group sits in (for the heat map), e.g. ``encoder_blocks.0``."""
        parts = self.name.split(".")
        for i, p in enumerate(parts[:-1]):
            if p.isdigit():
                return ".".join(parts[:i + 1])
        return parts[0]

    @property
    def role(self) -> str:
        """The group's place inside its block, e.g. ``attn.out_proj``."""
        return self.name[len(self.block) + 1:] if self.name.startswith(self.block + ".") else self.name


def _module(tensor_or_node: str) -> str | None:
    """'/encoder/encoder_blocks.0/attn/q_proj/Add_output_0' -> 'encoder_blocks.0.attn.q_proj'."""
    if not tensor_or_node.startswith("/"):
        return None
    parts = [p for p in tensor_or_node.split("/") if p]
    parts = parts[:-1]  # the op itself (MatMul, Add_output_0, ...)
    if parts and parts[0] in ("encoder", "decoder", "dec", "model"):
        parts = parts[1:] or parts
    return ".".join(parts) or None


def _label(node: onnx.NodeProto, consumers: dict[str, list[onnx.NodeProto]]) -> str:
    own = _module(node.name)
    if own is not None:
        return own
    found = _downstream_label(node, consumers)
    # a projection whose output goes straight into its attention's head split (a layer with pooled
    # keys: q, k and v are not merged there) finds the attention module; its parameter names the rest
    params = [i.rsplit(".", 2) for i in node.input if i.endswith((".bias", ".weight")) and "_proj." in i]
    if params and found.rsplit(".", 1)[-1] == params[0][-3].rsplit(".", 1)[-1] and "." in params[0][0]:
        return f"{found}.{params[0][1]}"
    return found


def _downstream_label(node: onnx.NodeProto, consumers: dict[str, list[onnx.NodeProto]]) -> str:
    found: list[str] = []
    seen = set()
    queue = deque((o, 0) for o in node.output)
    while queue:  # the nearest module-named tensors downstream (a merged q/k/v reaches three)
        name, depth = queue.popleft()
        if name in seen or depth > 3:
            continue
        seen.add(name)
        mod = _module(name)
        if mod is not None:
            found.append(mod)
            continue
        for user in consumers.get(name, []):
            mod = _module(user.name)
            if mod is not None:
                found.append(mod)
                continue
            queue.extend((o, depth + 1) for o in user.output)
    found = sorted(set(found))
    if len(found) == 1:
        return found[0]
    if found:
        prefix = os.path.commonprefix(found).rsplit(".", 1)[0]
        tails = sorted((m[len(prefix) + 1:].split("_")[0] for m in found), key=lambda t: ("qkv".find(t) % 4, t))
        tails = "".join(tails)  # q, k, v -> "qkv"
        return f"{prefix}.{tails}_proj" if prefix else "+".join(found)
    return node.name


def _shapes_at_batch_1(model: onnx.ModelProto) -> dict[str, list[int]]:
    """Static shapes of the graph's tensors with every input's first dimension set to 1 (those ONNX
    shape inference resolves to plain numbers); {} when inference fails."""
    copy = onnx.ModelProto.FromString(model.SerializeToString())
    for i in copy.graph.input:
        dims = i.type.tensor_type.shape.dim
        if dims:
            dims[0].Clear()
            dims[0].dim_value = 1
    try:
        inferred = onnx.shape_inference.infer_shapes(copy, data_prop=True)
    except Exception:  # noqa: BLE001  (an approximation is still a share)
        return {}
    out = {}
    for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        dims = v.type.tensor_type.shape.dim
        if dims and all(d.HasField("dim_value") for d in dims):
            out[v.name] = [d.dim_value for d in dims]
    for t in inferred.graph.initializer:
        out[t.name] = list(t.dims)
    return out


def _product_macs(node: onnx.NodeProto, shapes: dict[str, list[int]], fallback: int) -> int:
    """Multiply-accumulates of one MatMul / Gemm from its input shapes ([..., M, K] x [..., K, N]; a
    Gemm's transB read from the node), ``fallback`` when a shape is unknown."""
    a, b = shapes.get(node.input[0]), shapes.get(node.input[1])
    if not a or not b or len(a) < 2 or len(b) < 2:
        return fallback
    if node.op_type == "Gemm":
        trans_b = next((x.i for x in node.attribute if x.name == "transB"), 0)
        trans_a = next((x.i for x in node.attribute if x.name == "transA"), 0)
        m, k = (a[1], a[0]) if trans_a else (a[0], a[1])
        n = b[0] if trans_b else b[1]
        return int(m * k * n)
    m, k, n = a[-2], a[-1], b[-1]
    batch = int(np.prod(a[:-2])) if len(a) > 2 else 1
    return int(batch * m * k * n)


def find_groups(model: onnx.ModelProto, tokens: int = 0, hidden: int = 0) -> list[Group]:
    """Every MatMul / Gemm of ``model`` in graph order, one :class:`Group` each, unique names.

    ``tokens`` (sequence length) and ``hidden`` (model width) give each group's multiply-accumulates
    per image: from the graph's own shapes at batch 1 where ONNX shape inference knows them (a
    layer's pruned heads, its pooled keys), else weights ``tokens·in·out``, attention products
    ``tokens²·hidden``."""
    inits = {t.name: t for t in model.graph.initializer}
    consts = {n.output[0] for n in model.graph.node if n.op_type == "Constant"}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    groups, used = [], set()
    shapes = _shapes_at_batch_1(model) if tokens and hidden else None
    for n in model.graph.node:
        if n.op_type not in QUANTIZABLE_OPS:
            continue
        weights = len(n.input) > 1 and (n.input[1] in inits or n.input[1] in consts)
        label = _label(n, consumers)
        if not weights and n.name.startswith("/"):  # Q·Kᵀ is '.../attn/MatMul', softmax·V '.../attn/MatMul_1'
            label = f"{_module(n.name)}.{'context' if n.name.endswith('_1') else 'scores'}"
        name, k = label, 2
        while name in used:
            name, k = f"{label}#{k}", k + 1
        used.add(name)
        macs = tokens * hidden * tokens
        if weights and n.input[1] in inits:
            dims = list(inits[n.input[1]].dims)
            macs = tokens * dims[0] * dims[1] if len(dims) == 2 else 0
        if shapes is not None:  # the node's own shapes (pruned heads, pooled keys) when inference knows them
            macs = _product_macs(n, shapes, macs)
        groups.append(Group(name, n.name, n.op_type, "weights" if weights else "activations", int(macs)))
    return groups
