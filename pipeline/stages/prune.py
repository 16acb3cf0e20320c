"""Stage prune: remove low-scored attention heads from the encoder, recover, and measure the cost.

Heads are scored (``l2_qkv``, ``l2_qkvo``, ``random``, ``gradient``, ``ablation``), the lowest are
removed globally (``prune.num_heads``, ``prune.ratio`` or ``prune.flops_reduction``, keeping
``prune.min_heads_per_layer``), the q/k/v/out matrices are physically sliced, and the model is
recovered from the original: a closed-form refit of the projections after each pruned layer, then
sequence-level distillation of the encoder (the original's greedy readings of train-split and
varied-grammar formulas as targets). The report compares
original / pruned before recovery / after recovery / random heads at the same count, on the eval
split and on the shift split (formulas from packages training never saw), side by side.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch

from pipeline.artifacts import sha256_json
from pipeline.context import StageContext
from pipeline.data.corpus import check_splits
from pipeline.data.render import render_inputs
from pipeline.data.templates import varied_formulas
from pipeline.errors import PipelineError
from pipeline.evaluation import EvalItem
from pipeline.pruning import count, measure, recover, report as prune_report, rounds, scores as head_scores, select
from pipeline.pruning.heads import projections
from pipeline.quantization import readings
from pipeline.reports import Phases

log = logging.getLogger(__name__)
NAME = "prune"
CONFIG_KEY = "prune"


@dataclass
class PruneConfig:
    model: str = "original"          # the model to prune: original | a stage with a model | a folder
    # defaults: the sweep's best point (docs/prune.md): the 8 lowest-l2_qkv heads of 32 (per-layer
    # normalized), the most heads whose exact match after recovery stayed within 1 point on the whole
    # eval split (12 did on the first 192 formulas, not on all 574)
    criterion: str = "l2_qkv"        # l2_qkv | l2_qkvo | random | gradient | ablation
    ratio: float = 0.25              # share of encoder heads removed ...
    num_heads: Optional[int] = None  # ... or this many heads (wins over ratio) ...
    flops_reduction: Optional[float] = None  # ... or the fewest heads cutting encoder FLOPs by this share
    min_heads_per_layer: int = 1
    # key/value pooling (PVT's spatial-reduction attention, ``ExplicitAttention.pool_keys``): these
    # encoder layers' self-attention attends to the means of each key_pool window ([rows, cols] of
    # patches) of its keys and values, every query kept; applied with the head removal, before the
    # recovery, so the recovery trains it in. [] = off (docs/prune.md, "Pooled keys")
    key_pool_layers: List[int] = field(default_factory=list)
    key_pool: List[int] = field(default_factory=lambda: [1, 2])
    normalize: str = "layer"         # layer | global: how scores compare across layers
    score_images: int = 16           # rendered train formulas for gradient and ablation scores
    recovery: bool = True            # distill the pruned model from the original
    refit_images: int = 128          # train formulas for the closed-form output-projection refit ...
    refit_varied: int = 0            # ... plus this many random formulas of the varied grammar
                                     # (pipeline/data/templates.py): the refit needs no labels, so any
                                     # image the model may meet can show it what to preserve
    # refit regularization (towards the current weights), relative to the mean feature energy; 1e-1,
    # not 1e-3: the looser fit tracked the train images' style and lost CER on the shift split
    # (docs/prune.md, "On formulas training never saw"); chosen on eval + held-out calib images
    ridge: float = 1e-1
    distill_epochs: int = 0          # block-wise distillation after the refit (0 = off; docs/prune.md)
    distill_images: int = 128        # train formulas for it
    distill_lr: float = 1e-3
    distill_minutes: float = 20.0    # wall-clock bound on it (split evenly over the layers)
    # the finetune after the refit: sequence-level distillation of the encoder from the original, on
    # by default (docs/prune.md, "Sequence-level distillation"): with the refit alone the pruned model
    # read formulas from other sources with 10 % more character errors than the original; with it, 2 %
    finetune_steps: int = 500        # AdamW steps after the refit (0 = the refit alone)
    finetune_minutes: float = 60.0   # wall-clock bound on those steps (~20 minutes on 2 cores); the report
                                     # says when it stopped them; a killed run resumes where it stopped
    finetune_batch: int = 4
    finetune_images: int = 128       # train formulas the finetune cycles over ...
    finetune_varied: int = 256       # ... plus this many random formulas of the varied grammar
    finetune_scope: str = "encoder"  # model | encoder: which weights the finetune trains
    finetune_label_weight: float = 1.0  # weight of the cross-entropy on the targets (0: only the
                                     # original's logits and encoder output teach)
    finetune_targets: str = "teacher"  # labels | teacher: what the decoder is teacher-forced on; teacher:
                                     # the original's own greedy readings (sequence-level distillation)
    # who reads the original's greedy targets: onnxruntime (its float package, ~5x faster on CPU) | torch;
    # either way cached under <artifacts>/cache/ by model and images (pipeline/quantization/readings.py)
    teacher_reader: str = "onnxruntime"
    # the student's forward and backward in the finetune: fp32 | bf16 (autocast; weights, optimizer and
    # losses stay fp32; 2.3x faster a step on an AVX512-BF16 CPU)
    finetune_precision: str = "fp32"
    lr: float = 1e-4
    iterations: int = 1              # prune in this many rounds, recovering after each
    eval_limit: Optional[int] = 50   # formulas of each split scored per variant (None = the whole split)
    eval_splits: List[str] = field(default_factory=lambda: ["eval", "shift"])  # scored side by side
    em_tolerance: float = 0.01       # "holds": exact match at most this far below the original ...
    cer_tolerance: float = 0.05      # ... and CER at most this much higher, relative, on every split
    compare_random: bool = True      # also prune random heads (same count, same recovery)
    # the pruned model's reading before the recovery (the table's row that shows what the recovery
    # gives): it runs to the length cap on most formulas, so it costs as much as the other two rows
    # together; off in stage=all. Without a recovery it is the pruned model's only row, always read
    check_before_recovery: bool = True
    # criteria scored beside the chosen one and ranked against the single-head ablation (computed
    # then too): a comparison for sweeps, minutes of CPU; only the chosen criterion by default
    compare_criteria: List[str] = field(default_factory=list)
    latency_images: int = 4          # images timed at batch 1 for encoder latency
    use_cache: bool = True           # evaluate with the adapter's KV-cached decoder (same tokens, faster)
    name: Optional[str] = None       # artifact folder; default "prune", or per-job in a multirun


Config = PruneConfig


# ---- validation -------------------------------------------------------------------------------
def validate(cfg: PruneConfig) -> None:
    for c in [cfg.criterion, *cfg.compare_criteria]:
        if c not in head_scores.CRITERIA:
            raise PipelineError(f"prune.criterion and prune.compare_criteria take {', '.join(head_scores.CRITERIA)}; "
                                f"got {c!r}")
    if cfg.normalize not in select.NORMALIZE:
        raise PipelineError(f"prune.normalize must be one of {', '.join(select.NORMALIZE)}, got {cfg.normalize!r}")
    if not 0.0 <= cfg.ratio < 1.0:
        raise PipelineError(f"prune.ratio must be in [0, 1), got {cfg.ratio}")
    if cfg.flops_reduction is not None and not 0.0 <= cfg.flops_reduction < 1.0:
        raise PipelineError(f"prune.flops_reduction must be in [0, 1), got {cfg.flops_reduction}")
    if cfg.num_heads is not None and cfg.num_heads < 0:
        raise PipelineError(f"prune.num_heads must be >= 0, got {cfg.num_heads}")
    if cfg.min_heads_per_layer < 1:
        raise PipelineError(f"prune.min_heads_per_layer must be at least 1 (a layer without heads is not "
                            f"attention any more), got {cfg.min_heads_per_layer}")
    for key in ("score_images", "refit_images", "distill_images", "finetune_batch", "finetune_images", "iterations",
                "latency_images"):
        if getattr(cfg, key) < (0 if key == "latency_images" else 1):
            raise PipelineError(f"prune.{key} must be positive, got {getattr(cfg, key)}")
    if cfg.refit_varied < 0 or cfg.finetune_varied < 0:
        raise PipelineError(f"prune.refit_varied and prune.finetune_varied must be >= 0, "
                            f"got {cfg.refit_varied} and {cfg.finetune_varied}")
    if cfg.finetune_scope not in recover.FINETUNE_SCOPES:
        raise PipelineError(f"prune.finetune_scope must be one of {', '.join(recover.FINETUNE_SCOPES)}, "
                            f"got {cfg.finetune_scope!r}")
    if cfg.teacher_reader not in readings.READERS:
        raise PipelineError(f"prune.teacher_reader must be one of {', '.join(readings.READERS)}, got {cfg.teacher_reader!r}")
    if cfg.finetune_precision not in recover.FINETUNE_PRECISIONS:
        raise PipelineError(f"prune.finetune_precision must be one of {', '.join(recover.FINETUNE_PRECISIONS)}, "
                            f"got {cfg.finetune_precision!r}")
    if cfg.finetune_targets not in ("labels", "teacher"):
        raise PipelineError(f"prune.finetune_targets must be labels or teacher, got {cfg.finetune_targets!r}")
    if not cfg.finetune_label_weight >= 0:
        raise PipelineError(f"prune.finetune_label_weight must be >= 0, got {cfg.finetune_label_weight}")
    if cfg.finetune_steps < 0 or cfg.finetune_minutes < 0 or cfg.distill_epochs < 0 or cfg.distill_minutes < 0:
        raise PipelineError("prune.distill_epochs, prune.distill_minutes, prune.finetune_steps and "
                            "prune.finetune_minutes must be >= 0")
    if not cfg.ridge >= 0:  # also refuses NaN
        raise PipelineError(f"prune.ridge must be >= 0, got {cfg.ridge}")
    if cfg.lr <= 0 or cfg.distill_lr <= 0:
        raise PipelineError("prune.lr and prune.distill_lr must be > 0")
    if cfg.eval_limit is not None and cfg.eval_limit <= 0:
        raise PipelineError(f"prune.eval_limit must be positive, got {cfg.eval_limit}")
    if not cfg.eval_splits or len(set(cfg.eval_splits)) != len(cfg.eval_splits):
        raise PipelineError(f"prune.eval_splits must name at least one split, each once, got {list(cfg.eval_splits)}")
    check_splits("prune.eval_splits", cfg.eval_splits)
    if cfg.name is not None and not re.fullmatch(r"[A-Za-z0-9_.,=+-]+", cfg.name):
        raise PipelineError(f"prune.name must be a plain folder name, got {cfg.name!r}")


def _attention_layers(adapter) -> list:
    """The encoder's attention modules; one clear error when the adapter knows none."""
    try:
        counts = adapter.encoder_head_counts()
        attns = [adapter.encoder_attention(i) for i in range(len(counts))]
        for a in attns:
            projections(a)
    except (TypeError, AttributeError, NotImplementedError, IndexError) as exc:
        raise PipelineError(f"the model has no encoder attention the '{adapter.family}' adapter can prune ({exc})") from None
    if not counts or not any(counts):
        raise PipelineError(f"the model has no encoder attention the '{adapter.family}' adapter can prune")
    return attns


