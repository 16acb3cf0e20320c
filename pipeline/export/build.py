"""A target's graphs, from the torch model to checked ONNX, one step after the other:

1. trace     torch -> ONNX (``onnx_graphs.export_graphs``), memoized per model and opset
2. inputs    stage quantize's graphs take the traced ones' place: a QDQ encoder, ort_cpu's INT8
             decoders (final: they skip steps 3-5)
3. simplify  onnxsim (``transforms.simplify``)
4. fuse      ORT's transformer fusions, then the attention they leave (``fusion.py``)
5. fp16      FP16 weights and compute, on targets that want them
   sum       residual Adds read by a LayerNorm as Sum, on targets that want them (ort_cpu: the
             session's SkipLayerNormalization is slower than both ops; every graph, final ones too)
6. clamp     the IR version down to the target's maximum
7. check     ``onnx.checker``
8. validate  the target's rules (``validator.validate``): violations are returned, not raised

Steps 3 and 4 skip a graph with Q/DQ nodes: onnxsim and ORT's fusions would constant-fold
DequantizeLinear(weights) back to float. ``package.write_package`` then writes the folder.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import onnx
import torch

from pipeline.errors import PipelineError
from pipeline.export import transforms
from pipeline.export.fusion import fuse_attention, fuse_cached_attention
from pipeline.export.onnx_graphs import export_graphs
from pipeline.export.targets import Target
from pipeline.export.transforms import has_qdq, op_histogram
from pipeline.export.validator import Violation, validate
from pipeline.names import DECODER_STEP, DECODER_VERIFY, ENCODER


@dataclass
class BuiltGraphs:
    models: dict[str, onnx.ModelProto]
    histograms: dict[str, dict[str, dict[str, int]]]  # graph -> phase -> op histogram
    precision: dict[str, str]
    violations: list[Violation] = field(default_factory=list)


def build_graphs(adapter, target: Target, simplify: bool, qdq_encoder: Optional[Path], progress,
                 model_key: Optional[str] = None, int8_decoders: Optional[dict[str, Path]] = None,
                 only: Optional[Sequence[str]] = None) -> BuiltGraphs:
    """The target's graphs (``only``: these of them). ``qdq_encoder``: a QDQ encoder used instead of the
    float one; ``int8_decoders``: decoder graphs stage quantize already made final for this target (ORT's
    dynamic INT8 on ort_cpu), used as they are."""
    graphs = exported_graphs(adapter, target.opset, model_key)  # 1. trace
    if only is not None:
        graphs = {g: m for g, m in graphs.items() if g in only}
    progress("exported")
    hist: dict[str, dict[str, dict[str, int]]] = {g: {"exported": op_histogram(m)} for g, m in graphs.items()}
    precision = {g: ("fp16" if target.fp16_weights else "fp32") for g in graphs}
    final = _take_quantized(graphs, hist, precision, target, qdq_encoder, int8_decoders)  # 2. inputs
    shapes = decoder_shapes(adapter)
    heads = sorted(set(adapter.encoder_head_counts()) | {shapes["num_heads"]})
    # 0 heads / hidden: the optimizer reads them from the graph
    heads_hidden = (heads[0], shapes["hidden_size"]) if len(heads) == 1 else (0, 0)
    out = {}
    with tempfile.TemporaryDirectory(prefix="fuse-") as tmp:
        for g, m in graphs.items():
            float_graph = g not in final and not has_qdq(m)
            if simplify and float_graph:  # 3. simplify
                m = transforms.simplify(m, g)
                hist[g]["simplified"] = op_histogram(m)
            if target.fuse and float_graph:  # 4. fuse
                m = _fuse(m, g, heads_hidden, Path(tmp))
                hist[g]["fused"] = op_histogram(m)
            if target.fp16_weights and g not in final:  # 5. fp16
                m = transforms.to_fp16(m)
                hist[g]["fp16"] = op_histogram(m)
            if target.residual_sum and transforms.residual_adds_as_sum(m):  # 5b. sum
                hist[g]["residual sum"] = op_histogram(m)
            transforms.clamp_ir_version(m, target.rules.max_ir_version)  # 6. clamp
            transforms.check(m, g)  # 7. check
            out[g] = m
            progress(g)
    violations = [v for g, m in out.items() for v in validate(m, target.rules, g)]  # 8. validate
    return BuiltGraphs(out, hist, precision, violations)


_EXPORTED: dict[tuple[str, int], dict[str, bytes]] = {}


def exported_graphs(adapter, opset: int, model_key: Optional[str]) -> dict[str, onnx.ModelProto]:
    """torch -> ONNX, memoized in-process by (model hash, opset): exporting for several targets in one
    process (tests, notebooks) traces the model once."""
    key = (model_key, opset) if model_key else None
    if key is None or key not in _EXPORTED:
        raw = export_graphs(adapter, opset)
        if key is None:
            return raw
        _EXPORTED[key] = {g: m.SerializeToString() for g, m in raw.items()}
    return {g: onnx.load_from_string(b) for g, b in _EXPORTED[key].items()}


def _take_quantized(graphs: dict[str, onnx.ModelProto], hist: dict, precision: dict[str, str], target: Target,
                    qdq_encoder: Optional[Path], int8_decoders: Optional[dict[str, Path]]) -> set[str]:
    """Put stage quantize's graphs in place of the traced ones (in ``graphs``, ``hist`` and
    ``precision``); returns the names of the graphs that are final."""
    if qdq_encoder is not None:
        graphs[ENCODER] = load_qdq_encoder(qdq_encoder, graphs[ENCODER])
        hist[ENCODER] = {"qdq input": op_histogram(graphs[ENCODER])}
        precision[ENCODER] = "int8 qdq" + (" + fp16" if target.fp16_weights else "")
    int8_decoders = int8_decoders or {}
    if DECODER_STEP in int8_decoders and DECODER_VERIFY not in int8_decoders:
        # a quantize artifact from before the verify graph: a float verify would not read as the INT8 step
        del graphs[DECODER_VERIFY], hist[DECODER_VERIFY], precision[DECODER_VERIFY]
    for g, path in int8_decoders.items():
        graphs[g] = load_final_graph(path, graphs[g], g)
        hist[g] = {"int8 input": op_histogram(graphs[g])}
        precision[g] = "int8 weights"
    return set(int8_decoders)


def _fuse(model: onnx.ModelProto, graph: str, heads_hidden: tuple[int, int], workdir: Path) -> onnx.ModelProto:
    """ORT's transformer fusions, then the attention they leave unfused."""
    model = transforms.fuse_transformer(model, *heads_hidden, workdir, graph)
    if graph == ENCODER:  # the unmasked ViT attention
        fuse_attention(model)
    elif graph in (DECODER_STEP, DECODER_VERIFY):  # the attention over the K/V caches
        fuse_cached_attention(model, causal=graph == DECODER_VERIFY)
    return model


