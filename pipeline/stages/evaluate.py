"""Stage evaluate: exact match, image exact match, CER, BLEU-4 and latency of a model on formulas.

Sources: the corpus eval split and the shift split side by side (default: ``eval.splits``; the
shift split holds formulas from packages the corpus never read, see ``data.shift_packages``), one
split (``eval.split=shift``), ``eval.formulas=FILE`` (one LaTeX formula per line,
rendered by the project's renderer), or ``eval.images=DIR`` with a labels file
(``<file name>\\t<latex>`` per line; ``DIR/labels.tsv`` when ``eval.labels`` is unset).
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

import numpy as np

from pipeline import files
from pipeline.device import placed
from pipeline.context import StageContext, file_hash
from pipeline.data.render import render_inputs
from pipeline.errors import ImageError, PipelineError
from pipeline.evaluation import EvalItem, evaluate_items, latency_batch1
from pipeline.reports import grouped_bar_plot, markdown_table

log = logging.getLogger(__name__)

NAME = "evaluate"
CONFIG_KEY = "eval"


@dataclass
class EvalConfig:
    model: str = "original"         # original | a stage with a model (prune, ...) | a model folder
    split: Optional[str] = None     # one split (train|calib|eval|shift) when no formulas/images are given ...
    splits: List[str] = field(default_factory=lambda: ["eval", "shift"])  # ... else these, side by side
    formulas: Optional[str] = None  # file: one LaTeX formula per line
    images: Optional[str] = None    # folder of formula images ...
    labels: Optional[str] = None    # ... and their labels: "<file name>\t<latex>" per line
    limit: Optional[int] = None     # take the first N (of each split)
    image_match: bool = True        # im2latex image exact match (renders every prediction)
    use_cache: bool = True          # KV-cached decoding for the accuracy pass (same tokens, ~5x faster)
    latency_samples: int = 4        # images timed again at batch 1, shipped decoder and KV-cached
    name: Optional[str] = None      # artifact folder; default evaluate[-<model>]
    # stage=all runs it only when true (conf/stage/all.yaml: off; the benchmark reads the original
    # model on both splits through its float package, token-identical to torch)
    in_chain: bool = True


Config = EvalConfig


def sources(cfg: EvalConfig) -> list[Optional[str]]:
    """What to evaluate: [None] for a formulas file or image folder, else the corpus splits."""
    if cfg.formulas or cfg.images:
        return [None]
    splits = [cfg.split] if cfg.split else list(cfg.splits)
    if not splits:
        raise PipelineError("eval.splits is empty: name at least one split (eval, shift ...)")
    if len(set(splits)) != len(splits):
        raise PipelineError(f"eval.splits names a split twice: {splits}")
    return splits


@dataclass
class Source:
    """One thing to evaluate, read but not yet rendered: its (id, latex) pairs (or labelled image
    files), the input hashes that decide reuse, and a description."""
    pairs: list[tuple[str, str]]
    inputs: dict[str, str]
    description: str
    folder: Optional[Path] = None   # eval.images: the pairs are (file name, latex) in this folder


def read_source(cfg: EvalConfig, ctx: StageContext, split: Optional[str] = None) -> Source:
    """What to evaluate from ``eval.images``, ``eval.formulas`` or a corpus split: files and hashes
    only, so reuse is decided before the model is loaded and anything is rendered."""
    if cfg.formulas and cfg.images:
        raise PipelineError("give eval.formulas or eval.images, not both")
    if cfg.limit is not None and cfg.limit <= 0:
        raise PipelineError(f"eval.limit must be positive, got {cfg.limit}")
    if cfg.images:
        folder = Path(cfg.images)
        if not folder.is_dir():
            raise PipelineError(f"eval.images: no such folder {folder}")
        labels_path = files.labels_file(folder, cfg.labels, "eval.labels", required=True)
        labels = files.read_labels(labels_path, "eval.labels")
        return Source(labels[:cfg.limit] if cfg.limit else labels,
                      {"images": file_hash(folder), "labels": file_hash(labels_path)}, f"images {folder}", folder)
    if cfg.formulas:
        path = Path(cfg.formulas)
        pairs = [(f"line{i}", ln) for i, ln in files.read_formulas(path, "eval.formulas")]
        source, inputs = f"file {path}", {"formulas": file_hash(path)}
    else:
        split = split or cfg.split or "eval"
        pairs = [(f.id, f.latex) for f in ctx.split(split)]
        source = "shift split (packages the corpus never read)" if split == "shift" else f"corpus split '{split}'"
        inputs = {f"split:{split}": ctx.split_hash(split)}
    if cfg.limit:
        pairs = pairs[:cfg.limit]
    if not pairs:
        raise PipelineError(f"nothing to evaluate in {source}")
    return Source(pairs, inputs, source)


def load_items(src: Source, adapter, progress: bool) -> list[EvalItem]:
    """The (image, truth) pairs of a source: images decoded, or formulas rendered, and preprocessed."""
    if src.folder is not None:
        return _image_items(src, adapter)
    items = [EvalItem(fid, latex, tensor) for fid, latex, tensor
             in render_inputs(src.pairs, adapter.preprocess, progress=progress, desc=f"evaluate {src.description}")]
    if not items:
        raise PipelineError(f"no formula in {src.description} could be rendered")
    return items


def _image_items(src: Source, adapter) -> list[EvalItem]:
    items, skipped = [], []
    for name, latex in src.pairs:
        try:
            items.append(EvalItem(name, latex, adapter.preprocess(files.open_image(src.folder / name))))
        except ImageError as exc:
            skipped.append(str(exc))
    if not items:
        raise ImageError(f"eval.images: no readable image among the {len(src.pairs)} labelled in {src.folder}: "
                         f"{'; '.join(skipped[:3])}")
    if skipped:
        log.warning(f"[evaluate] skipped {len(skipped)} unreadable image(s): {'; '.join(skipped[:5])}")
    return items


def run(cfg: EvalConfig, ctx: StageContext) -> dict:
    mcfg = ctx.cfg.model
    name = cfg.name or ("evaluate" if cfg.model in ("original", "package") else f"evaluate-{Path(cfg.model).name}")
    read: dict[str, Source] = {}  # split (or "input") -> what to evaluate
    inputs: dict[str, str] = {}
    for split in sources(cfg):
        src = read_source(cfg, ctx, split)
        read[split or "input"] = src
        inputs.update(src.inputs)
    inputs["model"] = ctx.model_hash(cfg.model)
    config = {**asdict(cfg), "max_length": int(mcfg.max_length), **ctx.decoding_key(),
              "batch_size": int(mcfg.batch_size)}
    config.pop("in_chain")  # whether stage=all runs it, not what it measures
    with ctx.output(name, config, inputs) as out:
        if out.reused:  # decided on hashes alone: no model loaded, nothing rendered
            log.info(f"[evaluate] unchanged, reused {out.path}")
            _print_summary(out.metrics)
            return out.manifest
        adapter = ctx.load_model(cfg.model)
        loaded = {key: (load_items(src, adapter, ctx.progress), src.description) for key, src in read.items()}
        per_split: dict[str, dict] = {}
        rows: list[dict] = []
        for key, (items, source) in loaded.items():
            with placed(ctx.device, adapter):  # model.device: the torch reading runs there
                result = evaluate_items(adapter, items, int(mcfg.max_length), int(mcfg.batch_size),
                                        image_match=cfg.image_match, progress=ctx.progress, use_cache=cfg.use_cache,
                                        desc=f"decode {key}")
            per_split[key] = {**result["metrics"], "source": source, "model": cfg.model}
            rows += [{"split": key, **r} for r in result["rows"]]
        first = next(iter(loaded))
        metrics = dict(per_split[first])  # the first split's figures stay at the top level, as before
        if len(per_split) > 1:
            metrics["splits"] = per_split
        items = loaded[first][0]
        k = min(cfg.latency_samples, len(items))
        if k:
            import torch
            sample = torch.stack([it.image for it in items[:k]])
            metrics["latency_batch1"] = latency_batch1(adapter, sample, int(mcfg.max_length))
            if adapter.cached_decoder() is not None:
                metrics["latency_batch1_cached"] = latency_batch1(adapter, sample, int(mcfg.max_length), use_cache=True)
        out.metrics.update(metrics)
        (out.path / "eval.json").write_text(json.dumps(metrics, indent=2))
        with open(out.path / "predictions.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        _write_report(out.path, metrics, rows)
    _print_summary(metrics)
    return out.manifest


def _by_split(m: dict) -> dict[str, dict]:
    return m.get("splits") or {"": m}


def _print_summary(m: dict) -> None:
    for split, s in _by_split(m).items():
        ie = s.get("image_exact_match")
        log.info(f"[evaluate] {split + ': ' if split else ''}n={s['n']} exact_match={s['exact_match']:.3f} "
                 f"image_exact_match={'n/a' if ie is None else f'{ie:.3f}'} cer={s['cer']:.3f} bleu={s['bleu']:.3f} "
                 f"encoder={s['encoder_ms_per_image']:.1f} ms/img decoder={s['decoder_ms_per_image']:.1f} ms/img "
                 f"(batch {s['batch_size']}, cap {s['max_length']}, layout-run cap {s.get('layout_run_cap', 0) or 'off'}, "
                 f"{'KV cache' if s.get('kv_cache') else 'full prefix'})")


_LENGTH_BUCKETS = [(0, 10), (10, 20), (20, 40), (40, 80), (80, 10**9)]


def _exact_by_length(rows: list[dict]) -> dict[str, tuple[float, int]]:
    from pipeline.metrics import normalize
    out = {}
    for lo, hi in _LENGTH_BUCKETS:
        sel = [r for r in rows if lo <= len(normalize(r["truth"])) < hi]
        if sel:
            out[f"{lo}-{hi - 1}" if hi < 10**9 else f"{lo}+"] = (float(np.mean([r["exact"] for r in sel])), len(sel))
    return out


def _fmt(v, digits: int = 3) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def _write_report(folder: Path, m: dict, rows: list[dict]) -> None:
    splits = _by_split(m)
    names = list(splits)
    by_length = {n: _exact_by_length([r for r in rows if r.get("split", "") == n or n == ""]) for n in names}
    labels = [lab for lab in (f"{lo}-{hi - 1}" if hi < 10**9 else f"{lo}+" for lo, hi in _LENGTH_BUCKETS)
              if any(lab in b for b in by_length.values())]
    grouped_bar_plot(folder / "exact_match_by_length.png", labels,
                     {n or "exact match": [by_length[n].get(lab, (0.0, 0))[0] for lab in labels] for n in names},
                     annotations={n or "exact match": [by_length[n].get(lab, (0.0, 0))[1] for lab in labels]
                                  for n in names},
                     title="Exact match by normalized formula length", ylabel="exact match")
    lat = m.get("latency_batch1") or {}
    latc = m.get("latency_batch1_cached") or {}

    def row(label: str, fn) -> list:
        return [label, *(fn(s) for s in splits.values())]

    header = ["metric", *(f"split '{n}'" if n else "value" for n in names)]
    table = markdown_table(header, [
        row("formulas (n)", lambda s: s["n"]), row("source", lambda s: s["source"]),
        row("model", lambda s: s["model"]),
        row("exact match (normalized text)", lambda s: _fmt(s["exact_match"])),
        row("image exact match", lambda s: _fmt(s["image_exact_match"])),
        row("CER (corpus)", lambda s: _fmt(s["cer"])), row("CER (mean per formula)", lambda s: _fmt(s["cer_mean"])),
        row("BLEU-4 (LaTeX atoms)", lambda s: _fmt(s["bleu"])),
        row("stopped at the length cap", lambda s: f"{s['hit_cap_share']:.3f} (cap {s['max_length']})"),
        row("layout-run cap (README, Decoding)", lambda s: s.get("layout_run_cap", 0) or "off"),
        row(f"encoder ms / image (batch {m['batch_size']})", lambda s: _fmt(s["encoder_ms_per_image"], 1)),
        row(f"decoder ms / image (batch {m['batch_size']})", lambda s: _fmt(s["decoder_ms_per_image"], 1)),
        row("accuracy pass decoded with", lambda s: "KV cache" if s.get("kv_cache") else "full prefix (as shipped)"),
    ])
    latency = markdown_table(["latency at batch 1" + (f" (split '{names[0]}', {lat.get('n', 0)} image(s))" if names[0]
                                                      else f" ({lat.get('n', 0)} image(s))"), "value"], [
        ["encoder ms / image", f"{lat.get('encoder_ms', float('nan')):.1f}"],
        ["decoder ms / image (shipped full-prefix decoder)", f"{lat.get('decoder_ms', float('nan')):.1f}"],
        ["decoder ms / step (shipped)", f"{lat.get('decoder_ms_per_step', float('nan')):.1f}"],
        ["decoder ms / image (KV-cached)", f"{latc.get('decoder_ms', float('nan')):.1f}"],
    ])
    misses = []
    for n in names:
        misses += [r for r in rows if not r["exact"] and (r.get("split", "") == n or n == "")][:15 if len(names) == 1 else 8]
    miss_table = markdown_table(["split", "truth", "prediction", "CER"] if names[0] else ["truth", "prediction", "CER"],
                                [([r["split"]] if names[0] else []) + [f"`{r['truth']}`", f"`{r['pred'][:120]}`",
                                                                       f"{r['cer']:.2f}"] for r in misses])
    shift_note = ("\n\nThe shift split holds formulas from packages the corpus never read (`data.shift_packages`), "
                  "minus any formula whose normalized text is in the corpus; it is never used for training, "
                  "calibration or choosing defaults.") if "shift" in names else ""
    (folder / "report.md").write_text(
        "# Evaluation\n\n" + table + shift_note + "\n\n" + latency +
        "\n\n![exact match by length](exact_match_by_length.png)\n\n"
        "Normalization before comparing: display-math wrappers stripped, layout-only tokens "
        "(`\\left`, `\\,`, `\\quad`, `&`, `\\\\` ...) dropped, braces around single-token scripts "
        "removed, whitespace removed (see `pipeline/metrics.py`).\n\n## First misses\n\n" + miss_table + "\n")
