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

import numpy as np
from PIL import Image, ImageDraw, ImageFont
from tqdm import tqdm

from calibration import sets
from pipeline.context import StageContext, file_hash
from pipeline.errors import PipelineError
from pipeline.reports import markdown_table, savefig

log = logging.getLogger(__name__)

NAME = "calibrate"
CONFIG_KEY = "calibrate"
SET_DIR = "calib_set"
TENSOR_COLUMN = "pixel_values"
CHUNK = 128  # rows converted to Arrow at a time (bounds peak memory for large sets)


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
        return sets.CorpusSource(formulas, workers), {
            "corpus": ctx.upstream("corpus")["outputs"]["formulas.jsonl"]}
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
        sets.remove_duplicates(scan, cfg.near_duplicate)
        sets.assign_buckets(scan)
        chosen = sets.select(scan, cfg.size, ctx.seed)
        selected = time.perf_counter()
        tensors = _write_set(out.path / SET_DIR, chosen, source, adapter, ctx.progress)
        written = time.perf_counter()
        metrics = sets.coverage_report(scan, chosen)
        metrics.update({
            "source": scan.description, "source_items": scan.total, "usable": len(scan.candidates),
            "skipped": len(scan.skipped), "skipped_items": scan.skipped,
            "duplicates": len(scan.duplicates), "duplicate_items": scan.duplicates,
            "size": len(chosen), "seed": ctx.seed, "input_shape": list(adapter.input_shape),
            "tensor_column": TENSOR_COLUMN, "max_share_distance": cfg.max_share_distance,
            "share_tv_bound": round(sets.tv_bound(metrics["nonempty_source_buckets"], len(chosen)), 6),
        })
        metrics["within_share_distance"] = metrics["share_tv_distance"] <= cfg.max_share_distance
        # wall seconds per phase (not in report.md, which stays byte-identical between runs)
        metrics["timings_s"] = {"read_render_measure": round(scanned - started, 2),
                                "dedup_bucket_select": round(selected - scanned, 2),
                                "tensors_and_save": round(written - selected, 2)}
        out.metrics.update(metrics)
        _contact_sheet(out.path / "contact_sheet.png", chosen, tensors, cfg.contact_sheet)
        _bucket_plot(out.path / "buckets.png", metrics)
        _write_report(out.path / "report.md", metrics)
    _print_summary(metrics)
    return out.manifest


def _names(items: dict[str, str], k: int = 5) -> str:
    shown = ", ".join(f"{n} ({why})" for n, why in list(items.items())[:k])
    return shown + (f" and {len(items) - k} more" if len(items) > k else "")


def _write_set(folder: Path, chosen: list[sets.Candidate], source: sets.Source, adapter,
               progress: bool) -> list[np.ndarray]:
    """Preprocess the chosen images again with the adapter and save them as a ``datasets`` Dataset;
    returns a few of the tensors (for the contact sheet)."""
    import datasets

    shape = tuple(int(s) for s in adapter.input_shape)
    features = datasets.Features({
        TENSOR_COLUMN: datasets.Array3D(shape=shape, dtype="float32"),
        "source_id": datasets.Value("string"),
        "bucket": datasets.Value("string"),
        "text": datasets.Value("string"),
        "length": datasets.Value("int32"),
        "structure": datasets.Value("string"),
        "ink_width": datasets.Value("int32"),
        "ink_height": datasets.Value("int32"),
        "ink_density": datasets.Value("float32"),
    })
    parts, shown = [], []
    bar = tqdm(total=len(chosen), desc="tensors", unit="img", disable=not progress)
    for batch in sets.iter_batches(chosen, CHUNK):
        arrays = []
        for c in batch:
            arr = adapter.preprocess(source.image(c.source_id)).numpy().astype(np.float32, copy=False)
            if tuple(arr.shape) != shape:
                raise PipelineError(f"preprocess gave shape {tuple(arr.shape)} for {c.source_id}, expected {shape}")
            arrays.append(arr)
            bar.update()
        shown.extend(arrays[:max(0, 64 - len(shown))])
        parts.append(datasets.Dataset.from_dict({
            TENSOR_COLUMN: np.stack(arrays),
            "source_id": [c.source_id for c in batch],
            "bucket": [c.bucket for c in batch],
            "text": [c.text for c in batch],
            "length": [c.length for c in batch],
            "structure": [c.structure for c in batch],
            "ink_width": [c.ink_width for c in batch],
            "ink_height": [c.ink_height for c in batch],
            "ink_density": [c.ink_density for c in batch],
        }, features=features))
    bar.close()
    ds = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    bars_were_on = datasets.is_progress_bar_enabled()
    if not progress:
        datasets.disable_progress_bars()
    try:
        ds.save_to_disk(str(folder))
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()
    return shown


