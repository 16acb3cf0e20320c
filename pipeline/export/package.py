"""Build an exported package folder: graphs per target, metadata, tokenizer, preprocessing."""
from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import onnx
import torch

from pipeline.errors import PipelineError
from pipeline.export import onnx_graphs as og
from pipeline.export.runtime import PACKAGE_META, PREPROCESS, TOKENIZER
from pipeline.export.targets import Target
from pipeline.export.validator import Violation, validate
from pipeline.export.fusion import fuse_attention, fuse_cached_attention


@dataclass
class BuiltGraphs:
    models: dict[str, onnx.ModelProto]
    histograms: dict[str, dict[str, dict[str, int]]]  # graph -> phase -> op histogram
    precision: dict[str, str]
    violations: list[Violation] = field(default_factory=list)


_EXPORTED: dict[tuple[str, int], dict[str, bytes]] = {}


def exported_graphs(adapter, opset: int, model_key: Optional[str]) -> dict[str, onnx.ModelProto]:
    """torch -> ONNX, memoized in-process by (model hash, opset): exporting for several targets in one
    process (tests, notebooks) traces the model once."""
    key = (model_key, opset) if model_key else None
    if key is None or key not in _EXPORTED:
        raw = og.export_graphs(adapter, opset)
        if key is None:
            return raw
        _EXPORTED[key] = {g: m.SerializeToString() for g, m in raw.items()}
    return {g: onnx.load_from_string(b) for g, b in _EXPORTED[key].items()}


def build_graphs(adapter, target: Target, simplify: bool, qdq_encoder: Optional[Path], progress,
                 model_key: Optional[str] = None, int8_decoders: Optional[dict[str, Path]] = None) -> BuiltGraphs:
    """The target's three graphs. ``qdq_encoder``: a QDQ encoder used instead of the float one;
    ``int8_decoders``: decoder graphs stage quantize already made final for this target (ORT's
    dynamic INT8 on ort_cpu), used as they are."""
    raw = exported_graphs(adapter, target.opset, model_key)
    progress("exported")
    hist: dict[str, dict[str, dict[str, int]]] = {g: {"exported": og.op_histogram(m)} for g, m in raw.items()}
    precision = {g: ("fp16" if target.fp16_weights else "fp32") for g in raw}
    if qdq_encoder is not None:
        raw["encoder"] = load_qdq_encoder(qdq_encoder, raw["encoder"])
        hist["encoder"] = {"qdq input": og.op_histogram(raw["encoder"])}
        precision["encoder"] = "int8 qdq" + (" + fp16" if target.fp16_weights else "")
    final = set()
    if "decoder_step" in (int8_decoders or {}) and "decoder_verify" not in int8_decoders:
        # a quantize artifact from before the verify graph: a float verify would not read as the INT8 step
        del raw["decoder_verify"], hist["decoder_verify"], precision["decoder_verify"]
    for g, path in (int8_decoders or {}).items():
        raw[g] = load_final_graph(path, raw[g], g)
        hist[g] = {"int8 input": og.op_histogram(raw[g])}
        precision[g] = "int8 weights"
        final.add(g)
    shapes = decoder_shapes(adapter)
    heads = sorted(set(adapter.encoder_head_counts()) | {shapes["num_heads"]})
    hidden = shapes["hidden_size"]  # 0 heads / hidden: the optimizer reads them from the graph
    out = {}
    with tempfile.TemporaryDirectory(prefix="fuse-") as tmp:

        def transformed(g: str, m: onnx.ModelProto) -> onnx.ModelProto:
            steps = hist[g]
            qdq = og.has_qdq(m)
            # onnxsim and ORT's fusions would constant-fold DequantizeLinear(weights) back to float
            if simplify and not qdq:
                m = og.simplify(m, g)
                steps["simplified"] = og.op_histogram(m)
            if target.fuse and not qdq:
                m = og.fuse_transformer(m, *((heads[0], hidden) if len(heads) == 1 else (0, 0)), Path(tmp), g)
                if g == "encoder":  # what the transformer optimizer leaves: the unmasked ViT attention
                    fuse_attention(m)
                elif g in ("decoder_step", "decoder_verify"):  # and the attention over the K/V caches
                    fuse_cached_attention(m, causal=g == "decoder_verify")
                steps["fused"] = og.op_histogram(m)
            return m

        for g, m in raw.items():
            if g in final:
                og.clamp_ir_version(m, target.rules.max_ir_version)
                og.check(m, g)
                out[g] = m
                progress(g)
                continue
            m = transformed(g, m)
            if target.fp16_weights:
                m = og.to_fp16(m)
                hist[g]["fp16"] = og.op_histogram(m)
            og.clamp_ir_version(m, target.rules.max_ir_version)
            og.check(m, g)
            out[g] = m
            progress(g)
    violations = [v for g, m in out.items() for v in validate(m, target.rules, g)]
    return BuiltGraphs(out, hist, precision, violations)


