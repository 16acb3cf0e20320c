"""Head scores: higher means more important. Lowest-scored heads are removed first.

* ``l2_qkv``: L2 norm of the head's rows of the q, k and v projection weights.
* ``l2_qkvo``: the same plus the head's columns of the output projection.
* ``random``: seeded uniform scores, the baseline every criterion must beat.
* ``gradient``: Michel et al. (2019), "Are Sixteen Heads Really Better than One?": the absolute
  gradient of the loss with respect to a per-head gate, summed over rendered formulas.
* ``ablation``: the ground truth: the increase of the teacher-forced loss when that one head
  alone is switched off.

The loss of ``gradient`` and ``ablation`` is the cross-entropy against the original model's own
greedy reading of the rendered formula (:func:`own_predictions`): with the corpus labels, whose
spelling the model often does not reproduce, the per-head loss changes were dominated by formulas
the model misreads anyway and had the wrong sign for heads whose removal ruins exact match.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from pipeline.pruning.heads import head_dim, head_gates, num_heads, projections



@dataclass
class ScoringInput:
    """What a criterion may read. ``images``/``targets`` are produced on first use only (rendering
    and the model's own greedy readings cost minutes; the weight-norm criteria need neither)."""

    adapter: object
    attns: Sequence[nn.Module]
    seed: int
    load_images: Callable[[], tuple[torch.Tensor, list]] = lambda: (torch.zeros(0), [])
    progress: bool = False
    _data: Optional[tuple] = field(default=None, repr=False)
    extra: dict = field(default_factory=dict)  # what a criterion reports besides its scores

    def data(self) -> tuple[torch.Tensor, list]:
        if self._data is None:
            self._data = self.load_images()
        return self._data


@dataclass(frozen=True)
class Criterion:
    """A head-importance criterion (like Torch-Pruning's ``importance`` objects): ``score(inp)``
    returns one score per head per layer, higher = more important. ``needs_data``: it reads
    rendered images and the model's own readings (cached by the prune stage)."""

    name: str
    score: Callable[[ScoringInput], list[list[float]]]
    needs_data: bool = False


CRITERIA: dict[str, Criterion] = {}


def register(criterion: Criterion) -> Criterion:
    """Add a criterion to the registry; ``prune.criterion=<name>`` then selects it."""
    CRITERIA[criterion.name] = criterion
    return criterion


def _ablation(inp: ScoringInput) -> list[list[float]]:
    scores, base = ablation_scores(inp.adapter, inp.attns, *inp.data(), progress=inp.progress)
    inp.extra["baseline_label_loss"] = base
    return scores


def compute(names: Sequence[str], inp: ScoringInput) -> dict[str, list[list[float]]]:
    """The scores of the criteria asked for, and of no other."""
    return {n: CRITERIA[n].score(inp) for n in names}


def l2_scores(attns: Sequence[nn.Module], with_out: bool = False) -> list[list[float]]:
    scores = []
    for attn in attns:
        q, k, v, o = projections(attn)
        d, h = head_dim(attn), num_heads(attn)
        layer = []
        for i in range(h):
            rows = slice(i * d, (i + 1) * d)
            sq = sum(float(m.weight[rows].detach().double().pow(2).sum()) for m in (q, k, v))
            if with_out:
                sq += float(o.weight[:, rows].detach().double().pow(2).sum())
            layer.append(sq ** 0.5)
        scores.append(layer)
    return scores


def random_scores(head_counts: Sequence[int], seed: int) -> list[list[float]]:
    rng = np.random.default_rng(seed)
    return [rng.random(h).tolist() for h in head_counts]


def label_batch(adapter, latex: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forcing inputs and targets (pad-filled) for formulas."""
    return id_batch(adapter, [adapter.encode_text(t) for t in latex])


def id_batch(adapter, ids: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forcing inputs and targets (pad-filled) for token id sequences BOS ... EOS."""
    width = max(len(x) for x in ids) - 1
    inp = torch.full((len(ids), width), adapter.pad_id, dtype=torch.long)
    tgt = torch.full((len(ids), width), adapter.pad_id, dtype=torch.long)
    for r, x in enumerate(ids):
        inp[r, :len(x) - 1] = torch.tensor(x[:-1])
        tgt[r, :len(x) - 1] = torch.tensor(x[1:])
    return inp, tgt


@torch.no_grad()
def own_predictions(adapter, images: torch.Tensor, max_length: int, batch_size: int = 8,
                    use_cache: bool = False, progress=None) -> list[list[int]]:
    """The model's own greedy outputs as targets (BOS ... EOS): a head matters when switching it
    off changes what the model reads, whether or not the reading was right. ``progress(n)`` is
    called after each batch of ``n`` images."""
    result = adapter.generate(images, max_length=max_length, batch_size=batch_size, use_cache=use_cache,
                              progress=progress)
    return [[adapter.bos_id, *ids] for ids in result.token_ids]


def label_loss(adapter, images: torch.Tensor, inp: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    logits = adapter.decode_logits(inp, adapter.encode(images))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1),
                           ignore_index=adapter.pad_id)


def _batches(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def gradient_scores(adapter, attns: Sequence[nn.Module], images: torch.Tensor, targets: Sequence[Sequence[int]],
                    batch_size: int = 4, progress: bool = False) -> list[list[float]]:
    """|dL/dgate| per head, summed over batches (Michel et al.); the model's weights get no grad."""
    model = adapter.model
    was = model.training
    model.eval()
    req = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    gates = [torch.ones(num_heads(a), requires_grad=True) for a in attns]
    total = [torch.zeros(num_heads(a)) for a in attns]
    try:
        with head_gates(attns, gates):
            for sl in tqdm(_batches(len(images), batch_size), desc="head gradients", disable=not progress):
                inp, tgt = id_batch(adapter, targets[sl])
                loss = label_loss(adapter, images[sl], inp, tgt)
                grads = torch.autograd.grad(loss, gates)
                for t, g in zip(total, grads):
                    t += g.abs()
    finally:
        for p, r in zip(model.parameters(), req):
            p.requires_grad_(r)
        model.train(was)
    return [t.tolist() for t in total]


@torch.no_grad()
def ablation_scores(adapter, attns: Sequence[nn.Module], images: torch.Tensor, targets: Sequence[Sequence[int]],
                    batch_size: int = 8, progress: bool = False) -> tuple[list[list[float]], float]:
    """Loss increase when one head alone is off; returns (scores, baseline loss)."""
    adapter.model.eval()
    batches = [(sl, *id_batch(adapter, targets[sl])) for sl in _batches(len(images), batch_size)]

    def loss_with(gates) -> float:
        with head_gates(attns, gates):
            return float(sum(label_loss(adapter, images[sl], i, t) * (sl.stop - sl.start)
                             for sl, i, t in batches)) / len(images)

    ones = [torch.ones(num_heads(a)) for a in attns]
    base = loss_with(ones)
    scores = [[0.0] * num_heads(a) for a in attns]
    total = sum(num_heads(a) for a in attns)
    with tqdm(total=total, desc="single-head ablation", disable=not progress) as bar:
        for layer, attn in enumerate(attns):
            for h in range(num_heads(attn)):
                gates = [g.clone() for g in ones]
                gates[layer][h] = 0.0
                scores[layer][h] = loss_with(gates) - base
                bar.update(1)
    return scores, base


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    def ranks(x):
        x = np.asarray(x, dtype=float)
        order = np.argsort(x, kind="mergesort")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for v in np.unique(x):  # ties share the mean rank
            m = x == v
            r[m] = r[m].mean()
        return r
    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def against_ablation(all_scores: dict) -> dict[str, float]:
    """Each criterion's Spearman correlation with the single-head ablation over every head (empty when
    the ablation was not scored)."""
    if "ablation" not in all_scores:
        return {}

    def flat(scores) -> list[float]:
        return [float(v) for row in scores for v in row]

    return {c: spearman(flat(all_scores[c]), flat(all_scores["ablation"])) for c in all_scores if c != "ablation"}


register(Criterion("l2_qkv", lambda inp: l2_scores(inp.attns)))
register(Criterion("l2_qkvo", lambda inp: l2_scores(inp.attns, with_out=True)))
register(Criterion("random", lambda inp: random_scores([num_heads(a) for a in inp.attns], inp.seed)))
register(Criterion("gradient", lambda inp: gradient_scores(inp.adapter, inp.attns, *inp.data(), progress=inp.progress),
                   needs_data=True))
register(Criterion("ablation", _ablation, needs_data=True))