def _contact_sheet(path: Path, chosen: list[sets.Candidate], tensors: list[np.ndarray], count: int) -> None:
    """The first ``count`` images of the set (a seeded random sample), half scale, captioned."""
    k = min(count, len(tensors))
    if k == 0:
        return
    _, h, w = tensors[0].shape
    tw, th, caption, cols = w // 2, h // 2, 14, 3
    rows = -(-k // cols)
    sheet = Image.new("L", (cols * (tw + 4) + 4, rows * (th + caption + 4) + 4), 200)
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default()
    for i in range(k):
        canvas = Image.fromarray(np.round(tensors[i][0] * 255).astype(np.uint8)).resize((tw, th), Image.BOX)
        x, y = 4 + (i % cols) * (tw + 4), 4 + (i // cols) * (th + caption + 4)
        sheet.paste(canvas, (x, y))
        draw.text((x, y + th + 1), f"{chosen[i].source_id[:14]}  {chosen[i].bucket}"[:48], fill=0, font=font)
    sheet.save(path, format="PNG")


def _bucket_plot(path: Path, m: dict) -> None:
    import matplotlib.pyplot as plt

    buckets = m["buckets"]
    n_src = sum(b["source"] for b in buckets.values())
    n_set = max(1, sum(b["set"] for b in buckets.values()))
    order = sorted(buckets, key=lambda k: (-buckets[k]["source"], k))
    axes = list(m["marginals"])
    fig, (top, *bottom) = plt.subplots(1 + len(axes), 1, figsize=(10, 3 + 2.2 * len(axes)),
                                       gridspec_kw={"height_ratios": [1.4] + [1] * len(axes)})
    x = np.arange(len(order))
    top.bar(x - 0.2, [buckets[k]["source"] / n_src for k in order], 0.4, label=f"source (n={n_src})", color="#bbbbbb")
    top.bar(x + 0.2, [buckets[k]["set"] / n_set for k in order], 0.4, label=f"set (n={n_set})", color="#4477aa")
    top.set_title(f"Joint buckets, by source share: coverage {m['covered_buckets']}/{m['nonempty_source_buckets']}"
                  f" = {m['coverage']:.1%}, TV distance {m['share_tv_distance']:.3f}")
    top.set_xlabel("bucket (rank by source count)")
    top.set_ylabel("share")
    top.legend(fontsize=8)
    for ax, axis in zip(bottom, axes):
        marg = m["marginals"][axis]
        labels = sorted(marg["source"], key=_bin_order)
        xi = np.arange(len(labels))
        ax.bar(xi - 0.2, [marg["source"][k] / n_src for k in labels], 0.4, color="#bbbbbb")
        ax.bar(xi + 0.2, [marg["set"].get(k, 0) / n_set for k in labels], 0.4, color="#4477aa")
        ax.set_xticks(xi, labels, fontsize=8)
        ax.set_ylabel("share")
        ax.set_title(f"{axis} (TV {marg['tv_distance']:.3f})", fontsize=9)
    savefig(fig, path)


def _bin_order(label: str) -> tuple:
    """Sort 'W64-127' after 'W0-63' (numerically), named bins alphabetically after."""
    digits = "".join(ch if ch.isdigit() or ch == "." else " " for ch in label).split()
    return (0, float(digits[0]), label) if digits else (1, 0.0, label)


def _write_report(path: Path, m: dict) -> None:
    summary = markdown_table(["", "value"], [
        ["source", m["source"]], ["items offered", m["source_items"]], ["skipped", m["skipped"]],
        ["duplicates removed", m["duplicates"]], ["usable (unique)", m["usable"]],
        ["set size", m["size"]], ["seed", m["seed"]], ["bucket scheme", m["scheme"]],
        ["non-empty source buckets", m["nonempty_source_buckets"]],
        ["covered by the set", f"{m['covered_buckets']} ({m['coverage']:.1%})"],
        ["bucket share distance (total variation)",
         f"{m['share_tv_distance']:.3f} (stated limit {m['max_share_distance']}, guaranteed <= {m['share_tv_bound']:.3f})"],
        ["largest share difference of one bucket", f"{m['share_max_abs_diff']:.4f}"],
    ])
    marg = markdown_table(["axis", "bins", "TV distance"],
                          [[a, len(v["source"]), f"{v['tv_distance']:.3f}"] for a, v in m["marginals"].items()])
    skipped = "\n".join(f"- `{n}`: {why}" for n, why in list(m["skipped_items"].items())[:50]) or "none"
    path.write_text(
        "# Calibration set\n\n" + summary + "\n\n## Per-axis shares\n\n" + marg +
        "\n\n![bucket shares](buckets.png)\n\n## Sample\n\n![contact sheet](contact_sheet.png)\n\n"
        "## Skipped\n\n" + skipped + "\n")


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