# ---- data -------------------------------------------------------------------------------------
def _render(adapter, formulas, limit: int, progress: bool, desc: str) -> tuple[torch.Tensor, list[str], list[str]]:
    items = render_inputs([(f.id, f.latex) for f in formulas], adapter.preprocess, limit, progress, desc)
    if not items:
        raise PipelineError(f"no {desc} formula could be rendered")
    return torch.stack([x for _, _, x in items]), [latex for _, latex, _ in items], [i for i, _, _ in items]


def _train_pool(ctx: StageContext, seed: int) -> list:
    train = ctx.split("train")
    order = np.random.default_rng(seed).permutation(len(train))
    return [train[i] for i in order]


# ---- the stage --------------------------------------------------------------------------------
def run(cfg: PruneConfig, ctx: StageContext) -> dict:
    validate(cfg)
    phases = Phases()
    original = ctx.load_model(cfg.model)
    attns = _attention_layers(original)
    head_counts = original.encoder_head_counts()
    total_heads = sum(head_counts)

    flops_full = count.encoder_flops(original)
    per_head = count.flops_per_head(original)
    try:
        n_remove = select.heads_to_remove(head_counts, cfg.min_heads_per_layer, cfg.ratio, cfg.num_heads,
                                          cfg.flops_reduction, flops_full, per_head)
    except ValueError as exc:
        key = next(k for k in ("flops_reduction", "num_heads", "ratio") if getattr(cfg, k) is not None)
        raise PipelineError(f"prune.{key}={getattr(cfg, key)} with prune.min_heads_per_layer="
                            f"{cfg.min_heads_per_layer}: {exc}") from None

    pools = _key_pools(cfg, original, len(head_counts))
    changed = bool(n_remove or pools)
    name = ctx.artifact_name("prune", cfg.name)
    corpus_hash = sha256_json([(f.id, f.latex, f.split) for f in ctx.corpus()])
    inputs = {"model": ctx.model_hash(cfg.model), "corpus": corpus_hash}
    config = _artifact_config(cfg, ctx, name, n_remove)
    all_scores = _head_scores(cfg, ctx, original, attns, inputs)
    phases.lap("head scores")
    if "shift" in cfg.eval_splits:  # after the head scores: their cache does not depend on it
        inputs["shift"] = sha256_json([(f.id, f.latex) for f in ctx.split("shift")])

    with ctx.output(name, config, inputs) as out:
        if out.reused:
            log.info(f"[prune] unchanged, reused {out.path}")
            log.info(prune_report.summary_line(out.metrics))
            return out.manifest
        torch.manual_seed(ctx.seed)
        # finetune checkpoints live outside the atomic output, keyed by config + inputs, so a killed
        # run resumes where it stopped; removed once the artifact is complete
        resume = ctx.artifacts_dir / ".resume" / f"{name}-{sha256_json([config, inputs])[:12]}"
        chosen_scores = all_scores[cfg.criterion]
        removed = select.select_heads(chosen_scores, n_remove, cfg.min_heads_per_layer, cfg.normalize)
        random_removed = select.select_heads(all_scores["random"], n_remove, cfg.min_heads_per_layer, "global") \
            if "random" in all_scores else {}

        pool = _train_pool(ctx, ctx.seed)
        fit_n = max(cfg.refit_images, cfg.distill_images if cfg.distill_epochs else 0,
                    cfg.finetune_images if cfg.finetune_steps else 0)
        train_images, train_latex, _ = _render(original, pool, fit_n, ctx.progress, "render train") \
            if cfg.recovery and changed else (torch.zeros(0), [], [])
        refit_extra, varied = None, []
        n_varied = max(cfg.refit_varied, cfg.finetune_varied if cfg.finetune_steps else 0)
        if n_varied and cfg.recovery and changed:
            varied = render_inputs(list(enumerate(varied_formulas(n_varied, ctx.seed))), original.preprocess,
                                   None, ctx.progress, "render varied")
            if cfg.refit_varied:
                refit_extra = torch.stack([x for _, _, x in varied[:cfg.refit_varied]])
        tune = _finetune_set(cfg, ctx, original, train_images, train_latex, varied[:cfg.finetune_varied]) \
            if cfg.recovery and changed and cfg.finetune_steps else None
        eval_items = _eval_items(cfg, ctx, original)
        phases.lap("render and finetune targets")

        variants: dict[str, dict] = {}
        variants["original"] = _baseline(original, eval_items, cfg, ctx, inputs)
        phases.lap("original's check reading")

        pruned_raw = rounds.pruned_copy(original, removed, pools)
        if cfg.check_before_recovery or not (cfg.recovery and changed):
            variants["pruned, before recovery"] = _measure(pruned_raw, eval_items, cfg, ctx, "pruned")
            phases.lap("check reading before recovery")

        recovery_log: dict = {}
        if cfg.recovery and changed:
            pruned = rounds.prune_and_recover(original, removed, chosen_scores, cfg, train_images, train_latex,
                                              recovery_log, resume / "pruned", ctx.seed, ctx.progress, ctx.device,
                                              refit_extra, tune, pools)
            phases.lap("recovery")
            variants["pruned, after recovery"] = _measure(pruned, eval_items, cfg, ctx, "recovered")
            phases.lap("check reading after recovery")
        else:
            pruned = pruned_raw
        if cfg.compare_random and n_remove:
            rnd_log: dict = {}
            rnd = rounds.prune_and_recover(original, random_removed, all_scores["random"], cfg, train_images,
                                           train_latex, rnd_log, resume / "random", ctx.seed, ctx.progress,
                                           ctx.device, refit_extra, tune, pools) \
                if cfg.recovery else rounds.pruned_copy(original, random_removed, pools)
            label = "random heads, after recovery" if cfg.recovery else "random heads"
            variants[label] = _measure(rnd, eval_items, cfg, ctx, "random")
            recovery_log["random"] = rnd_log
            phases.lap("random heads")

        pruned.save(out.path / "model")
        reload_ok = _reload_identical(ctx, out.path / "model", pruned, next(iter(eval_items.values())))
        if not reload_ok:
            raise PipelineError("the saved pruned model does not reload with identical outputs")
        phases.lap("save and reload")

        correlations = head_scores.against_ablation(all_scores)
        prune_report.write_head_scores(out.path / "head_scores.json", cfg, head_counts, all_scores, removed,
                                       random_removed, correlations)
        metrics = {
            "criterion": cfg.criterion, "heads_removed": n_remove, "heads_total": total_heads,
            "removed": {str(k): v for k, v in removed.items()},
            "encoder_heads": pruned.encoder_head_counts(),
            "encoder_key_pools": pruned.encoder_key_pools(),
            "flops_per_head": per_head, "spearman_vs_ablation": correlations,
            "variants": variants, "recovery": recovery_log, "reload_identical": reload_ok,
            "eval_n": len(next(iter(eval_items.values()))), "max_length": int(ctx.cfg.model.max_length),
            "phase_seconds": phases.seconds,
        }
        metrics.update(measure.verdict(variants, cfg.em_tolerance, cfg.cer_tolerance))
        out.metrics.update(metrics)
        prune_report.write_report(out.path, cfg, metrics, all_scores, removed, head_counts)
    shutil.rmtree(resume, ignore_errors=True)
    log.info(prune_report.summary_line(out.metrics))
    return out.manifest


