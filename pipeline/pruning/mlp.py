"""Narrowing the encoder's MLPs: which hidden units go (stage prune, ``prune.mlp_ratio``).

A unit's score is what the block's output loses without it, to first order: the mean magnitude of its
activation (the projection back's input) over the original model's tokens on the refit images (those the
stage's token policy keeps, where it has one), times the norm of its column in the projection back. Each
encoder layer keeps the same share of its units, the highest scored; the closed-form refit then fits the
projection back on the units left (its features are that projection's input), and the finetune trains
the rest.
"""
from __future__ import annotations

import torch

from pipeline.pruning.scores import _batches


@torch.no_grad()
def unit_scores(adapter, images: torch.Tensor, batch_size: int = 8) -> dict[int, torch.Tensor]:
    """{layer: [units]} each encoder MLP hidden unit's mean |activation| x its fc2 column's norm."""
    layers = range(len(adapter.encoder_head_counts()))
    sums = {l: torch.zeros(adapter.encoder_mlp(l)[1].in_features, dtype=torch.float64) for l in layers}
    tokens = [0]

    def hook(l):
        def pre(module, args):
            a = args[0].detach().reshape(-1, args[0].shape[-1])
            sums[l].add_(a.abs().double().sum(0))
            if l == 0:
                tokens[0] += a.shape[0]
        return pre

    handles = [adapter.encoder_mlp(l)[1].register_forward_pre_hook(hook(l)) for l in layers]
    try:
        for sl in _batches(len(images), batch_size):
            adapter.encode(images[sl])
    finally:
        for h in handles:
            h.remove()
    n = max(tokens[0], 1)
    return {l: (sums[l] / n) * adapter.encoder_mlp(l)[1].weight.detach().double().norm(dim=0) for l in layers}


def units_to_keep(scores: dict[int, torch.Tensor], ratio: float) -> dict[int, list[int]]:
    """{layer: the units kept, ascending}: each layer keeps its highest-scored ``1 - ratio`` of its units
    (at least one; ties by index); {} for ratio 0."""
    if ratio <= 0:
        return {}
    out = {}
    for l, s in scores.items():
        keep = max(1, round(len(s) * (1.0 - ratio)))
        order = sorted(range(len(s)), key=lambda u: (-float(s[u]), u))
        out[l] = sorted(order[:keep])
    return out
