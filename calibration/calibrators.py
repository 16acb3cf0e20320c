"""ONNX Runtime's own calibrators, fed from a saved calibration set.

Nothing here computes a histogram or a range: ``onnxruntime.quantization.calibrate`` does
(``MinMaxCalibrater`` with or without a moving average, ``EntropyCalibrater``,
``PercentileCalibrater``). This module only names the methods the pipeline offers, reads the
``calib_set`` written by stage calibrate as a :class:`CalibrationDataReader`, and runs one
calibrator over it. ``quantize_static`` accepts the same reader directly.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from onnxruntime.quantization.calibrate import (CalibrationDataReader, CalibrationMethod, TensorsData,
                                                create_calibrator)

from pipeline.errors import PipelineError

TENSOR_COLUMN = "pixel_values"  # the column of the calib_set holding the model's input tensors


@dataclass(frozen=True)
class Method:
    """One of ORT's calibration methods with the options that distinguish it."""

    ort_method: CalibrationMethod
    extra_options: Mapping[str, Any] = field(default_factory=dict)


METHODS: dict[str, Method] = {
    "minmax": Method(CalibrationMethod.MinMax),
    # exponential moving average of per-batch min/max: robust to one outlier batch
    "minmax_ema": Method(CalibrationMethod.MinMax, {"moving_average": True, "averaging_constant": 0.01}),
    # KL-divergence threshold over a 2048-bin histogram, 128 quantized bins (TensorRT's setting).
    # ORT's defaults (128 bins for both) leave one candidate threshold, the full range: min-max
    # under another name (what the first comparison measured)
    "entropy": Method(CalibrationMethod.Entropy, {"num_bins": 2048, "num_quantized_bins": 128}),
    "percentile": Method(CalibrationMethod.Percentile, {"percentile": 99.999}),
    "percentile_99.99": Method(CalibrationMethod.Percentile, {"percentile": 99.99}),
}


def method(name: str) -> Method:
    if name not in METHODS:
        raise PipelineError(f"unknown calibration method {name!r}; known: {', '.join(METHODS)}")
    return METHODS[name]


def load_calib_set(path: str | Path):
    """The ``datasets.Dataset`` saved by stage calibrate (``<artifact>/calib_set`` or the folder above)."""
    import datasets

    path = Path(path)
    if (path / "calib_set").is_dir():
        path = path / "calib_set"
    if not path.is_dir():
        raise PipelineError(f"no calibration set at {path}; run stage calibrate first")
    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as exc:
        raise PipelineError(f"not a saved calibration set: {path} ({str(exc).splitlines()[0]})") from None
    if TENSOR_COLUMN not in ds.column_names:
        raise PipelineError(f"{path} has no {TENSOR_COLUMN!r} column (columns: {', '.join(ds.column_names)})")
    return ds


def calib_images(calib_set, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows ``start:stop`` of a calibration set as one float32 array ``[n, C, H, W]``."""
    rows = calib_set.with_format("numpy", columns=[TENSOR_COLUMN])[start:stop][TENSOR_COLUMN]
    return np.asarray(rows, dtype=np.float32)


class CalibSetReader(CalibrationDataReader):
    """Feeds a calib_set to an ORT session in batches: ``{input_name: float32 [B, C, H, W]}``.

    ``extra_feeds`` (optional) adds the other inputs a graph needs for a batch (a decoder's tokens,
    say); it gets the batch array and returns name -> array.
    """

    def __init__(self, calib_set, input_name: str, batch_size: int = 1, limit: int | None = None,
                 extra_feeds: Callable[[np.ndarray], dict[str, np.ndarray]] | None = None):
        if isinstance(calib_set, (str, Path)):
            calib_set = load_calib_set(calib_set)
        if batch_size < 1:
            raise PipelineError(f"calibration batch size must be positive, got {batch_size}")
        self.data = calib_set.with_format("numpy", columns=[TENSOR_COLUMN])
        self.input_name = input_name
        self.batch_size = int(batch_size)
        self.extra_feeds = extra_feeds
        self.start, self.end = 0, len(self.data) if limit is None else min(int(limit), len(self.data))
        self.position = self.start

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.position >= self.end:
            return None
        stop = min(self.position + self.batch_size, self.end)
        batch = np.ascontiguousarray(self.data[self.position:stop][TENSOR_COLUMN], dtype=np.float32)
        self.position = stop
        feeds = {self.input_name: batch}
        if self.extra_feeds is not None:
            feeds.update(self.extra_feeds(batch))
        return feeds

    def __len__(self) -> int:
        return -(-(self.end - self.start) // self.batch_size)

    def set_range(self, start_index: int, end_index: int) -> None:
        self.start, self.end = max(0, start_index), min(end_index, len(self.data))
        self.position = self.start

    def rewind(self) -> None:
        self.position = self.start


def model_input_name(onnx_path: str | Path) -> str:
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    initializers = {i.name for i in graph.initializer}
    names = [i.name for i in graph.input if i.name not in initializers]
    if not names:
        raise PipelineError(f"{onnx_path} has no graph input")
    return names[0]


def compute_ranges(onnx_path: str | Path, reader: CalibrationDataReader, method_name: str = "minmax",
                   op_types: Sequence[str] | None = None, providers: Sequence[str] | None = None,
                   extra_options: Mapping[str, Any] | None = None) -> TensorsData:
    """Run ORT's calibrator ``method_name`` over ``reader``; returns ORT's ``TensorsData``."""
    chosen = method(method_name)
    options = {**chosen.extra_options, **(extra_options or {})}
    with tempfile.TemporaryDirectory(prefix="calibrate-") as tmp:
        calibrator = create_calibrator(Path(onnx_path), list(op_types) if op_types else None,
                                       augmented_model_path=str(Path(tmp) / "augmented.onnx"),
                                       calibrate_method=chosen.ort_method,
                                       providers=list(providers) if providers else ["CPUExecutionProvider"],
                                       extra_options=options)
        try:
            calibrator.collect_data(reader)
            return calibrator.compute_data()
        finally:
            calibrator.clear_collected_data()
            del calibrator  # closes the session before the augmented model's folder is removed


def ranges_as_dict(ranges: TensorsData) -> dict[str, list[float]]:
    """tensor name -> [low, high] as plain floats (for a manifest or a report)."""
    out = {}
    for name, data in ranges.items():
        lo, hi = data.range_value
        out[name] = [float(np.asarray(lo).min()), float(np.asarray(hi).max())]
    return out
