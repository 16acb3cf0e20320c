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

from pipeline.device import placed
from pipeline.context import StageContext
from pipeline.data.corpus import Split
from pipeline.errors import PipelineError
from pipeline.evaluation import evaluate_sources, latency_of
from pipeline.evaluation.report import by_split, write_report
from pipeline.evaluation.sources import Source, load_items, read_source

log = logging.getLogger(__name__)

NAME = "evaluate"
CONFIG_KEY = "eval"


@dataclass
class EvalConfig:
    model: str = "original"         # original | a stage with a model (prune, ...) | a model folder
    split: Optional[Split] = None   # one split (train|calib|eval|shift) when no formulas/images are given ...
    splits: List[Split] = field(default_factory=lambda: [Split.eval, Split.shift])  # ... else these, side by side
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


def run(cfg: EvalConfig, ctx: StageContext) -> dict:
    limits = ctx.limits
    name = cfg.name or ("evaluate" if cfg.model in ("original", "package") else f"evaluate-{Path(cfg.model).name}")
    read: dict[str, Source] = {}  # split (or "input") -> what to evaluate
    inputs: dict[str, str] = {}
    for split in sources(cfg):
        src = read_source(cfg, ctx, split)
        read[split or "input"] = src
        inputs.update(src.inputs)
    inputs["model"] = ctx.model_hash(cfg.model)
    config = {**asdict(cfg), "max_length": limits.max_length, **ctx.decoding_key(),
              "batch_size": limits.batch_size}
    config.pop("in_chain")  # whether stage=all runs it, not what it measures
    with ctx.output(name, config, inputs) as out:
        if out.reused:  # decided on hashes alone: no model loaded, nothing rendered
            log.info(f"[evaluate] unchanged, reused {out.path}")
            _print_summary(out.metrics)
            return out.manifest
        adapter = ctx.load_model(cfg.model)
        loaded = {key: (load_items(src, adapter, ctx.progress), src.description) for key, src in read.items()}
        with placed(ctx.device, adapter):  # model.device: the torch reading runs there
            metrics, rows = evaluate_sources(adapter, loaded, limits.max_length, limits.batch_size, cfg.model,
                                             cfg.image_match, cfg.use_cache, ctx.progress)
        first_items = next(iter(loaded.values()))[0]
        metrics.update(latency_of(adapter, first_items[:cfg.latency_samples], limits.max_length))
        out.metrics.update(metrics)
        (out.path / "eval.json").write_text(json.dumps(metrics, indent=2))
        with open(out.path / "predictions.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        write_report(out.path, metrics, rows)
    _print_summary(metrics)
    return out.manifest


def _print_summary(m: dict) -> None:
    for split, s in by_split(m).items():
        ie = s.get("image_exact_match")
        log.info(f"[evaluate] {split + ': ' if split else ''}n={s['n']} exact_match={s['exact_match']:.3f} "
                 f"image_exact_match={'n/a' if ie is None else f'{ie:.3f}'} cer={s['cer']:.3f} bleu={s['bleu']:.3f} "
                 f"encoder={s['encoder_ms_per_image']:.1f} ms/img decoder={s['decoder_ms_per_image']:.1f} ms/img "
                 f"(batch {s['batch_size']}, cap {s['max_length']}, layout-run cap {s.get('layout_run_cap', 0) or 'off'}, "
                 f"{'KV cache' if s.get('kv_cache') else 'full prefix'})")


