"""The benchmark's passes over its lineup, one phase each: the batched accuracy pass (the packages side
by side where there are workers for it, then timed again quietly), the other splits, the speculative
check, batch-1 latency, peak memory. :mod:`.measure` measures one variant; this module decides which
variants read which images, and how."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from tqdm import tqdm

from pipeline.benchmarking import measure
from pipeline.benchmarking.variants import Lineup, Variant


@dataclass
class SplitReading:
    """One split's images, their truths, and each variant's reading of them (label -> the dict of
    :func:`.measure.accuracy`; a sharing greedy twin's is its package's, the same object)."""
    images: np.ndarray
    truths: list[str]
    reads: dict[str, dict]


def read_accuracy(lineup: Lineup, images: np.ndarray, truths: list[str], max_length: int, batch_size: int,
                  workers: int, limits: dict[str, Optional[int]],
                  progress: bool) -> tuple[dict[str, dict], list[Variant]]:
    """Exact match, CER and images/s of each variant with a reading of its own, one batched pass each.

    The torch variants (and every variant when ``workers`` is 1) read alone on the machine, the first
    ``limits[kind]`` images (None: all; the torch decoders are slow); the packages read the whole split
    side by side when ``workers`` > 1. Returns the readings and the packages read side by side: their
    timing shared the machine (:func:`time_quietly`)."""
    packages = lineup.packages
    together = packages if workers > 1 and len(packages) > 1 else []
    reads = {}
    bar = tqdm(total=len(lineup.variants), desc="accuracy", disable=not progress)
    for v in lineup.read:
        if v not in together:
            k = min(limits.get(v.kind) or len(truths), len(truths))
            reads[v.label] = measure.accuracy(v, images[:k], truths[:k], max_length, batch_size)
            bar.update()
    if together:
        reads.update(measure.accuracy_parallel(together, images, truths, max_length, batch_size, workers,
                                               bar.update))
    bar.close()
    return reads, together


def time_quietly(variants: list[Variant], reads: dict[str, dict], images: np.ndarray, timing_images: int,
                 max_length: int, batch_size: int) -> int:
    """Replace the timing of readings taken side by side (images/s, encoder / decoder ms per formula)
    with a pass on the first ``timing_images`` images, one variant at a time. Returns the images timed."""
    k = min(timing_images, len(images))
    for v in variants:
        reads[v.label].update(measure.timing(v, images[:k], max_length, batch_size))
    return k


def share_with_twins(reads: dict[str, dict], twins: dict[str, Variant]) -> None:
    """Each of ``twins``' batched reading is its package's (:attr:`Lineup.sharing`: batches decode greedy
    in both)."""
    for label, v in twins.items():
        reads[label] = reads[v.label]


def read_split(lineup: Lineup, name: str, images: np.ndarray, truths: list[str], max_length: int,
               batch_size: int, workers: int, progress: bool) -> SplitReading:
    """The packages' readings of another split (the torch variants read the main split only)."""
    bar = tqdm(total=len(lineup.packages), desc=f"accuracy ({name})", disable=not progress)
    reads = measure.accuracy_parallel(lineup.packages, images, truths, max_length, batch_size, workers, bar.update)
    bar.close()
    share_with_twins(reads, lineup.sharing)
    return SplitReading(images, truths, reads)


def speculative_check(lineup: Lineup, split_images: dict[str, np.ndarray], max_length: int, limit: Optional[int],
                      baseline_label: str, progress: bool) -> dict[str, dict]:
    """Each package with a drafter, speculative against its own plain greedy twin at batch 1, on the
    first ``limit`` images (None: all) of every split; ``baseline_label``'s package, where it is in
    the lineup, read in the same turn. Package label -> its drafter and split -> the figures."""
    out: dict[str, dict] = {}
    plain = {v.label: v for v in lineup.variants}
    baseline = plain.get(baseline_label)
    for label, fast in lineup.twins.items():
        drafter = json.loads((Path(fast.location) / fast.package.meta["drafter"]).read_text())
        out[fast.label] = {"drafter": drafter.get("kind"), "draft_len": drafter.get("draft_len"), "splits": {}}
        for split, imgs in split_images.items():
            k = len(imgs) if limit is None else min(limit, len(imgs))
            bar = tqdm(total=k, desc=f"speculative check {fast.label} ({split})", disable=not progress)
            out[fast.label]["splits"][split] = measure.speculative(
                fast, plain[label], imgs[:k], max_length, baseline if baseline is not fast else None, bar.update)
            bar.close()
    return out


def latency(variants: list[Variant], images: np.ndarray, samples: int, warmup: int, max_length: int,
            progress: bool) -> dict[str, dict]:
    """Batch-1 latency of every variant on the first ``samples`` images after ``warmup`` untimed ones
    (fewer where fewer rendered; one image, repeated, where there are no more than ``warmup``)."""
    need = samples + warmup
    timed = images[:need] if len(images) > warmup else images[:1].repeat(warmup + 1, axis=0)
    bar = tqdm(total=len(timed) - warmup, desc="latency batch 1", disable=not progress)
    out = measure.latency(variants, timed, max_length, warmup, progress=bar.update)
    bar.close()
    return out


def peak_memories(variants: list[Variant], images: np.ndarray, max_length: int, batch_size: int, threads: int,
                  workers: int, progress: bool) -> dict[str, dict]:
    """Peak resident memory of each variant reading ``images``: one fresh process per variant,
    ``workers`` at a time (a process's own peak does not depend on its neighbour)."""
    out = {}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {v.label: pool.submit(measure.peak_memory, v.spec, images, max_length, batch_size, threads)
                   for v in variants}
        for label, future in tqdm(futures.items(), desc="peak memory", disable=not progress):
            out[label] = future.result()
    return out
