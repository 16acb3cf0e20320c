"""QDQ graphs from ONNX Runtime's own quantizer, with ranges calibrated once per method.

Calibration runs ORT's calibrator (``calibration.calibrators.compute_ranges``) once per method and
stores the ranges with ORT's ``save_tensors_data``; every QDQ variant after that (one per
sensitivity probe, one per plan step) is ``quantize_static`` reading that cache, so trying a plan
costs a graph rewrite, not a calibration pass.

The scheme is the one TensorRT and MacaRT consume: symmetric INT8 (zero point 0) for weights and
activations, weights per output channel, activations per tensor, explicit QuantizeLinear /
DequantizeLinear pairs. ONNX Runtime's CPU provider runs asymmetric UINT8 activations (U8S8, the
form of the VNNI dot product) at the same speed: ``activations="uint8"`` gives the ort_cpu graph a
zero point that fits one-sided ranges such as GELU outputs (docs/quantize.md, measured).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Sequence

import onnx

from calibration.calibrators import compute_ranges, method as calibration_method
from pipeline.errors import PipelineError

log = logging.getLogger(__name__)
OP_TYPES = ("MatMul", "Gemm")
# activation scheme -> (ORT QuantType name, symmetric); weights are symmetric INT8 per channel in both
ACTIVATIONS = {"int8": ("QInt8", True), "uint8": ("QUInt8", False)}


def calibrate(float_model: Path, reader, method_name: str, cache: Path,
              extra_options: dict | None = None) -> float:
    """Ranges of every MatMul/Gemm tensor of ``float_model`` over ``reader``, saved to ``cache``;
    returns the seconds it took."""
    from onnxruntime.quantization.calibrate import save_tensors_data

    started = time.perf_counter()
    with quiet():
        ranges = compute_ranges(float_model, reader, method_name, op_types=OP_TYPES, extra_options=extra_options)
    save_tensors_data(ranges, cache)
    return time.perf_counter() - started


def quantize(float_model: Path, out: Path, cache: Path, method_name: str, int8_nodes: Sequence[str],
             activations: str = "int8") -> bool:
    """Write the QDQ graph of ``float_model`` with ``int8_nodes`` in INT8 to ``out``; the rest stays
    float. ``activations``: ``int8`` (symmetric, zero point 0: TensorRT, MacaRT) or ``uint8``
    (asymmetric, for ONNX Runtime CPU). Returns False (and copies the float graph) when no node is INT8."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    if activations not in ACTIVATIONS:
        raise PipelineError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    act_type, act_symmetric = ACTIVATIONS[activations]
    if not int8_nodes:  # ORT reads an empty node list as "every node"
        onnx.save(onnx.load(str(float_model)), str(out))
        return False
    with quiet():
        quantize_static(
            str(float_model), str(out), None, quant_format=QuantFormat.QDQ,
            op_types_to_quantize=list(OP_TYPES), nodes_to_quantize=list(int8_nodes),
            per_channel=True, activation_type=getattr(QuantType, act_type), weight_type=QuantType.QInt8,
            calibrate_method=calibration_method(method_name).ort_method, calibration_cache_path=str(cache),
            extra_options={"ActivationSymmetric": act_symmetric, "WeightSymmetric": True,
                           # a projection's output feeds a residual Add or GELU in float: quantizing it
                           # (ORT's default for Gemm) costs 20 dB of SNR and no speed
                           "OpTypesToExcludeOutputQuantization": list(OP_TYPES)},
        )
    if not out.is_file():
        raise PipelineError(f"onnxruntime's quantize_static wrote no graph for {float_model.name}")
    return True


def dynamic(float_model: Path, out: Path, per_channel: bool = False) -> None:
    """ORT ``quantize_dynamic``: INT8 weights, activations quantized at run time. The anchor (its
    defaults), and the ort_cpu decoder: one token a step leaves nothing to calibrate a static scale
    on that a step's own range does not give, and its weights (16 MB in FP32, read every step)
    are what INT8 saves."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with quiet():
        quantize_dynamic(str(float_model), str(out), weight_type=QuantType.QInt8, op_types_to_quantize=list(OP_TYPES),
                         per_channel=per_channel)


def static_defaults(float_model: Path, out: Path, reader) -> None:
    """The ``quantize_static`` anchor with ORT's defaults (QDQ, U8 activations, MinMax, per tensor)."""
    from onnxruntime.quantization import quantize_static

    with quiet():
        quantize_static(str(float_model), str(out), reader)


class _ErrorsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


@contextlib.contextmanager
def quiet():
    """ORT's quantizer logs advice at WARNING straight on the root logger (``logging.warning``) and
    its calibrators print progress to stdout, once per call; a stage makes dozens of calls, so keep
    only errors. A filter on the root *logger* sees only records logged on it directly, so every
    module logger of the process (ours included) keeps its level and its records; ORT's own named
    loggers (``onnxruntime.quantization.*``, INFO per node) are raised to ERROR for the call."""
    root = logging.getLogger()
    only_errors = _ErrorsOnly()
    root.addFilter(only_errors)
    named = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.startswith("onnxruntime")]
    levels = [lg.level for lg in named]
    for lg in named:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            warnings.simplefilter("ignore")
            yield
    finally:
        root.removeFilter(only_errors)
        for lg, level in zip(named, levels):
            lg.setLevel(level)
