"""The graph transforms a target picks from, in the order build.py applies them: onnxsim
simplification, ONNX Runtime's transformer fusions, FP16 weights, the IR version clamp, the checker.
Also what build.py reads off a graph between them: its op histogram, whether it holds Q/DQ."""
from __future__ import annotations

import collections
import contextlib
import warnings
from pathlib import Path

import onnx
from onnx import helper

from pipeline.errors import PipelineError

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")


def op_histogram(model: onnx.ModelProto) -> dict[str, int]:
    """Op types with their counts; contrib ops carry their domain (``com.microsoft.Attention``)."""
    c = collections.Counter((f"{n.domain}." if n.domain not in ("", "ai.onnx") else "") + n.op_type
                            for n in model.graph.node)
    return dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))


def has_qdq(model: onnx.ModelProto) -> bool:
    return any(n.op_type in QDQ_OPS for n in model.graph.node)


def simplify(model: onnx.ModelProto, graph: str) -> onnx.ModelProto:
    import onnxsim

    try:
        simplified, ok = onnxsim.simplify(model)
    except Exception as exc:  # onnxsim raises plain RuntimeErrors from C++
        raise PipelineError(f"{graph}: onnxsim failed: {str(exc).splitlines()[0]}") from None
    if not ok:
        raise PipelineError(f"{graph}: onnxsim could not check the simplified graph")
    return simplified


def fuse_transformer(model: onnx.ModelProto, num_heads: int, hidden_size: int, workdir: Path, graph: str
                     ) -> onnx.ModelProto:
    """ONNX Runtime's transformer optimizer, offline fusions only (opt_level 0): the graph stays
    loadable by any ORT with contrib ops and the session still applies its own level on top.

    ``SkipLayerNormalization`` is not fused offline: ORT's CPU kernel for the offline-fused form
    took 1.1 ms per 1024x256 call on this CPU (9 ms of a 42 ms INT8 encoder), while residual Add +
    ``LayerNormalization`` (which the session fuses where it can) took 2.3 ms for all eight
    (docs/export.md)."""
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    path = workdir / f"{graph}.pre_fuse.onnx"
    onnx.save(model, path)
    options = FusionOptions("bert")
    options.enable_skip_layer_norm = False
    options.enable_bias_skip_layer_norm = False
    with _quiet_optimizer(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = optimize_model(str(path), model_type="bert", num_heads=num_heads, hidden_size=hidden_size,
                             opt_level=0, optimization_options=options)
    opt.topological_sort()
    model = opt.model
    if any(n.domain == "com.microsoft" for n in model.graph.node) and \
            not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


@contextlib.contextmanager
def _quiet_optimizer():
    """The transformer optimizer logs every fusion at INFO through its own module loggers
    (``fusion_*``, ``onnx_model*``; the report lists the fusions): raise just those to WARNING
    for the call, leaving every other logger of the process alone."""
    import logging

    names = [n for n in list(logging.root.manager.loggerDict) if n.startswith(("fusion_", "onnx_model"))]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _isolate_outputs(model: onnx.ModelProto) -> None:
    """A graph output also read inside the graph gets its own Identity, so the FP16 converter can
    put a Cast on the output without retyping the internal edge (onnxconverter-common's bug)."""
    outs = {o.name for o in model.graph.output}
    extra = []
    for node in model.graph.node:
        for j, name in enumerate(node.output):
            if name in outs:
                node.output[j] = f"{name}__value"
                extra.append(helper.make_node("Identity", [f"{name}__value"], [name], name=f"{name}/output"))
    renamed = {e.input[0][: -len("__value")]: e.input[0] for e in extra}
    for node in model.graph.node:
        for k, name in enumerate(node.input):
            if name in renamed:
                node.input[k] = renamed[name]
    model.graph.node.extend(extra)


def _drop_noop_casts(model: onnx.ModelProto) -> None:
    """Remove Casts to the type their input already has (torch's ``.float()`` on float logits):
    the FP16 converter would retype their output but keep their ``to`` attribute."""
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in
             [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    outputs = {o.name for o in model.graph.output}
    rename = {}
    keep = []
    for node in model.graph.node:
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        if node.op_type == "Cast" and to is not None and types.get(node.input[0]) == to:
            if node.output[0] in outputs:  # a graph output keeps its name: the Cast becomes an Identity
                node.op_type = "Identity"
                del node.attribute[:]
            else:
                rename[node.output[0]] = rename.get(node.input[0], node.input[0])
                continue
        keep.append(node)
    for node in keep:
        for k, name in enumerate(node.input):
            if name in rename:
                node.input[k] = rename[name]
    del model.graph.node[:]
    model.graph.node.extend(keep)


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """FP16 weights and compute; graph inputs and outputs stay float32; Q/DQ stay float32 (opset
    17 DequantizeLinear takes float scales only)."""
    from onnxconverter_common import float16

    model = onnx.ModelProto.FromString(model.SerializeToString())
    _drop_noop_casts(model)
    del model.graph.value_info[:]  # stale float32 shape info makes the converter mistype edges
    _isolate_outputs(model)
    block = list(float16.DEFAULT_OP_BLOCK_LIST) + list(QDQ_OPS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float16.convert_float_to_float16(model, keep_io_types=True, op_block_list=block)


def residual_adds_as_sum(model: onnx.ModelProto) -> int:
    """Every residual ``Add`` (two computed inputs) whose only reader is a ``LayerNormalization`` becomes
    ``Sum``, in place; returns how many. The same sum, but ONNX Runtime's session fuses only ``Add`` +
    LayerNorm into ``SkipLayerNormalization``, whose CPU kernel took 0.40 ms for one 384x256 call where
    ``Sum`` + ``LayerNormalization`` take 0.05 (the encoder's last block: 4 % of the INT8 encoder;
    docs/results/2026-12-07-export-residual-sum.md). Elsewhere each residual also feeds the next block,
    which the fusion leaves alone."""
    constants = {t.name for t in model.graph.initializer} | \
        {n.output[0] for n in model.graph.node if n.op_type == "Constant"}
    readers: dict[str, list[onnx.NodeProto]] = collections.defaultdict(list)
    for node in model.graph.node:
        for name in node.input:
            readers[name].append(node)
    outputs = {o.name for o in model.graph.output}
    changed = 0
    for node in model.graph.node:
        if node.op_type != "Add" or node.domain not in ("", "ai.onnx") or any(i in constants for i in node.input):
            continue
        after = readers.get(node.output[0], [])
        if node.output[0] not in outputs and len(after) == 1 and after[0].op_type == "LayerNormalization":
            node.op_type = "Sum"
            changed += 1
    return changed


def clamp_ir_version(model: onnx.ModelProto, max_ir: int | None) -> None:
    if max_ir is not None and model.ir_version > max_ir:
        model.ir_version = max_ir


def check(model: onnx.ModelProto, graph: str) -> None:
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        raise PipelineError(f"{graph}: invalid ONNX graph: {str(exc).splitlines()[0]}") from None
