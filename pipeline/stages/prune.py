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

import logging
import re
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import List, Optional

import torch

from pipeline.artifacts import sha256_json
from pipeline.choices import choices
from pipeline.context import StageContext
from pipeline.data.corpus import Split, check_splits
from pipeline.errors import PipelineError
from pipeline.pruning import count, recover, report as prune_report, scores as head_scores, select, steps
from pipeline.quantization import readings
from pipeline.reports import Phases

log = logging.getLogger(__name__)
NAME = "prune"
CONFIG_KEY = "prune"

# the options that take one of a few values (the libraries' lists; head criteria stay open: a registry)
Normalize = choices("Normalize", select.NORMALIZE, __name__)
FinetuneScope = choices("FinetuneScope", recover.FINETUNE_SCOPES, __name__)
FinetuneTargets = choices("FinetuneTargets", recover.FINETUNE_TARGETS, __name__)
TeacherReader = choices("TeacherReader", readings.READERS, __name__)
Precision = choices("Precision", recover.PRECISION_SETTINGS, __name__)


@dataclass
class TokensConfig:
    enabled: bool = False            # off: the encoder reads every patch token
    dilate: int = 1                  # the patches holding ink, and their neighbours this many patches around
    frame_stride: int = 4            # plus every frame_stride-th patch of rows and columns: the frame (0: none)
    buckets: List[int] = field(default_factory=lambda: [128, 256, 384, 1024])  # counts kept, padded up to one
    ink_below: float = 250 / 255     # a pixel darker than this (preprocessed scale) is ink
    # the buckets the recovery's finetune batches hold (each batch one bucket; None: `buckets`). Trained on
    # smaller buckets than it reads with, a model read better (docs/results/2026-12-07-token-policies.md)
    train_buckets: Optional[List[int]] = None
    # true: a model whose encoder cannot read a subset of its tokens runs without a policy, said in one
    # line (stage=all, where the policy is on); false: that is an error
    skip_unsupported: bool = False
    # from this encoder layer on (0: never) the last narrow_by kept tokens (filler) skip the layers
    narrow_from: int = 0
    narrow_by: int = 0
    # proportional attention: a kept patch weighs in the encoder's attention as the patches it stands for, itself
    # and the dropped ones nearest it (pipeline/adapters/attention.py: stand_for); docs/tokens.md
    proportional: bool = False

    def policy(self, training: bool = False) -> Optional[dict]:
        """The policy's settings (pipeline/tokens/policy.py), or None when off; ``training``: the
        finetune's (``train_buckets``)."""
        if not self.enabled:
            return None
        buckets = self.train_buckets if training and self.train_buckets else self.buckets
        return {"dilate": int(self.dilate), "frame_stride": int(self.frame_stride),
                "buckets": [int(b) for b in buckets], "ink_below": float(self.ink_below),
                "narrow_from": int(self.narrow_from), "narrow_by": int(self.narrow_by),
                **({"proportional": True} if self.proportional else {})}


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
    # recovery, so the recovery trains it in. [] = off (docs/results/2026-12-03-prune-pooled-keys.md)
    key_pool_layers: List[int] = field(default_factory=list)
    key_pool: List[int] = field(default_factory=lambda: [1, 2])
    # narrowed MLPs: this share of every encoder layer's MLP hidden units removed, the lowest scored by mean
    # |activation| x their weight back (pipeline/pruning/mlp.py), with the heads, before the recovery (0: off)
    mlp_ratio: float = 0.0
    # token reduction (pipeline/tokens/policy.py): the pruned model reads only the patch tokens its policy
    # keeps, and the recovery's finetune trains it to (prune.tokens.enabled=true). Needs unpooled keys
    # (key_pool_layers=[]) and a family with a token grid
    tokens: TokensConfig = field(default_factory=TokensConfig)
    normalize: Normalize = Normalize.layer  # layer | global: how scores compare across layers
    score_images: int = 16           # rendered train formulas for gradient and ablation scores
    recovery: bool = True            # distill the pruned model from the original
    refit_images: int = 128          # train formulas for the closed-form output-projection refit ...
    refit_varied: int = 0            # ... plus this many random formulas of the varied grammar
                                     # (pipeline/data/templates.py): the refit needs no labels, so any
                                     # image the model may meet can show it what to preserve
    # refit regularization (towards the current weights), relative to the mean feature energy; 1e-1,
    # not 1e-3: the looser fit tracked the train images' style and lost CER on the shift split
    # (docs/results/2026-11-30-prune-shift-split.md); chosen on eval + held-out calib images
    ridge: float = 1e-1
    distill_epochs: int = 0          # block-wise distillation after the refit (0 = off; docs/prune.md)
    distill_images: int = 128        # train formulas for it
    distill_lr: float = 1e-3
    distill_minutes: float = 20.0    # wall-clock bound on it (split evenly over the layers)
    # the finetune after the refit: sequence-level distillation of the encoder from the original, on
    # by default (docs/results/2026-12-02-prune-sequence-level-distillation.md): with the refit alone the pruned model
    # read formulas from other sources with 10 % more character errors than the original; with it, 2 %
    finetune_steps: int = 500        # AdamW steps after the refit (0 = the refit alone)
    finetune_minutes: float = 60.0   # wall-clock bound on those steps (~20 minutes on 2 cores); the report
                                     # says when it stopped them; a killed run resumes where it stopped
    finetune_batch: int = 4
    finetune_images: int = 128       # train formulas the finetune cycles over ...
    finetune_varied: int = 256       # ... plus this many random formulas of the varied grammar
    # which weights the finetune trains: model | encoder
    finetune_scope: FinetuneScope = FinetuneScope.encoder
    finetune_label_weight: float = 1.0  # weight of the cross-entropy on the targets (0: only the
                                     # original's logits and encoder output teach)
    # what the decoder is teacher-forced on: labels | teacher (the original's own greedy readings:
    # sequence-level distillation)
    finetune_targets: FinetuneTargets = FinetuneTargets.teacher
    # who reads the original's greedy targets: onnxruntime (its float package, ~5x faster on CPU) | torch;
    # either way cached under <artifacts>/cache/ by model and images (pipeline/quantization/readings.py)
    teacher_reader: TeacherReader = TeacherReader.onnxruntime
    # the student's forward and backward in the finetune: fp32 | bf16 (autocast; weights, optimizer and
    # losses stay fp32; 2.3x faster a step on an AVX512-BF16 CPU, 7x slower on an AVX2 one, which emulates it)
    # | auto (bf16 where the device computes it natively, else fp32; the artifact records which ran)
    finetune_precision: Precision = Precision.fp32
    lr: float = 1e-4
    iterations: int = 1              # prune in this many rounds, recovering after each
    eval_limit: Optional[int] = 50   # formulas of each split scored per variant (None = the whole split)
    eval_splits: List[Split] = field(default_factory=lambda: [Split.eval, Split.shift])  # scored side by side
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
    if not 0.0 <= cfg.mlp_ratio < 1.0:
        raise PipelineError(f"prune.mlp_ratio must be in [0, 1), got {cfg.mlp_ratio}")
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
    if cfg.finetune_precision not in recover.PRECISION_SETTINGS:
        raise PipelineError(f"prune.finetune_precision must be one of {', '.join(recover.PRECISION_SETTINGS)}, "
                            f"got {cfg.finetune_precision!r}")
    if cfg.finetune_targets not in recover.FINETUNE_TARGETS:
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