def _artifact_config(cfg: PruneConfig, ctx: StageContext, name: str, n_remove: int) -> dict:
    """What the artifact is keyed by: the stage's settings, the heads' count, seed, cap and decoding;
    options left at the value they had before they existed are left out, so earlier artifacts stay valid."""
    mcfg = ctx.cfg.model
    config = {**asdict(cfg), "name": name, "n_remove": n_remove, "seed": ctx.seed,
              "max_length": int(mcfg.max_length), **ctx.decoding_key(), "batch_size": int(mcfg.batch_size)}
    if not cfg.refit_varied:  # the refit as it was before the option
        config.pop("refit_varied")
    if not cfg.key_pool_layers:  # no pooling: the keys earlier artifacts were made with
        config.pop("key_pool_layers")
        config.pop("key_pool")
    for key, before in (("finetune_varied", 0), ("finetune_scope", "model"), ("finetune_label_weight", 1.0),
                        ("finetune_targets", "labels"), ("finetune_precision", "fp32"),
                        ("check_before_recovery", True)):
        if config[key] == before:  # the finetune as it was before these options: same keys
            config.pop(key)
    return config


def _key_pools(cfg: PruneConfig, adapter, layers: int) -> dict[int, list[int]]:
    """``prune.key_pool_layers`` -> {layer: window}, checked against the model (one error line)."""
    bad = [l for l in cfg.key_pool_layers if not 0 <= l < layers]
    if bad or len(set(cfg.key_pool_layers)) != len(cfg.key_pool_layers):
        raise PipelineError(f"prune.key_pool_layers={list(cfg.key_pool_layers)}: each an encoder layer in "
                            f"0..{layers - 1}, at most once")
    if len(cfg.key_pool) != 2 or min(cfg.key_pool) < 1:
        raise PipelineError(f"prune.key_pool={list(cfg.key_pool)}: [rows, cols] of patches, each >= 1")
    pools = {int(l): [int(v) for v in cfg.key_pool] for l in cfg.key_pool_layers}
    if pools:
        try:
            adapter.clone().pool_encoder_keys(pools)
        except NotImplementedError as exc:
            raise PipelineError(f"prune.key_pool_layers={list(cfg.key_pool_layers)}: {exc}; "
                                f"'prune.key_pool_layers=[]' prunes without pooling (stage=all pools layer 0)") from None
        except ValueError as exc:
            raise PipelineError(f"prune.key_pool={list(cfg.key_pool)}: {exc}") from None
    return pools