def load_qdq_encoder(path: Path, exported: onnx.ModelProto) -> onnx.ModelProto:
    if not path.is_file():
        raise PipelineError(f"export.qdq_encoder: no such file {path}")
    try:
        m = onnx.load(str(path))
    except Exception as exc:  # protobuf DecodeError and friends
        raise PipelineError(f"export.qdq_encoder: {path} is not an ONNX model ({type(exc).__name__})") from None
    if not has_qdq(m):
        raise PipelineError(f"export.qdq_encoder: {path} has no QuantizeLinear/DequantizeLinear nodes")
    want_in = [i.name for i in exported.graph.input]
    want_out = [o.name for o in exported.graph.output]
    got_in = [i.name for i in m.graph.input if i.name not in {t.name for t in m.graph.initializer}]
    got_out = [o.name for o in m.graph.output]
    if got_in != want_in or got_out != want_out:
        raise PipelineError(f"export.qdq_encoder: {path} has inputs {got_in} / outputs {got_out}; "
                            f"the encoder needs {want_in} -> {want_out}")
    return m


def load_final_graph(path: Path, exported: onnx.ModelProto, graph: str) -> onnx.ModelProto:
    """A graph made elsewhere for this model (stage quantize), checked to have the exported I/O."""
    if not Path(path).is_file():
        raise PipelineError(f"{graph}: no such graph {path}")
    try:
        m = onnx.load(str(path))
    except Exception as exc:  # protobuf DecodeError and friends
        raise PipelineError(f"{graph}: {path} is not an ONNX model ({type(exc).__name__})") from None
    inits = {t.name for t in m.graph.initializer}
    want = ([i.name for i in exported.graph.input], [o.name for o in exported.graph.output])
    got = ([i.name for i in m.graph.input if i.name not in inits], [o.name for o in m.graph.output])
    if got != want:
        raise PipelineError(f"{graph}: {path} has inputs/outputs {got}; the model's {graph} needs {want}")
    return m


def decoder_shapes(adapter) -> dict[str, int]:
    """Layers, heads, head size, hidden size and memory length (of an image keeping every patch), read off
    one encoder + cache run."""
    cached = adapter.cached_decoder()
    if cached is None:
        raise PipelineError(f"model family {adapter.family!r} has no KV-cached decoder to export")
    with torch.no_grad():
        image = torch.zeros(1, *adapter.input_shape)
        policy = adapter.token_policy
        memory = adapter.encode(image) if policy is None else \
            adapter.encode_kept(image, torch.arange(policy.num_patches)[None])
        k = cached.eval().cross_kv(memory)[0]  # [1, H, N, d]
    return {"num_layers": int(cached.num_layers), "num_heads": int(k.shape[1]), "head_dim": int(k.shape[3]),
            "hidden_size": int(memory.shape[-1]), "memory_length": int(memory.shape[1])}
