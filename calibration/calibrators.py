"""ONNX Runtime's own calibrators, fed from a saved calibration set.

Nothing here computes a histogram or a range: ``onnxruntime.quantization.calibrate`` does
(``MinMaxCalibrater`` with or without a moving average, ``EntropyCalibrater``,
``PercentileCalibrater``). This module only names the methods the pipeline offers, reads the
``calib_set`` written by stage calibrate as a :class:`CalibrationDataReader`, and runs one
calibrator over it. ``quantize_static`` accepts the same reader directly.

ORT's histogram calibrators (``entropy``, ``percentile``) keep every watched tensor of every image
in memory before they histogram it; a plain ViT graph's attention maps (heads x 1024 x 1024 floats
per image and layer) made that 11.5 GB for the pruned encoder and 18 GB for the original on 32
images. :func:`compute_ranges` therefore runs them in passes over the whole set, each pass watching
a group of tensors that fits :data:`HISTOGRAM_PASS_BYTES`: every tensor still sees every image in
one histogram, so the ranges are the one-pass ranges (tested), for a few more inference passes.
"""
from __future__ import annotations

import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx
from onnxruntime.quantization.calibrate import (CalibrationDataReader, CalibrationMethod, HistogramCalibrater,
                                                HistogramCollector, TensorsData, create_calibrator)

from pipeline.errors import PipelineError

TENSOR_COLUMN = "pixel_values"  # the column of the calib_set holding the model's input tensors
HISTOGRAM_METHODS = (CalibrationMethod.Entropy, CalibrationMethod.Percentile)
# what one pass of a histogram calibrator may hold: its tensors x the reader's images (float32)
HISTOGRAM_PASS_BYTES = 1 << 30


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


def token_feeds(policy) -> Callable[[np.ndarray], dict[str, np.ndarray]] | None:
    """A reader's ``extra_feeds`` for an encoder that reads only the patch tokens a token policy keeps
    (its ``keep`` input, computed from each batch as the package's runtime does); None without a policy."""
    if policy is None:
        return None
    return lambda batch: {"keep": policy.keep_batch(batch)}


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

    @property
    def images(self) -> int:
        return self.end - self.start

    def set_range(self, start_index: int, end_index: int) -> None:
        self.start, self.end = max(0, start_index), min(end_index, len(self.data))
        self.position = self.start

    def rewind(self) -> None:
        self.position = self.start


def model_input_name(onnx_path: str | Path) -> str:
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    initializers = {i.name for i in graph.initializer}
    names = [i.name for i in graph.input if i.name not in initializers]
    if not names:
        raise PipelineError(f"{onnx_path} has no graph input")
    return names[0]


def compute_ranges(onnx_path: str | Path, reader: CalibrationDataReader, method_name: str = "minmax",
                   op_types: Sequence[str] | None = None, providers: Sequence[str] | None = None,
                   extra_options: Mapping[str, Any] | None = None,
                   pass_bytes: int = HISTOGRAM_PASS_BYTES) -> TensorsData:
    """Run ORT's calibrator ``method_name`` over ``reader``; returns ORT's ``TensorsData``.

    A histogram method on a reader that can rewind (``CalibSetReader``) runs in passes of at most
    ``pass_bytes`` of watched tensors over all of the reader's images (module docstring)."""
    chosen = method(method_name)
    options = {**chosen.extra_options, **(extra_options or {})}
    with tempfile.TemporaryDirectory(prefix="calibrate-") as tmp:
        def calibrator_for(k: int):
            return create_calibrator(Path(onnx_path), list(op_types) if op_types else None,
                                     augmented_model_path=str(Path(tmp) / f"augmented{k}.onnx"),
                                     calibrate_method=chosen.ort_method,
                                     providers=list(providers) if providers else ["CPUExecutionProvider"],
                                     extra_options=options)

        calibrator = calibrator_for(0)
        passes = [None]
        if chosen.ort_method in HISTOGRAM_METHODS and hasattr(reader, "rewind") and hasattr(reader, "images"):
            passes = _histogram_passes(calibrator.get_augment_model(), calibrator.tensors_to_calibrate,
                                       max(1, pass_bytes // max(1, reader.images)))
        if len(passes) == 1:
            return _collect(calibrator, reader)
        data: dict[str, Any] = {}
        for k, names in enumerate(passes):
            calibrator = calibrator if k == 0 else calibrator_for(k)  # a fresh histogram collector a pass
            _watch_only(calibrator, names)
            reader.rewind()
            found = _collect(calibrator, reader)
            data.update({name: found[name] for name in names})
        return TensorsData(chosen.ort_method, data)


class _RaggedHistogram(HistogramCollector):
    """ORT's histogram collector, for batches whose tensors differ in shape (an encoder reading only the
    tokens a policy keeps: a batch of 320 tokens, the next of 384). ORT stacks a tensor's batches before it
    flattens them, which only equal shapes allow; this flattens each batch and joins them, the same values
    in the same order, so where the shapes are equal the histograms are ORT's own."""

    def collect(self, name_to_arr):
        return super().collect({name: np.concatenate([np.asarray(a).reshape(-1) for a in arrs])
                                if isinstance(arrs, list) else arrs for name, arrs in name_to_arr.items()})


def _collect(calibrator, reader: CalibrationDataReader) -> TensorsData:
    if isinstance(calibrator, HistogramCalibrater) and calibrator.collector is None:
        calibrator.collector = _RaggedHistogram(calibrator.method, calibrator.symmetric, calibrator.num_bins,
                                                calibrator.num_quantized_bins, calibrator.percentile,
                                                calibrator.scenario)
    try:
        calibrator.collect_data(reader)
        return calibrator.compute_data()
    finally:
        calibrator.clear_collected_data()
        calibrator.infer_session = None  # closes the session before the augmented model's folder goes


def _histogram_passes(model, tensors: Iterable[str], budget: int) -> list[list[str]]:
    """The watched tensors in groups of at most ``budget`` bytes per image (a bigger tensor alone),
    in name order; a tensor whose size the shapes do not say gets a pass of its own."""
    infos = {v.name: v for v in (*model.graph.value_info, *model.graph.output, *model.graph.input)}
    passes: list[list[str]] = [[]]
    used = 0
    for name in sorted(tensors):
        dims = infos[name].type.tensor_type.shape.dim if name in infos else None
        size = 4 * int(np.prod([d.dim_value if d.dim_value > 0 else 1 for d in dims])) \
            if dims is not None and all(d.dim_value > 0 or d.dim_param for d in dims) else budget
        if passes[-1] and used + size > budget:
            passes.append([])
            used = 0
        passes[-1].append(name)
        used += size
    return passes


def _watch_only(calibrator, names: list[str]) -> None:
    """Make the augmented graph output only ``names`` (and the model's own outputs)."""
    model = calibrator.get_augment_model()
    keep = set(names) | set(calibrator.model_original_outputs)
    outputs = [o for o in model.graph.output if o.name in keep]
    del model.graph.output[:]
    model.graph.output.extend(outputs)
    onnx.save(model, calibrator.augmented_model_path)
    calibrator.create_inference_session()


def ranges_as_dict(ranges: TensorsData) -> dict[str, list[float]]:
    """tensor name -> [low, high] as plain floats (for a manifest or a report)."""
    out = {}
    for name, data in ranges.items():
        lo, hi = data.range_value
        out[name] = [float(np.asarray(lo).min()), float(np.asarray(hi).max())]
    return out