# ---- the stage --------------------------------------------------------------------------------
def run(cfg: PruneConfig, ctx: StageContext) -> dict:
    validate(cfg)
    phases = Phases()
    original = ctx.load_model(cfg.model)
    attns = steps.attention_layers(original)
    head_counts = original.encoder_head_counts()
    n_remove, per_head = _heads_to_remove(cfg, original, head_counts)
    pools = _key_pools(cfg, original, len(head_counts))
    cfg = _as_run(cfg, ctx, original)
    changed = _changes(cfg, original, n_remove, pools)
    name = ctx.artifact_name("prune", cfg.name)
    inputs = {"model": ctx.model_hash(cfg.model), "corpus": sha256_json([(f.id, f.latex, f.split) for f in ctx.corpus()])}
    config = _artifact_config(cfg, ctx, name, n_remove)
    all_scores = steps.head_scores(cfg, ctx, original, attns, inputs)
    phases.lap("head scores")
    if "shift" in cfg.eval_splits:  # after the head scores: their cache does not depend on it
        inputs["shift"] = sha256_json([(f.id, f.latex) for f in ctx.split("shift")])
    with ctx.output(name, config, inputs) as out:
        if out.reused:
            log.info(f"[prune] unchanged, reused {out.path}")
            log.info(prune_report.summary_line(out.metrics))
            return out.manifest
        torch.manual_seed(ctx.seed)
        resume = _resume_dir(ctx, name, config, inputs)
        removed, random_removed = _selected(cfg, all_scores, n_remove)
        sets = steps.recovery_sets(cfg, ctx, original, changed)
        items = steps.eval_items(cfg, ctx, original)
        phases.lap("render and finetune targets")
        rows, pruned, recovery_log = steps.variants(cfg, ctx, original, removed, random_removed, all_scores, sets,
                                                    items, inputs, pools, resume, changed, n_remove, phases.lap)
        reload_ok = _save(ctx, pruned, out.path / "model", items)
        phases.lap("save and reload")
        correlations = _write_head_scores(out.path, cfg, head_counts, all_scores, removed, random_removed)
        metrics = steps.stage_metrics(cfg, ctx, n_remove, head_counts, removed, pruned, per_head, correlations, rows,
                                      recovery_log, reload_ok, items, phases.seconds)
        out.metrics.update(metrics)
        prune_report.write_report(out.path, cfg, metrics, all_scores, removed, head_counts)
    shutil.rmtree(resume, ignore_errors=True)
    log.info(prune_report.summary_line(out.metrics))
    return out.manifest


