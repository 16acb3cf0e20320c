"""Scoring a quantized encoder the way a user meets it: greedy decoding with the package's float
decoder (ONNX Runtime), exact match and CER against the truth, identical tokens vs float."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from pipeline import interrupts
from pipeline.adapters.base import DecodeResult
from pipeline.export.runtime import OnnxPackage, batch_runs
from pipeline.metrics import corpus_cer, normalize
from pipeline.names import ENCODER


@dataclass
class Reading:
    """One variant's greedy readings of a fixed image set."""

    token_ids: list[list[int]]
    texts: list[str]
    exact: list[bool]
    cer: float
    steps: list[int] = field(default_factory=list)

    @property
    def exact_match(self) -> float:
        return float(np.mean(self.exact)) if self.exact else 0.0

    def identical_to(self, other: "Reading") -> float:
        return float(np.mean([a == b for a, b in zip(self.token_ids, other.token_ids)])) if self.token_ids else 0.0

    def paired(self, reference: "Reading") -> dict[str, float]:
        """Against ``reference`` on the same images: formulas this reading gets right and it does not
        (``gained``), the reverse (``lost``), and the standard error of the exact-match difference
        (``loss_se``, a share): how finely these images resolve a loss."""
        n = len(self.exact)
        gained = sum(a and not b for a, b in zip(self.exact, reference.exact))
        lost = sum(b and not a for a, b in zip(self.exact, reference.exact))
        var = (gained + lost) / n - ((gained - lost) / n) ** 2 if n else 0.0
        return {"gained": gained, "lost": lost, "loss_se": float(np.sqrt(max(var, 0.0) / n)) if n else 0.0}


def read(package: OnnxPackage | Sequence[OnnxPackage], encoder: Path | None, images: np.ndarray,
         truths: Sequence[str], max_length: int, batch_size: int) -> Reading:
    """Decode ``images`` with ``encoder`` (None: the package's own) and the package's decoder.

    Several packages (session sets of the same graphs): the images are cut into as many runs of whole
    batches, read side by side in threads (ONNX Runtime releases the GIL), so every batch is the one
    a single package would have decoded."""
    packages = [package] if isinstance(package, OnnxPackage) else list(package)
    if encoder is not None:
        for pkg in packages:
            pkg.use_graph(ENCODER, encoder)
    cuts = batch_runs(len(images), batch_size, len(packages))
    if len(cuts) == 1:
        parts = [packages[0].generate(images, max_length=max_length, batch_size=batch_size)]
    else:
        def stop(_: int) -> None:  # a worker thread never sees Ctrl-C / SIGTERM: it checks after each batch
            interrupts.check("while reading a quantized variant")

        with ThreadPoolExecutor(max_workers=len(cuts)) as pool:
            parts = list(pool.map(lambda job: job[0].generate(images[job[1][0]:job[1][1]], max_length=max_length,
                                                               batch_size=batch_size, progress=stop),
                                  zip(packages, cuts)))
    result = DecodeResult(token_ids=[t for p in parts for t in p.token_ids], texts=[t for p in parts for t in p.texts],
                          steps=[n for p in parts for n in p.steps])
    exact = [normalize(p) == normalize(t) for p, t in zip(result.texts, truths)]
    return Reading(result.token_ids, result.texts, exact, corpus_cer(result.texts, list(truths)), result.steps)


def loss_against(reading: Reading, reference: Reading) -> float:
    """Exact-match loss of ``reading`` against ``reference`` on the rows ``reading`` holds (the first
    ``len(reading.exact)`` of the reference's: a reading stopped early by :func:`read_or_reject`)."""
    n = len(reading.exact)
    return float(np.mean(reference.exact[:n])) - reading.exact_match if n else 0.0


def read_or_reject(package: OnnxPackage | Sequence[OnnxPackage], encoder: Path | None, images: np.ndarray,
                   truths: Sequence[str], max_length: int, batch_size: int, reference: Reading, budget: float,
                   chunk: int, z: float = 3.0) -> Reading:
    """:func:`read` in chunks of ``chunk`` formulas (a multiple of the batch times the session sets, so
    every batch is the one a whole reading decodes), stopping once the candidate is clearly over the
    exact-match loss ``budget`` against ``reference`` (the same rows): its loss minus ``z`` paired
    standard errors above the budget. A candidate within the budget, or near it, is read whole, so
    the search's decision is the one the whole set gives wherever it could go either way; a clearly
    bad plan (tens of points lost) stops after the first chunk. The returned reading holds the rows
    read (``len(reading.exact)``)."""
    n = len(images)
    if chunk <= 0 or chunk >= n:
        return read(package, encoder, images, truths, max_length, batch_size)
    parts: list[Reading] = []
    for start in range(0, n, chunk):
        parts.append(read(package, encoder, images[start:start + chunk], truths[start:start + chunk], max_length,
                          batch_size))
        r = _joined(parts, truths)
        if len(r.exact) < n and loss_against(r, reference) - z * r.paired(reference)["loss_se"] > budget:
            break
    return r


def _joined(parts: Sequence[Reading], truths: Sequence[str]) -> Reading:
    texts = [t for p in parts for t in p.texts]
    return Reading([t for p in parts for t in p.token_ids], texts, [e for p in parts for e in p.exact],
                   corpus_cer(texts, list(truths[:len(texts)])), [s for p in parts for s in p.steps])


def encoder_outputs(package: OnnxPackage, encoder: Path, images: np.ndarray, batch_size: int = 8) -> np.ndarray:
    """``encoder``'s memory of ``images`` in batches; with a token policy every image at one count (the
    set's largest, each row topped up with its own patches), so the batches' memories stack."""
    package.use_graph(ENCODER, encoder)
    policy = package.token_policy
    keep = policy.keep_batch(images) if policy is not None else None
    return np.concatenate([package.encode(images[i:i + batch_size], None if keep is None else keep[i:i + batch_size])
                           for i in range(0, len(images), batch_size)])


def latency(packages: dict[str, tuple[OnnxPackage, Path | None]], images: np.ndarray, max_length: int,
            warmup: int = 1) -> dict[str, dict[str, float]]:
    """Batch-1 latency per variant, images interleaved across variants so all see the same load.

    ``packages`` maps a variant to (a package opened with its own sessions, encoder path or None)."""
    for pkg, enc in packages.values():
        if enc is not None:
            pkg.use_graph(ENCODER, enc)
        for img in images[:warmup]:
            pkg.generate(img[None], max_length=max_length, batch_size=1)
    acc = {k: {"encoder_s": 0.0, "decoder_s": 0.0, "total_s": 0.0, "steps": 0} for k in packages}
    for img in images[warmup:]:
        for name, (pkg, _) in packages.items():
            t0 = time.perf_counter()
            r = pkg.generate(img[None], max_length=max_length, batch_size=1)
            acc[name]["total_s"] += time.perf_counter() - t0
            acc[name]["encoder_s"] += r.encoder_seconds
            acc[name]["decoder_s"] += r.decoder_seconds
            acc[name]["steps"] += r.steps[0]
    n = max(1, len(images) - warmup)
    return {k: {"encoder_ms": 1000 * v["encoder_s"] / n, "decoder_ms": 1000 * v["decoder_s"] / n,
                "total_ms": 1000 * v["total_s"] / n,
                "decoder_ms_per_step": 1000 * v["decoder_s"] / max(1, v["steps"]), "n": n}
            for k, v in acc.items()}
