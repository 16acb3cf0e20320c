"""Walk an ONNX graph and name every node that breaks a target runtime's rules.

The rules come from the target config (``conf/target/*.yaml``) plus what each runtime needs of
a QDQ graph: MacaRT and TensorRT run symmetric INT8 only (zero point 0, signed), weights
per-channel and activations per-tensor (MacaRT), and LayerNorm / Softmax / GELU left in float.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import onnx
from onnx import numpy_helper

CONTRIB_DOMAINS = ("com.microsoft", "com.microsoft.nchwc", "com.microsoft.experimental")
# ops a runtime must keep in float: reduced-precision LayerNorm/Softmax/GELU ruin accuracy
FLOAT_ONLY_OPS = ("LayerNormalization", "SkipLayerNormalization", "Softmax", "Gelu", "FastGelu", "BiasGelu", "Erf")
MIN_OPSET = 17  # below 17 LayerNorm is decomposed into ReduceMean/Pow/Sqrt, which overflows in FP16


@dataclass(frozen=True)
class Rules:
    """What a target runtime accepts."""

    target: str
    max_opset: Optional[int] = None
    max_ir_version: Optional[int] = None
    allow_contrib_ops: bool = True
    symmetric_int8: bool = False         # Q/DQ zero points 0 and int8
    per_channel_weights: bool = False    # DQ of a weight initializer has one scale per output channel
    per_tensor_activations: bool = False  # Q of an activation has one scale
    float_only_ops: tuple[str, ...] = ()  # never fed by DequantizeLinear


@dataclass(frozen=True)
class Violation:
    graph: str
    node: str
    op_type: str
    rule: str

    def __str__(self) -> str:
        where = f"node {self.node!r} ({self.op_type})" if self.node else "model"
        return f"{self.graph}: {where}: {self.rule}"


def _opset(model: onnx.ModelProto, domain: str = "") -> int:
    for imp in model.opset_import:
        if imp.domain in (domain, "ai.onnx" if domain == "" else domain):
            return int(imp.version)
    return 0


def validate(model: onnx.ModelProto, rules: Rules, graph: str = "model") -> list[Violation]:
    """Every rule ``model`` breaks, one :class:`Violation` per offending node (or model property)."""
    found: list[Violation] = []
    opset = _opset(model)
    if rules.max_opset is not None and opset > rules.max_opset:
        found.append(Violation(graph, "", "", f"opset {opset} > {rules.max_opset} allowed by {rules.target}"))
    if opset < MIN_OPSET:
        found.append(Violation(graph, "", "", f"opset {opset} < {MIN_OPSET}: LayerNormalization would be decomposed"))
    if rules.max_ir_version is not None and model.ir_version > rules.max_ir_version:
        found.append(Violation(graph, "", "", f"IR version {model.ir_version} > {rules.max_ir_version} allowed by {rules.target}"))
    inits = {t.name: t for t in model.graph.initializer}
    consts = {n.output[0]: n.attribute[0].t for n in model.graph.node
              if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"}
    producer = {o: n for n in model.graph.node for o in n.output}

    def const(name: str) -> Optional[np.ndarray]:
        t = inits.get(name) if name in inits else consts.get(name)
        return None if t is None else numpy_helper.to_array(t)

    for i, node in enumerate(model.graph.node):
        name = node.name or f"#{i}"
        if node.domain in CONTRIB_DOMAINS and not rules.allow_contrib_ops:
            found.append(Violation(graph, name, node.op_type, f"contrib op ({node.domain}) not supported by {rules.target}"))
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            found += _check_qdq(node, name, graph, rules, const, producer)
        if node.op_type in rules.float_only_ops and node.input:
            src = producer.get(node.input[0])
            if src is not None and src.op_type == "DequantizeLinear":
                found.append(Violation(graph, name, node.op_type,
                                       f"quantized {node.op_type} (fed by DequantizeLinear {src.name!r}); "
                                       f"{rules.target} needs it in float"))
    return found


def _check_qdq(node, name, graph, rules: Rules, const, producer) -> list[Violation]:
    found = []
    scale = const(node.input[1]) if len(node.input) > 1 else None
    zp = const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if rules.symmetric_int8:
        if zp is None and len(node.input) > 2 and node.input[2]:
            found.append(Violation(graph, name, node.op_type, "zero point is not a constant"))
        elif zp is None:
            found.append(Violation(graph, name, node.op_type, "no zero point: defaults to uint8, need symmetric int8"))
        elif zp.dtype == np.int32 and node.op_type == "DequantizeLinear" and const(node.input[0]) is not None:
            if np.any(zp != 0):  # an int32 bias (scale = input scale x weight scale) is fine when symmetric
                found.append(Violation(graph, name, node.op_type, "asymmetric int32 bias (zero point != 0)"))
        elif zp.dtype != np.int8:
            found.append(Violation(graph, name, node.op_type, f"{zp.dtype} quantization, need symmetric int8"))
        elif np.any(zp != 0):
            found.append(Violation(graph, name, node.op_type, "asymmetric INT8 (zero point != 0)"))
    if scale is None:
        return found
    is_weight = node.op_type == "DequantizeLinear" and const(node.input[0]) is not None
    if is_weight and rules.per_channel_weights:
        w = const(node.input[0])
        if w.ndim >= 2 and w.dtype != np.int32 and scale.size == 1:
            found.append(Violation(graph, name, node.op_type, "per-tensor weight scale, need per-channel"))
    if node.op_type == "QuantizeLinear" and rules.per_tensor_activations and scale.size != 1:
        found.append(Violation(graph, name, node.op_type, f"per-channel activation scale ({scale.size}), need per-tensor"))
    return found
