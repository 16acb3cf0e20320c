"""TensorRT engines from the exported ONNX: optimization profiles, the ``trtexec`` command, and a
builder on the TensorRT Python API (runs wherever ``tensorrt`` imports)."""
from __future__ import annotations

import json
import logging
import shlex
import time
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.names import DECODER_FIRST, DECODER_STEP, DECODER_VERIFY, ENCODER
from pipeline.tokens.policy import TokenPolicy

log = logging.getLogger(__name__)

Shape = tuple[int, ...]


def profiles(meta: dict, max_batch: int, opt_len: int) -> dict[str, dict[str, tuple[Shape, Shape, Shape]]]:
    """min/opt/max shape per dynamic input of each graph: batch 1..max_batch (opt 1, a single
    request), decoded length 1..max_length (opt ``opt_len``), memory length fixed by the image;
    ``decoder_verify`` at batch 1, 1..``meta['verify_width']`` tokens (package.json holds it wherever the
    graph is; opt: the widest call). With a token policy the memory is as long as the tokens an image keeps:
    its smallest bucket .. its largest (opt: the second, a typical formula), and a ViT's class token(s)."""
    c, h, w = meta["input_shape"]
    heads, head_dim, mem_len = meta["num_heads"], meta["head_dim"], meta["memory_length"]
    max_len = int(meta["max_length"])
    d = meta["hidden_size"]
    opt_len = max(1, min(opt_len, max_len - 1))
    spec = meta.get("token_policy")
    buckets = list(spec["buckets"]) if spec else [mem_len]
    kept = (buckets[0], buckets[min(1, len(buckets) - 1)], buckets[-1])  # the encoder's keep: min, opt, max
    specials = mem_len - TokenPolicy.from_dict(spec).num_patches if spec else 0  # a ViT's class token(s)
    mem = tuple(specials + k for k in kept)

    def kv(length_min: int, length_opt: int, length_max: int):
        return ((1, heads, length_min, head_dim), (1, heads, length_opt, head_dim), (max_batch, heads, length_max, head_dim))

    io = meta["io"]
    out: dict[str, dict[str, tuple[Shape, Shape, Shape]]] = {
        ENCODER: {"images": ((1, c, h, w), (1, c, h, w), (max_batch, c, h, w)),
                  **({"keep": ((1, kept[0]), (1, kept[1]), (max_batch, kept[2]))} if "keep" in io.get(ENCODER, {}).get("inputs", [])
                     else {})},
        DECODER_FIRST: {"input_ids": ((1, 1), (1, 1), (max_batch, max_len)),
                        "memory": ((1, mem[0], d), (1, mem[1], d), (max_batch, mem[2], d))},
        DECODER_STEP: {"input_ids": ((1, 1), (1, 1), (max_batch, 1))},
    }
    for name in io[DECODER_STEP]["inputs"][1:]:
        if name.startswith("past_"):
            out[DECODER_STEP][name] = kv(1, opt_len, max_len - 1)
        else:
            out[DECODER_STEP][name] = kv(*mem)
    if DECODER_VERIFY in meta.get("graphs", {}):
        width = int(meta["verify_width"])  # batch 1, up to width tokens
        out[DECODER_VERIFY] = {"input_ids": ((1, 1), (1, width), (1, width))}
        for name, shape in out[DECODER_STEP].items():
            if name != "input_ids":
                out[DECODER_VERIFY][name] = tuple((1, *s[1:]) for s in shape)  # batch 1 only
    return out


def _dims(s: Shape) -> str:
    return "x".join(str(int(v)) for v in s)


