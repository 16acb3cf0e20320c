"""torch -> ONNX for the three graphs, and the graph transforms every target picks from
(onnxsim simplification, ONNX Runtime transformer fusions, FP16 weights, IR version clamp)."""
from __future__ import annotations

import collections
import contextlib
import io
import warnings
from pathlib import Path

import onnx
import torch
from onnx import helper

from pipeline.errors import PipelineError
from pipeline.export.graphs import (VERIFY_WIDTH, DecoderFirstGraph, DecoderStepGraph, DecoderVerifyGraph, EncoderGraph,
                                    io_names)

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")


def graph_io(num_layers: int) -> dict[str, dict[str, list[str]]]:
    """Input and output names of each graph (the runner and the TensorRT profiles read these)."""
    n = io_names(num_layers)
    return {
        "encoder": {"inputs": ["images"], "outputs": ["memory"]},
        "decoder_first": {"inputs": ["input_ids", "memory"], "outputs": ["logits", *n["present"], *n["cross"]]},
        "decoder_step": {"inputs": ["input_ids", *n["past"], *n["cross"]], "outputs": ["logits", *n["present"]]},
        # speculative decoding's check of T drafted tokens: logits [B, T, V]
        "decoder_verify": {"inputs": ["input_ids", *n["past"], *n["cross"]], "outputs": ["logits", *n["present"]]},
    }


def _to_model(module: torch.nn.Module, args: tuple, names: dict[str, list[str]], dynamic: dict, opset: int
              ) -> onnx.ModelProto:
    buf = io.BytesIO()
    module.eval()  # a fresh wrapper is in train mode: dropout on
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the TorchScript exporter with dynamic_axes writes opset 17 directly (no down-conversion)
        torch.onnx.export(module, args, buf, dynamo=False, opset_version=opset, do_constant_folding=True,
                          input_names=names["inputs"], output_names=names["outputs"], dynamic_axes=dynamic)
    return onnx.load_from_string(buf.getvalue())


def export_graphs(adapter, opset: int) -> dict[str, onnx.ModelProto]:
    """Encoder, decoder first step, decoder step with past K/V and the verify graph (T tokens after a
    past, logits after each); dynamic batch and sequence axes.

    The decoder graphs wrap the adapter's KV-cached decoder (``ModelAdapter.cached_decoder``)."""
    adapter.model.eval()
    cached = adapter.cached_decoder()
    if cached is None:
        raise PipelineError(f"model family {adapter.family!r} has no KV-cached decoder to export")
    cached = cached.eval()
    nl = int(cached.num_layers)
    io = graph_io(nl)
    n = io_names(nl)
    images = torch.rand(2, *adapter.input_shape)
    with torch.no_grad():
        memory = adapter.encode(images)
    graphs = {"encoder": _to_model(EncoderGraph(adapter), (images,), io["encoder"],
                                   {"images": {0: "batch"}, "memory": {0: "batch"}}, opset)}
    first = DecoderFirstGraph(cached).eval()
    ids = torch.tensor([[adapter.bos_id, 5, 6], [adapter.bos_id, 7, 7]], dtype=torch.long)
    dyn = {"input_ids": {0: "batch", 1: "seq"}, "memory": {0: "batch", 1: "mem_len"}, "logits": {0: "batch"}}
    dyn.update({k: {0: "batch", 2: "seq"} for k in n["present"]})
    dyn.update({k: {0: "batch", 2: "mem_len"} for k in n["cross"]})
    graphs["decoder_first"] = _to_model(first, (ids, memory), io["decoder_first"], dyn, opset)
    with torch.no_grad():
        kv = first(ids, memory)[1:]
    dyn = {"input_ids": {0: "batch"}, "logits": {0: "batch"}}
    dyn.update({k: {0: "batch", 2: "past_len"} for k in n["past"]})
    dyn.update({k: {0: "batch", 2: "total_len"} for k in n["present"]})
    dyn.update({k: {0: "batch", 2: "mem_len"} for k in n["cross"]})
    step_ids = torch.tensor([[9], [10]], dtype=torch.long)
    graphs["decoder_step"] = _to_model(DecoderStepGraph(cached).eval(), (step_ids, *kv), io["decoder_step"], dyn, opset)
    # batch 1 and VERIFY_WIDTH tokens, fixed: only the past's length (and the memory's) stay dynamic
    dyn = {k: {2: "past_len"} for k in n["past"]}
    dyn.update({k: {2: "total_len"} for k in n["present"]})
    dyn.update({k: {2: "mem_len"} for k in n["cross"]})
    verify_ids = (torch.arange(VERIFY_WIDTH, dtype=torch.long) % 7 + 4)[None]
    graphs["decoder_verify"] = _to_model(DecoderVerifyGraph(cached).eval(), (verify_ids, *[t[:1] for t in kv]),
                                         io["decoder_verify"], dyn, opset)
    return graphs


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


def clamp_ir_version(model: onnx.ModelProto, max_ir: int | None) -> None:
    if max_ir is not None and model.ir_version > max_ir:
        model.ir_version = max_ir


def check(model: onnx.ModelProto, graph: str) -> None:
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        raise PipelineError(f"{graph}: invalid ONNX graph: {str(exc).splitlines()[0]}") from None