def _finetune_set(cfg: PruneConfig, ctx: StageContext, original, images: torch.Tensor, latex: list[str],
                  varied: list) -> tuple:
    """The finetune's images and LaTeX (the first ``prune.finetune_images`` train formulas, then the
    varied grammar's) and, with ``prune.finetune_targets=teacher``, the original's greedy readings
    of them: read once, shared by every round and by the random-heads baseline."""
    tune_images, tune_latex = images[:cfg.finetune_images], list(latex[:cfg.finetune_images])
    if varied:  # render_inputs' (id, LaTeX, image) rows
        tune_images = torch.cat([tune_images, torch.stack([x for _, _, x in varied])])
        tune_latex += [t for _, t, _ in varied]
    ids = None
    if cfg.finetune_targets == "teacher":  # cached by model and images: a rerun with other finetune settings reads them back
        read, _ = readings.greedy_readings(ctx, original, ctx.model_hash(cfg.model), tune_images, cfg.teacher_reader,
                                           what="prune's finetune targets (the original's readings)")
        ids = readings.with_bos(original, read)
    return tune_images, tune_latex, ids


def _eval_items(cfg: PruneConfig, ctx: StageContext, adapter) -> dict[str, list[EvalItem]]:
    """The first ``eval_limit`` renderable formulas of each of ``cfg.eval_splits``."""
    items = {}
    for split in cfg.eval_splits:
        formulas = ctx.split(split)
        limit = cfg.eval_limit or len(formulas)
        images, latex, ids = _render(adapter, formulas, limit, ctx.progress, f"render {split}")
        items[split] = [EvalItem(i, t, x) for i, t, x in zip(ids, latex, images)]
    return items


