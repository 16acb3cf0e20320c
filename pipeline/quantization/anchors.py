"""The anchors quantize compares itself with, each with its library's defaults, on the same float
ort_cpu encoder: ONNX Runtime ``quantize_dynamic``, ONNX Runtime ``quantize_static``, ModelOpt ONNX
INT8, and NNCF ``quantize_with_accuracy_control`` (an optional extra) held to the same budget on the same
search set. An anchor that cannot run here is named with the reason instead of a number."""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable, Optional

import onnx

from calibration import calibrators
from calibration.calibrators import CalibSetReader, token_feeds
from pipeline.quantization import qdq
from pipeline.quantization.groups import find_groups

log = logging.getLogger(__name__)


def int8_mac_share(model_path: Path, tokens: int, hidden: int) -> float:
    """Share of MatMul/Gemm MACs whose inputs come through DequantizeLinear or a dynamic quantizer."""
    model = onnx.load(str(model_path))
    producer = {o: n for n in model.graph.node for o in n.output}
    total = int8 = 0
    quantized_ops = {"MatMulInteger", "DynamicQuantizeMatMul", "QLinearMatMul", "MatMulIntegerToFloat", "QGemm"}
    for g in find_groups(model, tokens, hidden):
        node = next(n for n in model.graph.node if n.name == g.node)
        total += g.macs
        if any(producer.get(i) is not None and producer[i].op_type == "DequantizeLinear" for i in node.input):
            int8 += g.macs
    if not total:  # quantize_dynamic replaces the MatMuls themselves
        return 1.0 if any(n.op_type in quantized_ops for n in model.graph.node) else 0.0
    return int8 / total


# an encoder file and rows of the search set -> (exact match, one 0/1 per row): the greedy reading
# our own search is judged by, handed to NNCF as its validation function
Validate = Callable[[Path, list[int]], tuple[float, list[float]]]


def build_all(graphs, workdir: Path, calib_set, calib_images: int, by_name,
              validate: Optional[Validate] = None, search_rows: int = 0, budget: float = 0.005) -> dict[str, tuple]:
    """name -> (encoder path or None, INT8 MAC share, seconds to build, note)."""
    out: dict[str, tuple] = {}
    tokens, hidden = graphs.memory_length, graphs.hidden_size
    weights_share = sum(g.macs for g in by_name.values() if g.kind == "weights") / max(1, sum(g.macs for g in by_name.values()))

    t0 = time.perf_counter()
    path = workdir / "anchor.dynamic.onnx"
    qdq.dynamic(graphs.encoder_ort, path)
    out["ORT quantize_dynamic"] = (path, weights_share, time.perf_counter() - t0, "")

    t0 = time.perf_counter()
    path = workdir / "anchor.static.onnx"
    reader = CalibSetReader(calib_set, "images", batch_size=8, limit=calib_images,
                            extra_feeds=token_feeds(graphs.package.token_policy))
    qdq.static_defaults(graphs.encoder_ort, path, reader)
    out["ORT quantize_static (defaults)"] = (path, int8_mac_share(path, tokens, hidden), time.perf_counter() - t0,
                                            "U8 activations, per-tensor, MinMax")

    policy = graphs.package.token_policy
    out[MODELOPT] = _modelopt(graphs.encoder_std, workdir, calib_set, calib_images, tokens, hidden, policy)
    out[NNCF] = _nncf(graphs.encoder_ort, workdir, calib_set, calib_images, tokens, hidden, validate,
                      search_rows, budget, policy)
    return out


NNCF = "NNCF quantize_with_accuracy_control"
MODELOPT = "ModelOpt ONNX INT8"


def _feeds(images, policy) -> dict:
    """An encoder's feeds for a batch of ``images``: with a token policy, its ``keep`` indices too."""
    extra = token_feeds(policy)
    return {"images": images, **(extra(images) if extra is not None else {})}


