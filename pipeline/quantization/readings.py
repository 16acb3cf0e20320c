"""A model's own greedy readings of a set of images, as finetune targets (prune's sequence-level
recovery, quantize's QAT), kept under ``<artifacts>/cache/`` keyed by the model, the images and the
decoding settings: they depend on nothing else, so a rerun with other finetune settings, or a later
stage with the same teacher and images, reads them back instead of decoding again.

Two readers (:data:`READERS`): ``onnxruntime``, the model's float ONNX Runtime package made for the
purpose (export's own graph code, greedy with the same layout-run cap; on 2 cores about 5x faster
than torch's KV-cached loop, 0.12 against 0.63 s an image), and ``torch``, the adapter's KV-cached
greedy loop. Export's parity check holds the float package token-identical to torch; a reading's
rare tie-break difference changes a target, not the method.
"""
from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)
READERS = ("onnxruntime", "torch")
READINGS_FILE = "readings.json"


def images_hash(images: torch.Tensor | np.ndarray) -> str:
    array = images.numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
    return hashlib.sha256(np.ascontiguousarray(array, dtype=np.float32).tobytes()).hexdigest()


def greedy_readings(ctx, adapter, model_key: str, images: torch.Tensor | np.ndarray, reader: str = "onnxruntime",
                    workers: int = 2, what: str = "teacher", packages=None) -> tuple[list[list[int]], dict]:
    """``adapter``'s greedy token ids of ``images`` (no BOS; as the adapter's ``generate`` returns
    them), and a report ({reader, seconds, cached}). ``model_key`` identifies the weights
    (``ctx.model_hash``, plus any change made to them in memory). ``packages``: session sets of that
    model's float package the caller has open already (read through them instead of exporting one)."""
    if reader not in READERS:
        raise ValueError(f"reader must be one of {', '.join(READERS)}, got {reader!r}")
    max_length, batch, threads = ctx.limits.max_length, ctx.limits.batch_size, ctx.limits.threads
    config = {"reader": reader, "max_length": max_length, "batch_size": batch, **ctx.decoding_key()}
    inputs = {"model": model_key, "images": images_hash(images)}
    key = hashlib.sha256(json.dumps([config, inputs], sort_keys=True).encode()).hexdigest()[:16]
    with ctx.cache_output(f"readings-{key}", config, inputs) as out:
        if out.reused:
            ids = json.loads((out.path / READINGS_FILE).read_text())
            log.info(f"[readings] {what}: {len(ids)} greedy readings reused from {out.path}")
            return ids, {"reader": reader, "seconds": 0.0, "cached": True}
        started = time.perf_counter()
        log.info(f"[readings] {what}: greedy readings of {len(images)} images ({reader})")
        ids = _read(adapter, model_key, images, reader, max_length, batch, threads, workers, packages)
        (out.path / READINGS_FILE).write_text(json.dumps(ids))
        seconds = round(time.perf_counter() - started, 1)
        out.metrics.update({"images": len(ids), "seconds": seconds})
    return ids, {"reader": reader, "seconds": seconds, "cached": False}


def _read(adapter, model_key: str, images, reader: str, max_length: int, batch: int, threads: int, workers: int,
          packages) -> list[list[int]]:
    if reader == "torch":
        from pipeline.pruning.scores import own_predictions

        x = images if isinstance(images, torch.Tensor) else torch.from_numpy(np.asarray(images))
        return [ids[1:] for ids in own_predictions(adapter, x, max_length, batch, use_cache=True)]
    from pipeline.quantization.graphs import float_graphs
    from pipeline.quantization.measure import read

    x = (images.numpy() if isinstance(images, torch.Tensor) else np.asarray(images)).astype(np.float32)
    if packages is not None:
        return [list(map(int, ids)) for ids in read(packages, None, x, [""] * len(x), max_length, batch).token_ids]
    with tempfile.TemporaryDirectory(prefix="readings-") as tmp:
        graphs = float_graphs(adapter, Path(tmp), max_length, model_key, threads=threads)
        readers = graphs.open_readers(threads, workers)
        reading = read(readers, None, x, [""] * len(x), max_length, batch)
        del readers, graphs  # the sessions hold the graph files open
    return [list(map(int, ids)) for ids in reading.token_ids]


def with_bos(adapter, ids: Sequence[Sequence[int]]) -> list[list[int]]:
    """Teacher-forcing targets: BOS, then the reading."""
    return [[adapter.bos_id, *r] for r in ids]
