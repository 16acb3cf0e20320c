"""Per-group quantization sensitivity: how much each matrix multiply costs in INT8.

Two views per group, both scored against the float graph's output on calibration images:

* ``only``: this group alone in INT8, everything else float — the damage the group does itself;
* ``all_but``: everything in INT8 except this group — what returning it to float buys back.

A metric is an object with one method (``score(ref, out) -> float``, higher = closer) in a small
registry, like Torch-Pruning's importance objects; only the metric asked for is computed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np
from tqdm import tqdm

from pipeline.errors import PipelineError


class Metric(Protocol):
    name: str

    def score(self, ref: np.ndarray, out: np.ndarray) -> float: ...


class SNR:
    """Signal-to-noise ratio in dB of ``out`` against ``ref`` (all images pooled)."""

    name = "snr_db"

    def score(self, ref: np.ndarray, out: np.ndarray) -> float:
        ref = np.asarray(ref, dtype=np.float64)
        noise = float(np.sum((ref - np.asarray(out, dtype=np.float64)) ** 2))
        return float("inf") if noise == 0 else float(10 * np.log10(np.sum(ref ** 2) / noise))


class Cosine:
    """Cosine similarity of the flattened outputs, worst image."""

    name = "cosine"

    def score(self, ref: np.ndarray, out: np.ndarray) -> float:
        worst = 1.0
        for r, o in zip(np.asarray(ref, np.float64), np.asarray(out, np.float64)):
            d = float(np.linalg.norm(r) * np.linalg.norm(o))
            worst = min(worst, float(np.dot(r.ravel(), o.ravel()) / d) if d else 1.0)
        return worst


METRICS: dict[str, Callable[[], Metric]] = {"snr_db": SNR, "cosine": Cosine}


def metric(name: str) -> Metric:
    if name not in METRICS:
        raise PipelineError(f"unknown sensitivity metric {name!r}; known: {', '.join(METRICS)}")
    return METRICS[name]()


@dataclass
class GroupSensitivity:
    group: str
    only: float        # score with only this group in INT8
    all_but: float     # score with every group but this one in INT8
    gain: float        # all_but - score(all INT8): what returning this group to float buys


def measure(groups: Sequence[str], run_with: Callable[[Sequence[str]], np.ndarray], ref: np.ndarray,
            score: Metric, progress: bool = True) -> tuple[float, list[GroupSensitivity]]:
    """``run_with(int8_groups)`` runs the graph with those groups in INT8 and returns its output on
    the calibration images. Returns the all-INT8 score and one record per group (input order)."""
    everything = score.score(ref, run_with(list(groups)))
    rows = []
    for g in tqdm(groups, desc="sensitivity", disable=not progress):
        only = score.score(ref, run_with([g]))
        all_but = score.score(ref, run_with([x for x in groups if x != g]))
        rows.append(GroupSensitivity(g, only, all_but, all_but - everything))
    return everything, rows


def ranking(rows: Sequence[GroupSensitivity]) -> list[GroupSensitivity]:
    """Most sensitive first: the worst score alone in INT8, then the largest gain when returned to
    float. (``only`` leads: when several groups are each ruinous, all-but-one stays ruined for every
    one of them and the gains say nothing.)"""
    return sorted(rows, key=lambda r: (_finite(r.only), -_finite(r.gain), r.group))


def _finite(x: float) -> float:
    return 1e9 if x == float("inf") else (-1e9 if x == float("-inf") else x)
