"""The prune stage's steps below the stage: the encoder's attention layers, the rendered train,
finetune and eval sets, the head scores (cached for a sweep's jobs), each variant's measured row
(the original's cached), and the saved model's reload check. ``cfg`` is the stage's PruneConfig,
``ctx`` its StageContext."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pipeline.artifacts import sha256_json
from pipeline.data.render import render_inputs
from pipeline.data.templates import varied_formulas
from pipeline.errors import PipelineError
from pipeline.evaluation import EvalItem
from pipeline.pruning import measure, mlp, rounds, scores
from pipeline.pruning.heads import projections
from pipeline.quantization import readings


def attention_layers(adapter) -> list:
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


def render(adapter, formulas, limit: int, progress: bool, desc: str) -> tuple[torch.Tensor, list[str], list[str]]:
    items = render_inputs([(f.id, f.latex) for f in formulas], adapter.preprocess, limit, progress, desc)
    if not items:
        raise PipelineError(f"no {desc} formula could be rendered")
    return torch.stack([x for _, _, x in items]), [latex for _, latex, _ in items], [i for i, _, _ in items]


def train_pool(ctx, seed: int) -> list:
    train = ctx.split("train")
    order = np.random.default_rng(seed).permutation(len(train))
    return [train[i] for i in order]


def finetune_set(cfg, ctx, original, images: torch.Tensor, latex: list[str],
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


def eval_items(cfg, ctx, adapter) -> dict[str, list[EvalItem]]:
    """The first ``eval_limit`` renderable formulas of each of ``cfg.eval_splits``."""
    items = {}
    for split in cfg.eval_splits:
        formulas = ctx.split(split)
        limit = cfg.eval_limit or len(formulas)
        images, latex, ids = render(adapter, formulas, limit, ctx.progress, f"render {split}")
        items[split] = [EvalItem(i, t, x) for i, t, x in zip(ids, latex, images)]
    return items


def measure_variant(adapter, items: dict[str, list[EvalItem]], cfg, ctx, desc: str) -> dict:
    """:func:`pipeline.pruning.measure.measure` with the stage's and the model's settings."""
    return measure.measure(adapter, items, ctx.limits.max_length, ctx.limits.batch_size, cfg.latency_images,
                           cfg.use_cache, ctx.device, ctx.progress, desc)


def baseline(original, items: dict[str, list[EvalItem]], cfg, ctx, inputs: dict) -> dict:
    """The original's row of the table, cached: every job of a sweep shares it."""
    limits = ctx.limits
    config = {"eval_limit": cfg.eval_limit, "eval_splits": list(cfg.eval_splits),
              "latency_images": cfg.latency_images, "use_cache": cfg.use_cache,
              "max_length": limits.max_length, **ctx.decoding_key(),
              "batch_size": limits.batch_size, "seed": ctx.seed}
    # one folder per configuration, so sweeps with different eval sets do not evict each other
    with ctx.cache_output(f"prune-baseline-{sha256_json([config, inputs])[:8]}", config, inputs) as out:
        if not out.reused:
            out.metrics.update(measure_variant(original, items, cfg, ctx, "original"))
    return dict(out.metrics)


@torch.no_grad()
def reload_identical(ctx, folder: Path, pruned, items: list[EvalItem]) -> bool:
    again = ctx.load_model(str(folder))
    x = torch.stack([it.image for it in items[:2]])
    pruned.model.eval()
    return again.encoder_head_counts() == pruned.encoder_head_counts() and \
        torch.equal(again.encode(x), pruned.encode(x))


def head_scores(cfg, ctx, adapter, attns, inputs: dict) -> dict:
    """The chosen criterion's scores (+ random with ``compare_random``, + ``compare_criteria`` and the
    ablation ground truth). Criteria that read images are computed once per model, seed and cap,
    each in its own folder under ``<artifacts>/cache/``, for every later run and sweep job."""
    names = list(dict.fromkeys([cfg.criterion, *(["random"] if cfg.compare_random else []), *cfg.compare_criteria,
                                *(["ablation"] if cfg.compare_criteria else [])]))
    max_length = ctx.limits.max_length

    def load_images():
        images, _, _ = render(adapter, train_pool(ctx, ctx.seed + 1), cfg.score_images, ctx.progress,
                              "render scoring")
        return images, scores.own_predictions(adapter, images, max_length)

    inp = scores.ScoringInput(adapter, attns, ctx.seed, load_images, ctx.progress)
    result = {}
    for name in names:
        if not scores.CRITERIA[name].needs_data:
            result[name] = scores.compute([name], inp)[name]
            continue
        config = {"criterion": name, "score_images": cfg.score_images, "seed": ctx.seed, "max_length": max_length,
                  **ctx.decoding_key(), "targets": "own_predictions"}
        with ctx.cache_output(f"prune-head-scores-{name}-{sha256_json([config, inputs])[:8]}", config, inputs) as out:
            if out.reused:
                result[name] = json.loads((out.path / "scores.json").read_text())
                continue
            result[name] = scores.compute([name], inp)[name]
            out.metrics.update(inp.extra)
            (out.path / "scores.json").write_text(json.dumps(result[name], indent=2))
    return result