def _nncf(encoder: Path, workdir: Path, calib_set, calib_images: int, tokens: int, hidden: int,
          validate: Optional[Validate], search_rows: int, budget: float, policy=None) -> tuple:
    """NNCF's accuracy-aware post-training quantization (ONNX backend) with its defaults, held to our
    budget (absolute exact-match drop) on our search set, read by our greedy decoder: it quantizes
    what its own rules pick, ranks its quantizer groups on ``subset_size`` rows and returns them to
    float one by one until the drop is within ``max_drop``."""
    if importlib.util.find_spec("nncf") is None:
        return (None, 0.0, 0.0, "not run: nncf is not installed (optional: pip install '.[compare]')")
    if validate is None or search_rows < 1:
        return (None, 0.0, 0.0, "not run: no search set to validate on")
    import nncf

    data = calibrators.calib_images(calib_set, 0, calib_images)
    scratch = workdir / "nncf-validate.onnx"
    current: list = [None]  # the model proto the scratch file holds (NNCF validates one model many times)

    def validation_fn(model, items) -> tuple[float, list[float]]:
        if current[0] is not model:
            onnx.save(model, str(scratch))
            current[0] = model
        return validate(scratch, [int(i) for i in items])

    nncf.set_log_level(logging.ERROR)
    path = workdir / "anchor.nncf.onnx"
    t0 = time.perf_counter()
    try:
        quantized = nncf.quantize_with_accuracy_control(
            onnx.load(str(encoder)), nncf.Dataset(list(data), lambda x: _feeds(x[None], policy)),
            nncf.Dataset(list(range(search_rows))), validation_fn, max_drop=budget, subset_size=calib_images)
    except Exception as exc:  # nncf raises many types; the anchor is reported as not run
        return (None, 0.0, 0.0, f"not run: NNCF failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
    finally:
        scratch.unlink(missing_ok=True)
    onnx.save(quantized, str(path))
    return (path, int8_mac_share(path, tokens, hidden), time.perf_counter() - t0,
            f"defaults, max_drop={budget} absolute on our {search_rows} search formulas (greedy exact match), "
            f"subset_size={calib_images}")


def _modelopt(encoder: Path, workdir: Path, calib_set, calib_images: int, tokens: int, hidden: int,
              policy=None) -> tuple:
    """ModelOpt's ONNX INT8 with its defaults, in a child process: importing
    ``modelopt.onnx.quantization`` patches ONNX Runtime's calibrators and quantizer registry for the
    whole process (``ort_patching.patch_ort_modules``), and every later ``quantize_static`` of ours
    in it would run on the patched code (the next calibration failed with a TypeError)."""
    if importlib.util.find_spec("modelopt") is None:
        return (None, 0.0, 0.0, "not run: modelopt is not installed")
    data = calibrators.calib_images(calib_set, 0, calib_images)
    path = workdir / "anchor.modelopt.onnx"
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        error = pool.submit(_modelopt_child, str(encoder), str(path), _feeds(data, policy)).result()
    if error:
        return (None, 0.0, 0.0, f"not run: {error}")
    return (path, int8_mac_share(path, tokens, hidden), time.perf_counter() - t0,
            "calibration_eps=cpu, high_precision_dtype=fp32, opset raised to 19 by ModelOpt")


def _modelopt_child(encoder: str, out: str, feeds: dict) -> Optional[str]:
    """Runs in the child process: ModelOpt's quantize, its output silenced; an error as one line."""
    try:
        from modelopt.onnx.quantization import quantize as modelopt_quantize
    except ImportError as exc:
        return f"modelopt.onnx cannot be imported ({exc.msg.splitlines()[0]})"
    try:
        # defaults, except: calibrate on the CPU (no GPU here) and keep the float part FP32 (its
        # default FP16 has no fast path in ONNX Runtime on x86)
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            modelopt_quantize(encoder, quantize_mode="int8", calibration_data=feeds,
                              calibration_eps=["cpu"], output_path=out, high_precision_dtype="fp32",
                              log_level="ERROR")
    except Exception as exc:  # modelopt raises many types; the anchor is reported as not run
        return f"ModelOpt failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    return None