def _resume_dir(ctx: StageContext, name: str, config: dict, inputs: dict) -> Path:
    """Finetune checkpoints live outside the atomic output, keyed by config + inputs, so a killed run
    resumes where it stopped; removed once the artifact is complete."""
    return ctx.artifacts_dir / ".resume" / f"{name}-{sha256_json([config, inputs])[:12]}"


def _write_head_scores(folder: Path, cfg: PruneConfig, head_counts, all_scores, removed, random_removed) -> dict:
    """``head_scores.json``; returns each criterion's rank correlation with the single-head ablation."""
    correlations = head_scores.against_ablation(all_scores)
    prune_report.write_head_scores(folder / "head_scores.json", cfg, head_counts, all_scores, removed,
                                   random_removed, correlations)
    return correlations


def _heads_to_remove(cfg: PruneConfig, original, head_counts: list[int]) -> tuple[int, list]:
    """How many heads go (``prune.num_heads`` / ``ratio`` / ``flops_reduction``), and each head's FLOPs."""
    flops_full = count.encoder_flops(original)
    per_head = count.flops_per_head(original)
    try:
        return select.heads_to_remove(head_counts, cfg.min_heads_per_layer, cfg.ratio, cfg.num_heads,
                                      cfg.flops_reduction, flops_full, per_head), per_head
    except ValueError as exc:
        key = next(k for k in ("flops_reduction", "num_heads", "ratio") if getattr(cfg, k) is not None)
        raise PipelineError(f"prune.{key}={getattr(cfg, key)} with prune.min_heads_per_layer="
                            f"{cfg.min_heads_per_layer}: {exc}") from None


def _selected(cfg: PruneConfig, all_scores: dict, n_remove: int) -> tuple[dict, dict]:
    """The heads removed by the chosen criterion, and the random baseline's (same count)."""
    removed = select.select_heads(all_scores[cfg.criterion], n_remove, cfg.min_heads_per_layer, cfg.normalize)
    random_removed = select.select_heads(all_scores["random"], n_remove, cfg.min_heads_per_layer, "global") \
        if "random" in all_scores else {}
    return removed, random_removed


def _save(ctx: StageContext, pruned, folder: Path, items: dict) -> bool:
    """Save the pruned model; it must reload with identical outputs."""
    pruned.save(folder)
    reload_ok = steps.reload_identical(ctx, folder, pruned, next(iter(items.values())))
    if not reload_ok:
        raise PipelineError("the saved pruned model does not reload with identical outputs")
    return reload_ok