def load_qdq_encoder(path: Path, exported: onnx.ModelProto) -> onnx.ModelProto:
    if not path.is_file():
        raise PipelineError(f"export.qdq_encoder: no such file {path}")
    try:
        m = onnx.load(str(path))
    except Exception as exc:  # protobuf DecodeError and friends
        raise PipelineError(f"export.qdq_encoder: {path} is not an ONNX model ({type(exc).__name__})") from None
    if not og.has_qdq(m):
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
    """Layers, heads, head size, hidden size and memory length, read off one encoder + cache run."""
    cached = adapter.cached_decoder()
    if cached is None:
        raise PipelineError(f"model family {adapter.family!r} has no KV-cached decoder to export")
    with torch.no_grad():
        memory = adapter.encode(torch.zeros(1, *adapter.input_shape))
        k = cached.eval().cross_kv(memory)[0]  # [1, H, N, d]
    return {"num_layers": int(cached.num_layers), "num_heads": int(k.shape[1]), "head_dim": int(k.shape[3]),
            "hidden_size": int(memory.shape[-1]), "memory_length": int(memory.shape[1])}


def write_package(folder: Path, adapter, built: BuiltGraphs, target: Target, max_length: int) -> dict[str, Any]:
    """The files a deployment engineer ships; returns ``package.json``'s content."""
    shapes = decoder_shapes(adapter)
    nl = shapes["num_layers"]
    graphs = {}
    for g, m in built.models.items():
        onnx.save(m, str(folder / f"{g}.onnx"))
        graphs[g] = f"{g}.onnx"
    shutil.copyfile(adapter.tokenizer_path, folder / TOKENIZER)
    (folder / PREPROCESS).write_text(json.dumps(adapter.preprocess_spec(), indent=2) + "\n")
    meta = {
        "format": "formula-compress onnx package v1",
        "target": target.name, "provider": target.provider, "provider_options": target.provider_options,
        "graphs": graphs, "io": og.graph_io(nl), "precision": built.precision,
        "opset": target.opset, "ir_version": {g: int(m.ir_version) for g, m in built.models.items()},
        # the char vocabulary, or the formula BPE (HF tokenizers JSON) of a decoder from stage distill
        # (hf: any HF tokenizers JSON, read with the ids below)
        "tokenizer": {"file": TOKENIZER, "kind": adapter.tokenizer_kind()},
        "bos_id": adapter.bos_id, "eos_id": adapter.eos_id, "pad_id": adapter.pad_id,
        "banned_token_ids": adapter.banned_token_ids(), "max_length": int(max_length),
        "max_positions": adapter.max_positions or int(max_length),  # the decoder position table
        # tokens a decoder_verify call reads (batch 1; speculative decoding, pipeline/decoding.py)
        **({"verify_width": int(built.models["decoder_verify"].graph.input[0].type.tensor_type.shape.dim[1].dim_value)}
           if "decoder_verify" in built.models else {}),
        **shapes,
        "input_shape": list(adapter.input_shape), "model_family": adapter.family,
        # greedy decoding's cap on runs of layout-only LaTeX (pipeline/decoding.py; 0 = none)
        "layout_run_cap": int(adapter.layout_run_cap),
        "decoding": "greedy; decoder_first(BOS, memory) then decoder_step per token with the present K/V fed "
                    "back as past; pad and BOS logits set to -inf; stop at EOS or max_length tokens incl. BOS; "
                    "where layout_run_cap > 0, a token that would make the reading end in more than that many "
                    "layout-only atoms (spacing, &, \\\\, style switches) gives way to the best one that does not",
    }
    (folder / PACKAGE_META).write_text(json.dumps(meta, indent=2) + "\n")
    missing = [k for k in target.required_provider_options if k not in target.provider_options]
    if missing:
        raise PipelineError(f"target.provider_options for {target.name} lacks {missing}")
    (folder / "provider_options.json").write_text(json.dumps(
        {"provider": target.provider, "options": target.provider_options}, indent=2) + "\n")
    return meta
