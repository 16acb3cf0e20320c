"""Walk an ONNX graph and name every node that breaks a target runtime's rules.

The rules come from the target config (``conf/target/*.yaml``) plus what each runtime needs of
a QDQ graph: MacaRT and TensorRT run symmetric INT8 only (zero point 0, signed), weights
per-channel and activations per-tensor (MacaRT), and LayerNorm / Softmax / GELU left in float.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
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


def check_triton_repository(folder: Path, meta: dict, kind: str, max_batch: Optional[int] = None) -> list[str]:
    """Every way ``<folder>/triton/`` breaks its contract (``pipeline/export/triton.py``), one line each:
    each ``config.pbtxt`` parses with Triton's own schema (``model_config_pb2``) and declares the Python
    backend, a batch size, dynamic batching and an instance group of ``kind``; its input and output are the
    names and shapes ``model.py`` reads and ``package.json: triton`` records; ``model.py`` and the runtime's
    modules lie beside it as export writes them; the package it names is this one. ``max_batch``: the
    largest batch the package's graphs take (the TensorRT profiles'), where they have one."""
    from pipeline.errors import PipelineError
    from pipeline.export import triton

    found: list[str] = []
    repo = folder / triton.REPOSITORY
    entry = meta.get("triton")
    if not repo.is_dir():
        return [f"{triton.REPOSITORY}/ is missing"]
    if not isinstance(entry, dict):
        return ["package.json has no 'triton' entry"]
    models = sorted(p.name for p in repo.iterdir() if p.is_dir())
    if models != [triton.MODEL] or entry.get("model") != triton.MODEL:
        found.append(f"{triton.REPOSITORY}/ holds models {models}, package.json names {entry.get('model')!r}; "
                     f"want [{triton.MODEL!r}]")
    for model in models:
        where = f"{triton.REPOSITORY}/{model}/{triton.CONFIG_FILE}"
        path = repo / model / triton.CONFIG_FILE
        if not path.is_file():
            found.append(f"{where} is missing")
            continue
        try:
            config = triton.parse_config(path.read_text(encoding="utf-8"), where)
        except PipelineError as exc:
            found.append(str(exc))
            continue
        found += [f"{where}: {p}" for p in _triton_config_problems(config, model, entry, kind, max_batch)]
        version = repo / model / triton.VERSION
        model_py = version / triton.MODEL_FILE
        if not model_py.is_file() or model_py.read_bytes() != triton.TEMPLATE.read_bytes():
            found.append(f"{triton.REPOSITORY}/{model}/{triton.VERSION}/{triton.MODEL_FILE} is missing or not "
                         f"the one export writes")
        for name, source in triton.runtime_modules().items():
            rel = triton.vendored_path(name, source)
            if not (version / rel).is_file() or (version / rel).read_bytes() != source.read_bytes():
                found.append(f"{triton.REPOSITORY}/{model}/{triton.VERSION}/{rel} (the runtime model.py imports) "
                             f"is missing or differs from {name}")
        params = {k: v.string_value for k, v in config.parameters.items()}
        named = (repo / model / params.get(triton.PACKAGE_PARAMETER, "")).resolve()
        if triton.PACKAGE_PARAMETER not in params or named != folder.resolve():
            found.append(f"{where}: parameter {triton.PACKAGE_PARAMETER!r} "
                         f"({params.get(triton.PACKAGE_PARAMETER)!r}) does not name this package")
    return found


def _triton_config_problems(config, model: str, entry: dict, kind: str, max_batch: Optional[int]) -> list[str]:
    from pipeline.export import triton

    pb = triton.model_config_pb2()
    found = []
    if config.name != model:
        found.append(f"name {config.name!r} is not its folder's {model!r}")
    if config.backend != "python":
        found.append(f"backend {config.backend!r}, want 'python' (model.py)")
    if config.max_batch_size < 1:
        found.append(f"max_batch_size {config.max_batch_size}: the model reads batches, want >= 1")
    if config.max_batch_size != entry.get("max_batch_size"):
        found.append(f"max_batch_size {config.max_batch_size} is not package.json's {entry.get('max_batch_size')}")
    if max_batch is not None and config.max_batch_size > max_batch:
        found.append(f"max_batch_size {config.max_batch_size} exceeds the graphs' largest batch {max_batch}")
    if not config.HasField("dynamic_batching"):
        found.append("no dynamic_batching")
    else:
        over = [b for b in config.dynamic_batching.preferred_batch_size if not 1 <= b <= config.max_batch_size]
        if over:
            found.append(f"preferred_batch_size {over} outside [1, max_batch_size]")
    kinds = [pb.ModelInstanceGroup.Kind.Name(g.kind) for g in config.instance_group]
    if not kinds or any(k != kind for k in kinds):
        found.append(f"instance_group kinds {kinds}, want [{kind}] (the target's)")
    for what, tensors, name in (("input", config.input, entry.get("input")), ("output", config.output, entry.get("output"))):
        want = triton.IMAGE_INPUT if what == "input" else triton.LATEX_OUTPUT
        got = [(t.name, pb.DataType.Name(t.data_type), list(t.dims)) for t in tensors]
        if got != [(want, "TYPE_STRING", [1])] or name != want:
            found.append(f"{what} {got} (package.json: {name!r}), want [({want!r}, 'TYPE_STRING', [1])]: "
                         f"what model.py reads and writes")
    return found
