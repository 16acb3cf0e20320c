"""Stage calibrate: a stratified, de-duplicated calibration set of model-ready tensors.

Sources (``data=...``): the corpus calibration split (default; never the eval split), an image
folder, or a dataset saved with ``save_to_disk``. Every image goes through the model adapter's own
``preprocess``; candidates are bucketed (see ``calibration/sets.py``), exact and near duplicates
are removed, and ``calibrate.size`` images are drawn per bucket with the root ``seed``. Output:
``calib_set/`` (``datasets.load_from_disk``), ``contact_sheet.png``, ``buckets.png``,
``report.md`` and the manifest with per-bucket counts and coverage.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from calibration import report, sets, store
from calibration.store import TENSOR_COLUMN
from pipeline.context import StageContext, file_hash
from pipeline.errors import PipelineError

log = logging.getLogger(__name__)

NAME = "calibrate"
CONFIG_KEY = "calibrate"
SET_DIR = "calib_set"


@dataclass
class CalibrateConfig:
    size: int = 512                  # N images in the set (32-4096)
    model: str = "original"          # whose preprocessing makes the tensors (original | stage | folder)
    near_duplicate: float = 0.02     # 16x64 ink thumbnails closer than this (mean |diff|, 0-1) are near duplicates; 0 = exact only
    max_share_distance: float = 0.1  # stated limit on the total-variation distance of bucket shares (set vs source)
    workers: int = 0                 # render processes; 0 = the idle cores (cores - 1-min load, at least 1)
    contact_sheet: int = 48          # images shown in contact_sheet.png
    name: str = "calibrate"          # artifact folder


Config = CalibrateConfig


def open_source(ctx: StageContext, workers: int) -> tuple[sets.Source, dict[str, str]]:
    """The configured source and the hashes of its inputs (for reuse)."""
    data = ctx.cfg.data
    sets.check_source(data)
    if data.kind == "corpus":
        formulas = ctx.split("calib")
        return sets.CorpusSource(formulas, workers), {"corpus": ctx.split_hash("calib")}
    path = Path(str(data.path))
    if data.kind == "image_folder":
        source = sets.ImageFolderSource(path, data.labels)
        inputs = {"images": file_hash(path)}
        if data.labels:
            inputs["labels"] = file_hash(Path(str(data.labels)))
        return source, inputs
    return sets.HFDiskSource(path, str(data.image_column), data.text_column), {"dataset": file_hash(path)}


def validate(cfg: CalibrateConfig) -> None:
    """The stage's keys, before any stage runs (also under stage=all)."""
    if not sets.MIN_SIZE <= cfg.size <= sets.MAX_SIZE:
        raise PipelineError(f"calibrate.size must be {sets.MIN_SIZE}-{sets.MAX_SIZE}, got {cfg.size}")
    if not 0 <= cfg.near_duplicate < 1:
        raise PipelineError(f"calibrate.near_duplicate must be in [0, 1), got {cfg.near_duplicate}")
    if not 0 <= cfg.max_share_distance <= 1:
        raise PipelineError(f"calibrate.max_share_distance must be in [0, 1] (a total-variation distance), "
                            f"got {cfg.max_share_distance}")
    if cfg.contact_sheet < 0:
        raise PipelineError(f"calibrate.contact_sheet must be >= 0, got {cfg.contact_sheet}")
    if cfg.workers < 0:
        raise PipelineError(f"calibrate.workers must be >= 0, got {cfg.workers}")


def run(cfg: CalibrateConfig, ctx: StageContext) -> dict:
    validate(cfg)
    source, inputs = open_source(ctx, cfg.workers)
    inputs["model"] = ctx.model_hash(cfg.model)
    data = ctx.cfg.data
    config = {**asdict(cfg), "seed": ctx.seed, "workers": None,  # workers never change the result
              "data": {k: (None if data[k] is None else str(data[k]))
                       for k in ("kind", "path", "labels", "image_column", "text_column")}}
    with ctx.output(cfg.name, config, inputs) as out:
        if out.reused:
            log.info(f"[calibrate] unchanged, reused {out.path}")
            _print_summary(out.metrics)
            return out.manifest
        adapter = ctx.load_model(cfg.model)
        started = time.perf_counter()
        scan = source.scan(adapter.preprocess, ctx.progress)
        scanned = time.perf_counter()
        if not scan.candidates:
            raise PipelineError(f"no usable image in {scan.description} ({len(scan.skipped)} skipped: "
                                f"{_names(scan.skipped)})")
        chosen = sets.choose(scan, cfg.near_duplicate, cfg.size, ctx.seed)
        selected = time.perf_counter()
        tensors = store.write_set(out.path / SET_DIR, chosen, source, adapter, ctx.progress)
        timings = {"read_render_measure": round(scanned - started, 2), "dedup_bucket_select": round(selected - scanned, 2),
                   "tensors_and_save": round(time.perf_counter() - selected, 2)}
        metrics = report.set_metrics(scan, chosen, ctx.seed, adapter.input_shape, TENSOR_COLUMN,
                                     cfg.max_share_distance, timings)
        out.metrics.update(metrics)
        report.contact_sheet(out.path / "contact_sheet.png", chosen, tensors, cfg.contact_sheet)
        report.bucket_plot(out.path / "buckets.png", metrics)
        report.write_report(out.path / "report.md", metrics)
    _print_summary(metrics)
    return out.manifest


def _names(items: dict[str, str], k: int = 5) -> str:
    shown = ", ".join(f"{n} ({why})" for n, why in list(items.items())[:k])
    return shown + (f" and {len(items) - k} more" if len(items) > k else "")


def _print_summary(m: dict) -> None:
    skipped = m.get("skipped_items") or {}
    log.info(f"[calibrate] {m['size']} images from {m['source']}: coverage {m['covered_buckets']}/"
             f"{m['nonempty_source_buckets']} buckets ({m['coverage']:.1%}), share TV distance "
             f"{m['share_tv_distance']:.3f}; {m['skipped']} skipped, {m['duplicates']} duplicates removed")
    if skipped:
        log.warning(f"[calibrate] skipped: {_names(skipped, 10)}")
    if not m.get("within_share_distance", True):
        log.warning(f"[calibrate] bucket share distance {m['share_tv_distance']:.3f} exceeds the stated "
                    f"{m['max_share_distance']}")

