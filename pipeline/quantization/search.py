"""The plan search every quantize plan is found by (the encoder's plain graph, its ort_cpu graph, the
ort_cpu decoder): return the most sensitive parts to float, in ranking order, until the exact-match
loss against the float reading is within the budget."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
from tqdm import tqdm

from pipeline.quantization.measure import Reading, loss_against, read, read_or_reject


@dataclass
class SearchReads:
    """The search set as the searches read it: its images and truths through ``readers`` (greedy
    readings), the float model's reading of it, and the budget and chunk a candidate stops early by."""

    readers: object
    images: np.ndarray
    truths: list[str]
    max_length: int
    batch: int
    budget: float
    chunk: int
    float_reading: Optional[Reading] = None

    def read(self, encoder) -> Reading:
        """The whole search set read with ``encoder``."""
        return read(self.readers, encoder, self.images, self.truths, self.max_length, self.batch)

    def candidate(self, encoder) -> Reading:
        """A candidate plan's reading: stopped once clearly over the budget against the float reading."""
        return read_or_reject(self.readers, encoder, self.images, self.truths, self.max_length, self.batch,
                              self.float_reading, self.budget, self.chunk)

    def validate(self, encoder, idx: list[int]) -> tuple[float, list[float]]:
        """Rows ``idx`` of the search set read with ``encoder``: what NNCF's anchor is judged by."""
        r = read(self.readers, encoder, self.images[idx], [self.truths[i] for i in idx], self.max_length, self.batch)
        return r.exact_match, [float(e) for e in r.exact]


@dataclass
class PlanSearch:
    """What a search found: ``float_count`` most sensitive parts returned to float, one trace row per
    candidate read, and each candidate's reading by its count."""

    float_count: int
    trace: list[dict] = field(default_factory=list)
    readings: dict[int, Reading] = field(default_factory=dict)


def search_plan(order: Sequence[str], reading: Callable[[int], Reading], against: Reading, budget: float,
                progress: bool, *, counted: str = "float_groups", identical: bool = False,
                mac_share_of: Optional[Callable[[int], float]] = None) -> PlanSearch:
    """The smallest k such that ``reading(k)`` (``order[:k]`` float, the rest quantized) loses at most
    ``budget`` exact match against ``against`` (:func:`smallest_within`). Each candidate's trace row
    names the count (``counted``), the part last returned, its accuracy, its loss and the paired counts
    of it; ``identical``: also the share of readings identical to ``against``; ``mac_share_of(k)``:
    also the INT8 share of the MatMul MACs."""
    found = PlanSearch(0)

    def loss_with_float(k: int) -> float:
        r = found.readings[k] = reading(k)
        loss = loss_against(r, against)
        found.trace.append({counted: k, "returned": order[k - 1] if k else None, "exact_match": r.exact_match,
                            "cer": r.cer, "loss": loss, "n": len(r.exact),
                            **({"identical": r.identical_to(against)} if identical else {}), **r.paired(against),
                            **({"int8_mac_share": mac_share_of(k)} if mac_share_of else {})})
        return loss

    found.float_count = smallest_within(loss_with_float, len(order), budget, progress)
    return found


def smallest_within(loss_with_float, n: int, budget: float, progress: bool) -> int:
    """Smallest number of most-sensitive groups returned to float whose loss is within ``budget``,
    assuming the loss does not grow as groups return to float (the binary search's assumption).

    A galloping search from the all-INT8 end: k = 0, 1, 2, 4, ... until a candidate is within the
    budget, then a binary search between the last one over it and that one. Under the assumption it
    returns exactly what a binary search over 0..n returns, but a plan usually returns few groups to
    float, and there the candidates it reads are the cheap ones: a candidate clearly over the budget
    stops after its first chunk (:func:`read_or_reject`) while one within it is read whole, and a
    binary search from the middle reads every candidate above the answer whole (on the chain's model:
    four whole readings of 512 formulas for k = 13, 6, 3, 1; galloping: k = 0 stopped, k = 1 whole). Every
    group float is the float model itself (loss 0 by definition): it is never read."""
    bar = tqdm(total=max(1, int(np.ceil(np.log2(n + 1)))), desc="plan search", disable=not progress)
    try:
        if n == 0 or loss_with_float(0) <= budget + 1e-9:
            return 0
        lo, hi = 0, n  # loss(lo) > budget; loss(hi) = 0
        step = 1
        while lo + step < hi:  # gallop: the first within the budget bounds the answer from above
            bar.update()
            if loss_with_float(lo + step) <= budget + 1e-9:
                hi = lo + step
                break
            lo, step = lo + step, step * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            bar.update()
            if loss_with_float(mid) <= budget + 1e-9:
                hi = mid
            else:
                lo = mid
        return hi
    finally:
        bar.close()


def search_chunk(search_chunk: int, workers: int, batch: int) -> int:
    """Formulas a search reading takes at a time before it may stop (a whole number of batches for
    every session set, so each batch is the one a whole reading decodes); 0: read every candidate whole."""
    step = batch * max(1, workers)
    return -(-search_chunk // step) * step if search_chunk else 0


def mac_share(by_name, names) -> float:
    """The share of the encoder's MatMul MACs in the groups ``names`` (``by_name``: every group by name)."""
    total = sum(g.macs for g in by_name.values())
    return sum(by_name[n].macs for n in names) / total if total else 0.0


def json_number(x: float) -> float:
    """A JSON-safe number: +-1e9 for infinities (SNR of an exact match), None-free."""
    if np.isnan(x):
        return float("nan")
    return round(float(x), 4) if np.isfinite(x) else (1e9 if x > 0 else -1e9)