def _measure(adapter, items: dict[str, list[EvalItem]], cfg: PruneConfig, ctx: StageContext, desc: str) -> dict:
    """:func:`pipeline.pruning.measure.measure` with the stage's and the model's settings."""
    mcfg = ctx.cfg.model
    return measure.measure(adapter, items, int(mcfg.max_length), int(mcfg.batch_size), cfg.latency_images,
                           cfg.use_cache, ctx.device, ctx.progress, desc)


def _baseline(original, items: dict[str, list[EvalItem]], cfg: PruneConfig, ctx: StageContext, inputs: dict) -> dict:
    """The original's row of the table, cached: every job of a sweep shares it."""
    mcfg = ctx.cfg.model
    config = {"eval_limit": cfg.eval_limit, "eval_splits": list(cfg.eval_splits),
              "latency_images": cfg.latency_images, "use_cache": cfg.use_cache,
              "max_length": int(mcfg.max_length), **ctx.decoding_key(),
              "batch_size": int(mcfg.batch_size), "seed": ctx.seed}
    # one folder per configuration, so sweeps with different eval sets do not evict each other
    with ctx.cache_output(f"prune-baseline-{sha256_json([config, inputs])[:8]}", config, inputs) as out:
        if not out.reused:
            out.metrics.update(_measure(original, items, cfg, ctx, "original"))
    return dict(out.metrics)