def recovery_sets(cfg, ctx, original, changed: bool) -> tuple:
    """The recovery's images: train formulas for the refit, distillation and finetune, the varied
    grammar's for the refit (``refit_extra``) and the finetune, and the finetune set itself
    (:func:`finetune_set`). Nothing is rendered when there is nothing to recover."""
    recover = cfg.recovery and changed
    fit_n = max(cfg.refit_images, cfg.distill_images if cfg.distill_epochs else 0,
                cfg.finetune_images if cfg.finetune_steps else 0)
    train_images, train_latex, _ = render(original, train_pool(ctx, ctx.seed), fit_n, ctx.progress, "render train") \
        if recover else (torch.zeros(0), [], [])
    refit_extra, varied = None, []
    n_varied = max(cfg.refit_varied, cfg.finetune_varied if cfg.finetune_steps else 0)
    if n_varied and recover:
        varied = render_inputs(list(enumerate(varied_formulas(n_varied, ctx.seed))), original.preprocess,
                               None, ctx.progress, "render varied")
        if cfg.refit_varied:
            refit_extra = torch.stack([x for _, _, x in varied[:cfg.refit_varied]])
    tune = finetune_set(cfg, ctx, original, train_images, train_latex, varied[:cfg.finetune_varied]) \
        if recover and cfg.finetune_steps else None
    return train_images, train_latex, refit_extra, tune


def mlp_units(cfg, ctx, original, train_images: torch.Tensor) -> dict[int, list[int]]:
    """{layer: MLP hidden units kept} for ``prune.mlp_ratio`` ({} when 0), scored by the original on the
    refit's train images (rendered here when the recovery rendered none), over the tokens the stage's policy
    keeps (every token without one): the tokens the narrowed model will read."""
    if not cfg.mlp_ratio:
        return {}
    images = train_images[:cfg.refit_images] if len(train_images) else \
        render(original, train_pool(ctx, ctx.seed), cfg.refit_images, ctx.progress, "render train")[0]
    scorer = original.clone()
    scorer.set_token_policy(cfg.tokens.policy())
    return mlp.units_to_keep(mlp.unit_scores(scorer, images), cfg.mlp_ratio)


def variants(cfg, ctx, original, removed: dict, random_removed: dict, all_scores: dict, sets: tuple,
             items: dict, inputs: dict, pools: dict, resume: Path, changed: bool, n_remove: int, lap) -> tuple:
    """Each variant pruned, recovered and measured on ``items``: the original (cached), the pruned
    model before and after recovery, random heads at the same count (each with the same MLP units kept where
    ``prune.mlp_ratio`` narrows them). Returns (the rows, the pruned
    model to save, the recovery's log); ``lap(name)`` marks each one's end."""
    train_images, train_latex, refit_extra, tune = sets
    units = mlp_units(cfg, ctx, original, train_images)  # prune.mlp_ratio's kept MLP units ({}: every unit)
    rows = {"original": baseline(original, items, cfg, ctx, inputs)}
    lap("original's check reading")
    pruned_raw = rounds.pruned_copy(original, removed, pools, cfg.tokens.policy(), units)
    if cfg.check_before_recovery or not (cfg.recovery and changed):
        rows["pruned, before recovery"] = measure_variant(pruned_raw, items, cfg, ctx, "pruned")
        lap("check reading before recovery")
    recovery_log: dict = {}
    pruned = pruned_raw
    if cfg.recovery and changed:
        pruned = rounds.prune_and_recover(original, removed, all_scores[cfg.criterion], cfg, train_images, train_latex,
                                          recovery_log, resume / "pruned", ctx.seed, ctx.progress, ctx.device,
                                          refit_extra, tune, pools, units)
        lap("recovery")
        rows["pruned, after recovery"] = measure_variant(pruned, items, cfg, ctx, "recovered")
        lap("check reading after recovery")
    if cfg.compare_random and n_remove:
        rnd_log: dict = {}
        rnd = rounds.prune_and_recover(original, random_removed, all_scores["random"], cfg, train_images,
                                       train_latex, rnd_log, resume / "random", ctx.seed, ctx.progress,
                                       ctx.device, refit_extra, tune, pools, units) \
            if cfg.recovery else rounds.pruned_copy(original, random_removed, pools, cfg.tokens.policy(), units)
        label = "random heads, after recovery" if cfg.recovery else "random heads"
        rows[label] = measure_variant(rnd, items, cfg, ctx, "random")
        recovery_log["random"] = rnd_log
        lap("random heads")
    return rows, pruned, recovery_log


def stage_metrics(cfg, ctx, n_remove: int, head_counts: list, removed: dict, pruned, per_head, correlations,
                  rows: dict, recovery_log: dict, reload_ok: bool, items: dict, phase_seconds: dict) -> dict:
    """The manifest's metrics: what was removed, the encoder left, each variant's row, the recovery's
    log and the verdict (does the pruned model hold within the tolerances)."""
    metrics = {
        "criterion": cfg.criterion, "heads_removed": n_remove, "heads_total": sum(head_counts),
        "removed": {str(k): v for k, v in removed.items()},
        "encoder_heads": pruned.encoder_head_counts(),
        "encoder_key_pools": pruned.encoder_key_pools(),
        **({"encoder_mlp": pruned.encoder_mlp_widths()} if cfg.mlp_ratio else {}),
        "token_policy": pruned.token_policy.to_dict() if pruned.token_policy is not None else None,
        "flops_per_head": per_head, "spearman_vs_ablation": correlations,
        "variants": rows, "recovery": recovery_log, "reload_identical": reload_ok,
        "eval_n": len(next(iter(items.values()))), "max_length": ctx.limits.max_length,
        "phase_seconds": phase_seconds,
    }
    metrics.update(measure.verdict(rows, cfg.em_tolerance, cfg.cer_tolerance))
    return metrics