def trtexec_command(onnx_name: str, engine_name: str, profile: dict[str, tuple[Shape, Shape, Shape]], int8: bool,
                    timing_cache: str = "timing.cache") -> str:
    parts = ["trtexec", f"--onnx={onnx_name}", f"--saveEngine={engine_name}", "--fp16"]
    if int8:
        parts.append("--int8")  # explicit quantization: the Q/DQ nodes of the graph set the scales
    for flag, i in (("--minShapes", 0), ("--optShapes", 1), ("--maxShapes", 2)):
        parts.append(f"{flag}=" + ",".join(f"{k}:{_dims(v[i])}" for k, v in profile.items()))
    parts += [f"--timingCacheFile={timing_cache}", "--skipInference", "--verbose"]
    return " ".join(shlex.quote(p) for p in parts)


def tensorrt_available() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return True


def build_engine(onnx_path: Path, engine_path: Path, profile: dict[str, tuple[Shape, Shape, Shape]], int8: bool,
                 timing_cache: Path, log_path: Path, workspace_gib: float = 4.0) -> dict[str, Any]:
    """Parse the ONNX, set the profile and FP16 (+INT8 for explicit QDQ) flags, build and save the
    engine, the timing cache and the build log."""
    try:
        import tensorrt as trt
    except ImportError:
        raise PipelineError("tensorrt is not installed: run the trtexec commands in build_engines.sh "
                            "on a machine with TensorRT") from None
    lines: list[str] = []

    class _Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity, msg):  # noqa: D401 - TensorRT's callback
            lines.append(f"[{severity}] {msg}")

    logger = _Logger()
    builder = trt.Builder(logger)
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH"):  # implicit in TensorRT >= 10
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        log_path.write_text("\n".join(lines + errors) + "\n")
        raise PipelineError(f"{onnx_path.name}: TensorRT cannot parse it: {errors[0] if errors else 'unknown error'}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    config.set_flag(trt.BuilderFlag.FP16)
    if int8:
        config.set_flag(trt.BuilderFlag.INT8)
    cache_bytes = timing_cache.read_bytes() if timing_cache.is_file() else b""
    cache = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(cache, ignore_mismatch=False)
    opt_profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile.items():
        opt_profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(opt_profile)
    t0 = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - t0
    log_path.write_text("\n".join(lines) + "\n")
    if serialized is None:
        raise PipelineError(f"{onnx_path.name}: TensorRT engine build failed; see {log_path.name}")
    engine_path.write_bytes(bytes(serialized))
    timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
    return {"engine": engine_path.name, "build_seconds": round(seconds, 1), "int8": int8, "fp16": True}


def engines(folder: Path, meta: dict, models: dict[str, Any], max_batch: int, opt_length: int, build: bool) -> dict:
    """A package's TensorRT side: ``build_engines.sh`` (one ``trtexec`` command a graph, INT8 where the
    graph holds Q/DQ) and ``tensorrt_profiles.json`` always; the engines themselves where ``tensorrt``
    imports and ``build`` is on. Returns what was done (``parity.json: tensorrt``)."""
    from pipeline.export.transforms import has_qdq

    shapes = profiles(meta, max_batch, opt_length)
    lines = ["#!/bin/sh", "# TensorRT engines for this package: run in this folder on the target machine.", "set -e"]
    for g, m in models.items():
        lines.append(trtexec_command(f"{g}.onnx", f"{g}.plan", shapes[g], int8=has_qdq(m)))
    (folder / "build_engines.sh").write_text("\n".join(lines) + "\n")
    (folder / "tensorrt_profiles.json").write_text(json.dumps(shapes, indent=2) + "\n")
    if not tensorrt_available():
        log.warning("[export] tensorrt is not installed here: engines not built; run build_engines.sh "
                    "(trtexec) on a machine with TensorRT")
        return {"built": False, "reason": "tensorrt not installed", "commands": "build_engines.sh"}
    if not build:
        return {"built": False, "reason": "export.trt_build=false", "commands": "build_engines.sh"}
    results = {g: build_engine(folder / f"{g}.onnx", folder / f"{g}.plan", shapes[g], has_qdq(m),
                               folder / "timing.cache", folder / f"{g}.build.log") for g, m in models.items()}
    return {"built": True, "engines": results, "commands": "build_engines.sh"}
