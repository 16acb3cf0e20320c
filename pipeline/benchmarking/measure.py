"""What the benchmark measures on each variant: accuracy and throughput of one batched pass,
batch-1 latency with images interleaved across variants, concurrent serving, peak memory."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from pipeline.adapters.base import DecodeResult
from pipeline import interrupts
from pipeline.benchmarking.variants import Variant
from pipeline.export.runtime import batch_runs
from pipeline.errors import PipelineError
from pipeline.metrics import corpus_cer, normalize

log = logging.getLogger(__name__)
Decode = Callable[[np.ndarray, int, int], DecodeResult]


def _merge(parts: Sequence[DecodeResult]) -> DecodeResult:
    return DecodeResult(token_ids=[t for p in parts for t in p.token_ids], texts=[t for p in parts for t in p.texts],
                        encoder_seconds=sum(p.encoder_seconds for p in parts),
                        decoder_seconds=sum(p.decoder_seconds for p in parts),
                        steps=[s for p in parts for s in p.steps], hit_cap=[h for p in parts for h in p.hit_cap],
                        calls=[c for p in parts for c in p.calls])


def _decode_chunks(variant: Variant, images: np.ndarray, max_length: int, batch_size: int,
                   chunk: int) -> DecodeResult:
    """``variant.decode`` over ``chunk``-image slices (a multiple of the batch), checking between
    slices for Ctrl-C / SIGTERM: a worker thread never sees the signal itself."""
    chunk = max(batch_size, chunk - chunk % batch_size)
    parts = []
    for start in range(0, len(images), chunk):
        interrupts.check(f"during {variant.label}'s accuracy pass")
        parts.append(variant.decode(images[start:start + chunk], max_length, batch_size))
    return _merge(parts)


def _scored(result: DecodeResult, truths: Sequence[str], seconds: float, batch_size: int) -> dict:
    exact = [normalize(p) == normalize(t) for p, t in zip(result.texts, truths)]
    return {"n": len(truths), "exact_match": float(np.mean(exact)) if exact else 0.0,
            "cer": corpus_cer(result.texts, list(truths)), "images_per_s": len(truths) / seconds,
            "batch_size": batch_size, "seconds": seconds, "token_ids": result.token_ids, "texts": result.texts, "exact": exact,
            "hit_cap_share": float(np.mean(result.hit_cap)) if result.hit_cap else 0.0,
            "steps_per_formula": float(np.mean(result.steps)) if result.steps else 0.0,
            "encoder_ms_per_formula": 1000 * result.encoder_seconds / max(1, len(truths)),
            "decoder_ms_per_formula": 1000 * result.decoder_seconds / max(1, len(truths))}


def accuracy(variant: Variant, images: np.ndarray, truths: Sequence[str], max_length: int,
             batch_size: int, chunk: int = 64) -> dict:
    """One batched greedy pass: exact match, corpus CER, images/s at ``batch_size``, the tokens."""
    t0 = time.perf_counter()
    result = _decode_chunks(variant, images, max_length, batch_size, chunk)
    return _scored(result, truths, time.perf_counter() - t0, batch_size)


def accuracy_parallel(variants: Sequence[Variant], images: np.ndarray, truths: Sequence[str], max_length: int,
                      batch_size: int, workers: int, progress: Callable[[int], None] | None = None) -> dict[str, dict]:
    """:func:`accuracy` of each variant on ``workers`` threads: each variant's images are cut into
    ``workers`` runs of whole batches (the batches a single pass decodes), and the (variant, run) jobs
    share the threads, so three packages keep two cores busy to the end. ONNX Runtime and torch
    release the GIL while they compute; a session serves concurrent runs. Their wall-clock figures
    then share the machine: :func:`timing` measures them again, quietly."""
    workers = max(1, workers)
    runs = batch_runs(len(images), batch_size, workers)
    parts: dict[tuple[str, int], tuple[DecodeResult, float]] = {}

    def job(v: Variant, lo: int, hi: int) -> tuple[DecodeResult, float]:
        t0 = time.perf_counter()
        return _decode_chunks(v, images[lo:hi], max_length, batch_size, 64), time.perf_counter() - t0

    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(job, v, lo, hi): (v.label, lo) for v in variants for lo, hi in runs}
        try:
            for future in as_completed(futures):
                parts[futures[future]] = future.result()
                label = futures[future][0]
                if progress is not None and sum(k[0] == label for k in parts) == len(runs):
                    progress(1)
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    out = {}
    for v in variants:
        mine = [parts[(v.label, lo)] for lo, _ in runs]
        out[v.label] = _scored(_merge([r for r, _ in mine]), truths, sum(t for _, t in mine), batch_size)
    return out


def timing(variant: Variant, images: np.ndarray, max_length: int, batch_size: int) -> dict:
    """A quiet batched pass on ``images`` (nothing else of the benchmark running): images/s and the
    encoder's and decoder's milliseconds per formula."""
    t0 = time.perf_counter()
    result = variant.decode(images, max_length, batch_size)
    seconds = time.perf_counter() - t0
    n = max(1, len(images))
    return {"timed_n": len(images), "images_per_s": len(images) / seconds,
            "encoder_ms_per_formula": 1000 * result.encoder_seconds / n,
            "decoder_ms_per_formula": 1000 * result.decoder_seconds / n}


def speculative(fast: Variant, plain: Variant, images: np.ndarray, max_length: int, baseline: Variant | None = None,
                progress: Callable[[int], None] | None = None) -> dict:
    """A package's speculative readings (batch 1, its drafter) against its plain greedy ones, image by
    image in turn (all see the same load): the share identical, the share identical to greedy decoding
    on the verify graph (:meth:`OnnxPackage.verify_greedy`, read after the timed turn: the readings the
    loop must write, 1 unless it is broken), decoder calls (and the drafter's own) and tokens per formula,
    accepted drafts per verify call, the decoder's and the whole reading's milliseconds per formula
    of each; with ``baseline`` (another package, plain greedy) its end-to-end milliseconds too, read
    in the same turn."""
    stats = fast.package.spec_stats
    before = stats.as_dict()
    turn = [fast, plain] + ([baseline] if baseline is not None else [])
    ms = {v.label: [] for v in turn}
    dec = {v.label: 0.0 for v in turn}
    same, exact, calls, steps = [], [], [], []
    for img in images:
        got = {}
        for v in turn:
            t0 = time.perf_counter()
            got[v.label] = v.decode(img[None], max_length, 1)
            ms[v.label].append(1000 * (time.perf_counter() - t0))
            dec[v.label] += got[v.label].decoder_seconds
        a, b = got[fast.label], got[plain.label]
        same.append(a.token_ids == b.token_ids)
        exact.append(a.token_ids == plain.package.verify_greedy(img[None], max_length).token_ids)
        calls += a.calls
        steps += b.steps
        if progress is not None:
            progress(1)
    after = stats.as_dict()
    verifies = after["verify_calls"] - before["verify_calls"]
    n = max(1, len(images))
    out = {"n": len(images), "identical": float(np.mean(same)) if same else 1.0,
           "identical_verify_greedy": float(np.mean(exact)) if exact else 1.0,
           "calls_per_formula": float(np.mean(calls)) if calls else 0.0,
           "greedy_calls_per_formula": float(np.mean(steps)) if steps else 0.0,
           "accepted_per_verify": (after["accepted"] - before["accepted"]) / max(1, verifies),
           "acceptance": (after["accepted"] - before["accepted"]) / max(1, after["drafted"] - before["drafted"]),
           # a drafter's own decoder calls (the student's), counted apart from the package's
           "drafter_calls_per_formula": (after["drafter_calls"] - before["drafter_calls"]) / n,
           "decoder_ms_per_formula": 1000 * dec[fast.label] / n,
           "greedy_decoder_ms_per_formula": 1000 * dec[plain.label] / n,
           "ms_per_formula": float(np.mean(ms[fast.label])) if images.size else 0.0,
           "greedy_ms_per_formula": float(np.mean(ms[plain.label])) if images.size else 0.0}
    if baseline is not None:
        out.update(baseline=baseline.label, baseline_ms_per_formula=float(np.mean(ms[baseline.label])) if images.size
                   else 0.0, baseline_decoder_ms_per_formula=1000 * dec[baseline.label] / n)
    return out


def identical_share(ids: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> float:
    """Share of images whose greedy tokens equal the reference's (over the images both read)."""
    pairs = list(zip(ids, reference))
    return float(np.mean([list(a) == list(b) for a, b in pairs])) if pairs else 0.0


def _percentiles(seconds: Sequence[float]) -> dict:
    ms = 1000 * np.asarray(seconds, dtype=np.float64)
    return {"n": int(ms.size), "mean_ms": float(ms.mean()), "p50_ms": float(np.percentile(ms, 50)),
            "p95_ms": float(np.percentile(ms, 95)), "max_ms": float(ms.max())}


def latency(variants: Sequence[Variant], images: np.ndarray, max_length: int, warmup: int = 1,
            progress: Callable[[int], None] | None = None) -> dict[str, dict]:
    """Batch-1 end-to-end latency per variant, and the encoder's share of it (``encoder_p50_ms``:
    the median of the encoder's milliseconds in the same reads); each image is read by every variant
    in turn, so all see the same machine load. The first ``warmup`` images are read untimed."""
    if len(images) <= warmup:
        raise PipelineError(f"latency needs more than warmup={warmup} images, got {len(images)}")
    for img in images[:warmup]:
        for v in variants:
            v.decode(img[None], max_length, 1)
    times: dict[str, list[float]] = {v.label: [] for v in variants}
    encoder: dict[str, list[float]] = {v.label: [] for v in variants}
    for img in images[warmup:]:
        for v in variants:
            t0 = time.perf_counter()
            result = v.decode(img[None], max_length, 1)
            times[v.label].append(time.perf_counter() - t0)
            encoder[v.label].append(result.encoder_seconds)
        if progress is not None:
            progress(1)
    return {label: {**_percentiles(t), "encoder_p50_ms": 1000 * float(np.median(encoder[label]))}
            for label, t in times.items()}


def serve(decode: Decode, images: np.ndarray, max_length: int, clients: int = 4, requests: int = 8) -> dict:
    """``clients`` threads, each sending ``requests`` batch-1 requests back to back, against one
    in-process variant (one set of ONNX Runtime sessions shared by the threads)."""
    if clients < 1 or requests < 1:
        raise PipelineError(f"serving needs clients >= 1 and requests >= 1, got {clients} x {requests}")
    if len(images) == 0:
        raise PipelineError("serving needs at least one image")

    start = threading.Barrier(clients)  # every client starts together, each on its own thread: a pool
                                        # thread that finished early never takes a second client's turn

    def client(i: int) -> list[float]:
        start.wait()
        out = []
        for j in range(requests):
            img = images[(i * requests + j) % len(images)]
            t0 = time.perf_counter()
            decode(img[None], max_length, 1)
            out.append(time.perf_counter() - t0)
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        per_client = list(pool.map(client, range(clients)))
    wall = time.perf_counter() - t0
    stats = _percentiles([t for c in per_client for t in c])
    return {"clients": clients, "requests_per_client": requests, **stats, "wall_s": wall,
            "requests_per_s": clients * requests / wall}


def peak_memory(spec: dict, images: np.ndarray, max_length: int, batch_size: int, threads: int,
                timeout: float = 900) -> dict:
    """Peak resident memory of a fresh process that loads the variant and reads ``images``.

    ``base_mb`` is the same process after its imports, before the model is loaded."""
    with tempfile.TemporaryDirectory(prefix="peak-memory-") as tmp:
        path = Path(tmp) / "images.npy"
        np.save(path, images.astype(np.float32, copy=False))
        job = {"spec": spec, "images": str(path), "max_length": max_length, "batch_size": batch_size,
               "threads": threads}
        repo = Path(__file__).resolve().parents[2]
        proc = subprocess.run([sys.executable, "-m", "pipeline.benchmarking.memory", json.dumps(job)],
                              cwd=repo, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise PipelineError(f"peak memory of {spec.get('kind')} {spec.get('folder') or spec.get('source')}: "
                            f"the measuring process failed: {last}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
