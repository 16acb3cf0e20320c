"""Stage evaluate: exact match, image exact match, CER, BLEU-4 and latency of a model on formulas.

Sources: the corpus eval split (default), ``eval.formulas=FILE`` (one LaTeX formula per line,
rendered by the project's renderer), or ``eval.images=DIR`` with a labels file
(``<file name>\\t<latex>`` per line; ``DIR/labels.tsv`` when ``eval.labels`` is unset).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from tqdm import tqdm

from pipeline import files
from pipeline.context import StageContext, file_hash
from pipeline.data.render import RenderError, render_formula
from pipeline.errors import ImageError, PipelineError
from pipeline.evaluation import EvalItem, evaluate_items, latency_batch1
from pipeline.reports import bar_plot, markdown_table

NAME = "evaluate"
CONFIG_KEY = "eval"


@dataclass
class EvalConfig:
    model: str = "original"         # original | a stage with a model (prune, ...) | a model folder
    split: str = "eval"             # corpus split when no formulas/images are given
    formulas: Optional[str] = None  # file: one LaTeX formula per line
    images: Optional[str] = None    # folder of formula images ...
    labels: Optional[str] = None    # ... and their labels: "<file name>\t<latex>" per line
    limit: Optional[int] = None     # take the first N
    image_match: bool = True        # im2latex image exact match (renders every prediction)
    use_cache: bool = True          # KV-cached decoding for the accuracy pass (same tokens, ~5x faster)
    latency_samples: int = 4        # images timed again at batch 1, shipped decoder and KV-cached
    name: Optional[str] = None      # artifact folder; default evaluate[-<model>]


Config = EvalConfig


def load_items(cfg: EvalConfig, ctx: StageContext, adapter) -> tuple[list[EvalItem], dict[str, str], str]:
    """The (image, truth) pairs to evaluate, their input hashes, and a description of the source."""
    if cfg.formulas and cfg.images:
        raise PipelineError("give eval.formulas or eval.images, not both")
    if cfg.limit is not None and cfg.limit <= 0:
        raise PipelineError(f"eval.limit must be positive, got {cfg.limit}")
    if cfg.images:
        return _image_items(cfg, adapter)
    if cfg.formulas:
        path = Path(cfg.formulas)
        pairs = [(f"line{i}", ln) for i, ln in files.read_formulas(path, "eval.formulas")]
        source, inputs = f"file {path}", {"formulas": file_hash(path)}
    else:
        formulas = ctx.split(cfg.split)
        pairs = [(f.id, f.latex) for f in formulas]
        source = f"corpus split '{cfg.split}'"
        inputs = {"corpus": ctx.upstream("corpus")["outputs"]["formulas.jsonl"]}
    if cfg.limit:
        pairs = pairs[:cfg.limit]
    if not pairs:
        raise PipelineError(f"nothing to evaluate in {source}")
    items, skipped = [], []
    for fid, latex in tqdm(pairs, desc="render", disable=not ctx.progress):
        try:
            items.append(EvalItem(fid, latex, adapter.preprocess(render_formula(latex))))
        except RenderError:
            skipped.append(fid)
    if skipped:
        print(f"[evaluate] {len(skipped)} formula(s) mathtext cannot render were skipped: {skipped[:5]}")
    if not items:
        raise PipelineError(f"no formula in {source} could be rendered")
    return items, inputs, source


def _image_items(cfg: EvalConfig, adapter) -> tuple[list[EvalItem], dict[str, str], str]:
    folder = Path(cfg.images)
    if not folder.is_dir():
        raise PipelineError(f"eval.images: no such folder {folder}")
    labels_path = Path(cfg.labels) if cfg.labels else folder / "labels.tsv"
    if not labels_path.is_file():
        raise PipelineError(f"eval.images needs a labels file ('<file>\\t<latex>' lines): {labels_path} not found")
    labels = files.read_labels(labels_path, "eval.labels")
    if cfg.limit:
        labels = labels[:cfg.limit]
    items, skipped = [], []
    for name, latex in labels:
        try:
            items.append(EvalItem(name, latex, adapter.preprocess(files.open_image(folder / name))))
        except ImageError as exc:
            skipped.append(str(exc))
    if skipped:
        print(f"[evaluate] skipped {len(skipped)} unreadable image(s): {'; '.join(skipped[:5])}")
    if not items:
        raise ImageError(f"eval.images: no readable image among the {len(labels)} labelled in {labels_path}: "
                         f"{'; '.join(skipped[:3])}")
    return items, {"images": file_hash(folder), "labels": file_hash(labels_path)}, f"images {folder}"


def run(cfg: EvalConfig, ctx: StageContext) -> dict:
    mcfg = ctx.cfg.model
    name = cfg.name or ("evaluate" if cfg.model in ("original", "package") else f"evaluate-{Path(cfg.model).name}")
    adapter = ctx.load_model(cfg.model)
    items, inputs, source = load_items(cfg, ctx, adapter)
    inputs["model"] = ctx.model_hash(cfg.model)
    config = {**asdict(cfg), "max_length": int(mcfg.max_length), "batch_size": int(mcfg.batch_size)}
    with ctx.output(name, config, inputs) as out:
        if out.reused:
            print(f"[evaluate] unchanged, reused {out.path}")
            _print_summary(out.metrics)
            return out.manifest
        result = evaluate_items(adapter, items, int(mcfg.max_length), int(mcfg.batch_size),
                                image_match=cfg.image_match, progress=ctx.progress, use_cache=cfg.use_cache)
        metrics = result["metrics"]
        k = min(cfg.latency_samples, len(items))
        if k:
            import torch
            sample = torch.stack([it.image for it in items[:k]])
            metrics["latency_batch1"] = latency_batch1(adapter, sample, int(mcfg.max_length))
            if adapter.cached_decoder() is not None:
                metrics["latency_batch1_cached"] = latency_batch1(adapter, sample, int(mcfg.max_length), use_cache=True)
        metrics["source"] = source
        metrics["model"] = cfg.model
        out.metrics.update(metrics)
        (out.path / "eval.json").write_text(json.dumps(metrics, indent=2))
        with open(out.path / "predictions.jsonl", "w", encoding="utf-8") as f:
            for row in result["rows"]:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        _write_report(out.path, metrics, result["rows"])
    _print_summary(metrics)
    return out.manifest


def _print_summary(m: dict) -> None:
    ie = m.get("image_exact_match")
    print(f"[evaluate] n={m['n']} exact_match={m['exact_match']:.3f} "
          f"image_exact_match={'n/a' if ie is None else f'{ie:.3f}'} cer={m['cer']:.3f} bleu={m['bleu']:.3f} "
          f"encoder={m['encoder_ms_per_image']:.1f} ms/img decoder={m['decoder_ms_per_image']:.1f} ms/img "
          f"(batch {m['batch_size']}, cap {m['max_length']}, {'KV cache' if m.get('kv_cache') else 'full prefix'})", flush=True)


def _write_report(folder: Path, m: dict, rows: list[dict]) -> None:
    from pipeline.metrics import normalize
    buckets = [(0, 10), (10, 20), (20, 40), (40, 80), (80, 10**9)]
    labels, ems, counts = [], [], []
    for lo, hi in buckets:
        sel = [r for r in rows if lo <= len(normalize(r["truth"])) < hi]
        if sel:
            labels.append(f"{lo}-{hi - 1}" if hi < 10**9 else f"{lo}+")
            ems.append(float(np.mean([r["exact"] for r in sel])))
            counts.append(len(sel))
    bar_plot(folder / "exact_match_by_length.png", labels, ems,
             title="Exact match by normalized formula length", ylabel="exact match", annotations=counts)
    lat = m.get("latency_batch1") or {}
    latc = m.get("latency_batch1_cached") or {}
    table = markdown_table(["metric", "value"], [
        ["formulas (n)", m["n"]], ["source", m["source"]], ["model", m["model"]],
        ["exact match (normalized text)", f"{m['exact_match']:.3f}"],
        ["image exact match", "n/a" if m["image_exact_match"] is None else f"{m['image_exact_match']:.3f}"],
        ["CER (corpus)", f"{m['cer']:.3f}"], ["CER (mean per formula)", f"{m['cer_mean']:.3f}"],
        ["BLEU-4 (LaTeX atoms)", f"{m['bleu']:.3f}"],
        ["stopped at the length cap", f"{m['hit_cap_share']:.3f} (cap {m['max_length']})"],
        [f"encoder ms / image (batch {m['batch_size']})", f"{m['encoder_ms_per_image']:.1f}"],
        [f"decoder ms / image (batch {m['batch_size']})", f"{m['decoder_ms_per_image']:.1f}"],
        ["encoder ms / image (batch 1)", f"{lat.get('encoder_ms', float('nan')):.1f}"],
        ["decoder ms / image (batch 1, shipped full-prefix decoder)", f"{lat.get('decoder_ms', float('nan')):.1f}"],
        ["decoder ms / step (batch 1, shipped)", f"{lat.get('decoder_ms_per_step', float('nan')):.1f}"],
        ["decoder ms / image (batch 1, KV-cached)", f"{latc.get('decoder_ms', float('nan')):.1f}"],
        ["accuracy pass decoded with", "KV cache" if m.get("kv_cache") else "full prefix (as shipped)"],
    ])
    misses = [r for r in rows if not r["exact"]][:15]
    miss_table = markdown_table(["truth", "prediction", "CER"],
                                [[f"`{r['truth']}`", f"`{r['pred'][:120]}`", f"{r['cer']:.2f}"] for r in misses])
    (folder / "report.md").write_text(
        "# Evaluation\n\n" + table + "\n\n![exact match by length](exact_match_by_length.png)\n\n"
        "Normalization before comparing: display-math wrappers stripped, layout-only tokens "
        "(`\\left`, `\\,`, `\\quad`, `&`, `\\\\` ...) dropped, braces around single-token scripts "
        "removed, whitespace removed (see `pipeline/metrics.py`).\n\n## First misses\n\n" + miss_table + "\n")