def _artifact_config(cfg: PruneConfig, ctx: StageContext, name: str, n_remove: int) -> dict:
    """What the artifact is keyed by: the stage's settings, the heads' count, seed, cap and decoding;
    options left at the value they had before they existed are left out, so earlier artifacts stay valid."""
    limits = ctx.limits
    config = {**asdict(cfg), "name": name, "n_remove": n_remove, "seed": ctx.seed,
              "max_length": limits.max_length, **ctx.decoding_key(), "batch_size": limits.batch_size}
    if not cfg.refit_varied:  # the refit as it was before the option
        config.pop("refit_varied")
    if not cfg.mlp_ratio:  # every MLP unit kept, as before the option
        config.pop("mlp_ratio")
    if not cfg.key_pool_layers:  # no pooling: the keys earlier artifacts were made with
        config.pop("key_pool_layers")
        config.pop("key_pool")
    if not cfg.tokens.enabled:  # every token, as before the option
        config.pop("tokens")
    else:  # the finetune's batches hold one bucket each (they were topped up to their largest before)
        config["tokens"]["batches"] = "one bucket"
        config["tokens"].pop("skip_unsupported")  # what happens to a model that cannot: not this artifact
        if not cfg.tokens.proportional:  # the policy as it was before the option: same keys
            config["tokens"].pop("proportional")
    for key, before in (("finetune_varied", 0), ("finetune_scope", "model"), ("finetune_label_weight", 1.0),
                        ("finetune_targets", "labels"), ("finetune_precision", "fp32"),
                        ("check_before_recovery", True)):
        if config[key] == before:  # the finetune as it was before these options: same keys
            config.pop(key)
    return config


def _tokens_if_readable(cfg: PruneConfig, adapter) -> PruneConfig:
    """``cfg`` without its token policy when the model cannot read a subset of its tokens and
    ``prune.tokens.skip_unsupported`` lets it run without (one line says why); else ``cfg``."""
    if not (cfg.tokens.enabled and cfg.tokens.skip_unsupported and adapter.token_grid() is None):
        return cfg
    log.warning(f"[prune] no token policy: {adapter.token_policy_refusal()}; every token is read "
                f"(prune.tokens.skip_unsupported)")
    return replace(cfg, tokens=replace(cfg.tokens, enabled=False))


def _changes(cfg: PruneConfig, adapter, n_remove: int, pools: dict) -> bool:
    """Whether the stage changes the model (heads out, keys pooled, a token policy); ``prune.tokens`` checked
    against it first: a policy the model cannot read with is one error line, before the work."""
    if cfg.tokens.enabled:
        twin = adapter.clone()
        twin.pool_encoder_keys(pools)
        try:
            twin.set_token_policy(cfg.tokens.policy(training=True))
            twin.set_token_policy(cfg.tokens.policy())
        except PipelineError as exc:
            raise PipelineError(f"prune.tokens: {exc}") from None
    return bool(n_remove or pools or cfg.tokens.enabled or cfg.mlp_ratio)


def _as_run(cfg: PruneConfig, ctx: StageContext, adapter) -> PruneConfig:
    """``cfg`` as it runs on this machine and model: the finetune's precision resolved (``auto``), MLP narrowing
    checked against the model, the token policy dropped where the model cannot read a subset and the chain lets it
    (:func:`_tokens_if_readable`)."""
    cfg = replace(cfg, finetune_precision=ctx.training_precision("prune.finetune_precision", cfg.finetune_precision))
    _check_mlp(cfg, adapter)
    return _tokens_if_readable(cfg, adapter)


def _check_mlp(cfg: PruneConfig, adapter) -> None:
    """``prune.mlp_ratio`` on a model whose encoder MLP cannot be narrowed: one error line, before the work."""
    if cfg.mlp_ratio and not adapter.narrows_mlp():
        raise PipelineError(f"prune.mlp_ratio={cfg.mlp_ratio}: {type(adapter).__name__} cannot narrow its encoder's "
                            f"MLP; 'prune.mlp_ratio=0' prunes heads alone")


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
                                f"'prune.key_pool_layers=[]' prunes without pooling") from None
        except ValueError as exc:
            raise PipelineError(f"prune.key_pool={list(cfg.key_pool)}: {exc}") from None
    return pools