@torch.no_grad()
def _reload_identical(ctx: StageContext, folder: Path, pruned, items: list[EvalItem]) -> bool:
    again = ctx.load_model(str(folder))
    x = torch.stack([it.image for it in items[:2]])
    pruned.model.eval()
    return again.encoder_head_counts() == pruned.encoder_head_counts() and \
        torch.equal(again.encode(x), pruned.encode(x))


# ---- head scores (cached: the sweep's jobs share them) -------------------------------------------
def _head_scores(cfg: PruneConfig, ctx: StageContext, adapter, attns, inputs: dict) -> dict:
    """The chosen criterion's scores (+ random with ``compare_random``, + ``compare_criteria`` and the
    ablation ground truth). Criteria that read images are computed once per model, seed and cap,
    each in its own folder under ``<artifacts>/cache/``, for every later run and sweep job."""
    names = list(dict.fromkeys([cfg.criterion, *(["random"] if cfg.compare_random else []), *cfg.compare_criteria,
                                *(["ablation"] if cfg.compare_criteria else [])]))
    max_length = int(ctx.cfg.model.max_length)

    def load_images():
        images, _, _ = _render(adapter, _train_pool(ctx, ctx.seed + 1), cfg.score_images, ctx.progress,
                               "render scoring")
        return images, head_scores.own_predictions(adapter, images, max_length)

    inp = head_scores.ScoringInput(adapter, attns, ctx.seed, load_images, ctx.progress)
    result = {}
    for name in names:
        if not head_scores.CRITERIA[name].needs_data:
            result[name] = head_scores.compute([name], inp)[name]
            continue
        config = {"criterion": name, "score_images": cfg.score_images, "seed": ctx.seed, "max_length": max_length,
                  **ctx.decoding_key(), "targets": "own_predictions"}
        with ctx.cache_output(f"prune-head-scores-{name}-{sha256_json([config, inputs])[:8]}", config, inputs) as out:
            if out.reused:
                result[name] = json.loads((out.path / "scores.json").read_text())
                continue
            result[name] = head_scores.compute([name], inp)[name]
            out.metrics.update(inp.extra)
            (out.path / "scores.json").write_text(json.dumps(result[name], indent=2))
    return result
