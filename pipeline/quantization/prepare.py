"""The model a quantize plan is made for, before its graphs: SmoothQuant folded in
(:mod:`pipeline.quantization.smooth`) or a quantization-aware finetune (:mod:`pipeline.quantization.qat`),
each on a copy, with the fingerprint of the calibration rows it saw (the graphs' cache key)."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from calibration.calibrators import calib_images
from pipeline.quantization import readings
from pipeline.context import StageContext
from pipeline.errors import optional_part
from pipeline.quantization.graphs import FloatGraphs, float_graphs

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """The model the plan is made for and its float graphs; ``reference``: the float model's graphs
    every loss is measured against (``graphs`` themselves unless QAT finetuned the weights)."""

    adapter: object
    graphs: FloatGraphs
    reference: FloatGraphs
    smoothing: dict   # SmoothQuant's channel ranges before / after (empty: off)
    qat: dict         # the finetune's report (empty: off)


def prepared_graphs(adapter, model_key: str, calib_set, ctx: StageContext, scratch: Path, *, alpha: Optional[float],
                    qat_cfg: Optional[dict], calib_rows: int, workers: int, qat_minutes: float) -> Prepared:
    """The float graphs of ``adapter`` (in ``scratch``), with SmoothQuant ``alpha`` folded in and / or
    the QAT finetune ``qat_cfg`` applied first; the cache key names what was done and on which rows."""
    max_length, threads = ctx.limits.max_length, ctx.limits.threads
    graph_key = model_key
    smoothing: dict = {}
    if alpha is not None:  # the chain's model stays as it is: only the graphs made here are smoothed
        adapter, smoothing, rows_hash = smoothed(adapter, calib_set, calib_rows, alpha)
        graph_key += f":smoothquant={alpha}:{rows_hash}"
    qat_report: dict = {}
    reference = None  # the float model's graphs when the quantized ones are made from finetuned weights
    if qat_cfg:
        (scratch / "reference").mkdir()
        reference = float_graphs(adapter, scratch / "reference", max_length, graph_key, threads=threads)
        with optional_part("quantize's quantization-aware finetune", "quantize.qat_steps=0"):
            adapter, qat_report, rows_hash = qat_finetuned(adapter, calib_set, qat_cfg, ctx, reference, graph_key,
                                                           calib_rows=calib_rows, workers=workers, minutes=qat_minutes)
        graph_key += f":qat={json.dumps(qat_cfg, sort_keys=True)}:{rows_hash}"
    graphs = float_graphs(adapter, scratch, max_length, graph_key, threads=threads)
    return Prepared(adapter, graphs, reference or graphs, smoothing, qat_report)


def smoothed(adapter, calib_set, rows: int, alpha: float):
    """A copy of ``adapter`` with SmoothQuant folded in from the activation maxima of the first ``rows``
    calibration images, each pair's channel range before / after, and a fingerprint of those images
    (the smoothed graphs' cache key)."""
    import hashlib

    import torch

    from pipeline.quantization import smooth

    images = calib_images(calib_set, 0, rows)
    smoothed, report = smooth.smoothed_copy(adapter, torch.from_numpy(images), alpha)
    return smoothed, report, hashlib.sha256(images.tobytes()).hexdigest()[:16]


def qat_finetuned(adapter, calib_set, qat_cfg: dict, ctx: StageContext, reference: FloatGraphs, model_key: str,
                  *, calib_rows: int, workers: int, minutes: float):
    """A copy of ``adapter`` whose encoder learnt to tolerate INT8 (:mod:`pipeline.quantization.qat`),
    its report, and a fingerprint of the rows it saw (the graphs' cache key). The fake quantizers'
    ranges: the 99.99th percentile (the stage's default method) over the first ``calib_rows`` rows;
    the training images: the first ``images`` rows; the targets the student is teacher-forced on:
    the float model's greedy readings of them by ``reference``'s float ONNX Runtime package: 60 s
    for 512 images of the original model against torch's KV-cached 336 s; in this setting the
    finetuned graphs came out byte-identical to those from torch's targets (docs/quantize.md)."""
    import hashlib

    import torch

    from pipeline.quantization import qat

    limits = ctx.limits
    if int(qat_cfg["images"]) > len(calib_set):
        log.warning(f"[quantize] qat_images={qat_cfg['images']}: the calibration set holds {len(calib_set)} rows; "
                    f"the finetune trains on those {len(calib_set)}")
    images = calib_images(calib_set, 0, min(int(qat_cfg["images"]), len(calib_set)))
    ids, how = readings.greedy_readings(ctx, adapter, model_key, images, "onnxruntime", workers,
                                        "QAT's targets (the float package's readings)",
                                        packages=reference.open_readers(limits.threads, workers))
    read_s = how["seconds"]
    ranges = torch.from_numpy(images[:calib_rows])
    finetuned, report = qat.finetuned_copy(
        adapter, ranges, torch.from_numpy(images), steps=int(qat_cfg["steps"]), lr=float(qat_cfg["lr"]),
        minutes=minutes, seed=ctx.seed, max_length=limits.max_length, read_batch=limits.batch_size,
        progress=ctx.progress, targets=readings.with_bos(adapter, ids), precision=qat_cfg.get("precision", "fp32"),
        device=ctx.device)
    report.update(teacher_readings="float ONNX Runtime package" + (" (cached)" if how["cached"] else ""),
                  teacher_readings_seconds=round(read_s, 1),
                  seconds=round(report["seconds"] + read_s, 1))
    return finetuned, report, hashlib.sha256(images.tobytes()).hexdigest()[:16]
