"""Heads out in rounds, the model recovered from the original after each (stage prune's recovery).

:func:`prune_and_recover` removes the chosen heads lowest score first, in ``cfg.iterations`` rounds;
after each round it runs :mod:`pipeline.pruning.recover`'s three steps on the layers from the first one
touched: the closed-form refit, the block-wise distillation and the finetune (split evenly over the
rounds; the finetune checkpoints its state so a killed run resumes). Pooled keys (``pools``) are set
from the start, so the first round's recovery trains them in (with no head removed: one round for them).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch

from pipeline.pruning import recover


def pruned_copy(adapter, heads: dict[int, list[int]], pools: dict[int, list[int]], tokens: Optional[dict] = None,
                mlp_units: Optional[dict[int, list[int]]] = None):
    """A copy of ``adapter`` without ``heads`` ({layer: head indices}), its MLPs narrowed to ``mlp_units``
    ({layer: hidden units kept}), with ``pools``' keys pooled and reading only the patch tokens of the
    ``tokens`` policy (None: all), not recovered."""
    twin = adapter.clone()
    twin.remove_encoder_heads(heads)
    twin.narrow_encoder_mlp(mlp_units or {})
    twin.pool_encoder_keys(pools)
    twin.set_token_policy(tokens)
    return twin


def share(total: int, r: int, rounds: int) -> int:
    """Round ``r``'s part of ``total`` steps split over ``rounds`` (the first rounds take the rest)."""
    return total // rounds + (1 if r < total % rounds else 0)


def prune_and_recover(original, removed: dict[int, list[int]], scores, cfg, images: torch.Tensor, latex: list[str],
                      log: dict, resume: Path, seed: int, progress: bool, device,
                      refit_extra: Optional[torch.Tensor] = None, tune: Optional[tuple] = None,
                      pools: Optional[dict[int, list[int]]] = None,
                      mlp_units: Optional[dict[int, list[int]]] = None):
    """Remove ``removed`` in ``cfg.iterations`` rounds (lowest ``scores`` first), recovering after each
    (``cfg``: stage prune's settings); ``refit_extra``: more images for the refit alone; ``tune``: the
    finetune's (images, LaTeX, targets); ``pools``: layers whose keys are pooled from the start (with no
    head removed, one recovery round for them alone); ``mlp_units``: {layer: MLP hidden units kept}, narrowed
    in the first round. Each round's figures go to ``log["rounds"]``;
    ``resume``: the folder the finetune keeps its state in."""
    tune_images, tune_latex, tune_ids = tune if tune is not None else (images[:0], [], None)
    order = sorted(((scores[l][h], l, h) for l, hs in removed.items() for h in hs))
    rounds = [order[int(len(order) * i / cfg.iterations):int(len(order) * (i + 1) / cfg.iterations)]
              for i in range(cfg.iterations)]
    tokens = cfg.tokens.policy() if hasattr(cfg, "tokens") else None  # stage prune's token policy, or None
    train_tokens = cfg.tokens.policy(training=True) if tokens is not None else None  # the finetune's buckets
    mlp_units = mlp_units or {}
    first_round = {**(pools or {}), **mlp_units}  # layers the first round changes besides its heads
    if (first_round or tokens is not None) and not order:  # no head pruned: one recovery round for them alone
        rounds = [[]]
    student = original.clone()
    student.pool_encoder_keys(pools or {})
    # the refit and the block-wise distillation match the original token for token (every token); the
    # finetune then teaches the model to read with the kept tokens alone (prune.tokens)
    current = {l: list(range(h)) for l, h in enumerate(original.encoder_head_counts())}  # original indices kept
    log["rounds"] = []
    for r, chunk in enumerate(rounds):
        if not chunk and not ((first_round or tokens is not None) and r == 0):
            continue
        now: dict[int, list[int]] = {}
        for _, l, h in chunk:  # original head index -> its position in the current layer
            now.setdefault(l, []).append(current[l].index(h))
        student.remove_encoder_heads(now)
        if r == 0:
            student.narrow_encoder_mlp(mlp_units)
        for _, l, h in chunk:
            current[l].remove(h)
        first = min([*now, *(first_round if r == 0 else {})], default=0)
        layers = list(range(first, len(current)))
        entry = {"removed": {str(k): v for k, v in sorted(now.items())}}
        student.set_token_policy(None)
        refit_n = min(cfg.refit_images, len(images))
        t0 = time.process_time()
        fit = images[:refit_n] if refit_extra is None else torch.cat([images[:refit_n], refit_extra])
        entry["refit"] = recover.refit(student, original, fit, layers, ridge=cfg.ridge, progress=progress)
        entry["refit_images"] = len(fit)
        entry["refit_cpu_seconds"] = time.process_time() - t0
        t0 = time.process_time()
        entry["distill"] = recover.distill(
            student, original, images[:cfg.distill_images], layers, epochs=cfg.distill_epochs, lr=cfg.distill_lr,
            minutes=cfg.distill_minutes / cfg.iterations, seed=seed + r, progress=progress)
        entry["distill_cpu_seconds"] = time.process_time() - t0
        student.set_token_policy(train_tokens)
        t0 = time.process_time()
        entry["finetune_planned"] = share(cfg.finetune_steps, r, cfg.iterations)
        entry["finetune"] = recover.finetune(
            student, original, tune_images, tune_latex, steps=share(cfg.finetune_steps, r, cfg.iterations),
            minutes=cfg.finetune_minutes / cfg.iterations, lr=cfg.lr, batch_size=cfg.finetune_batch,
            scope=cfg.finetune_scope, label_weight=cfg.finetune_label_weight, targets=tune_ids,
            seed=seed + r, progress=progress, state_file=resume / f"finetune-round{r}.pt",
            precision=cfg.finetune_precision, device=device)
        entry["finetune_cpu_seconds"] = time.process_time() - t0
        log["rounds"].append(entry)
    student.set_token_policy(tokens)  # also without a round (nothing pruned): it reads with the policy
    log["cpu_minutes"] = sum(e["refit_cpu_seconds"] + e["distill_cpu_seconds"] + e["finetune_cpu_seconds"]
                             for e in log["rounds"]) / 60
    return student
