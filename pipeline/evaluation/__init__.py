"""Shared evaluation: read a set of (image, truth) pairs with a model adapter and score it.

Used by the evaluate stage and by any stage that reports accuracy (prune, quantize ...), so every
number in every report comes from one implementation.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from pipeline.adapters.base import ModelAdapter
from pipeline.data.render import RenderError, render_formula
from pipeline.metrics import bleu4, corpus_cer, edit_distance, normalize, strip_display


def image_exact_match(pred: str, truth: str) -> bool:
    """im2latex image metric: render both, binarize, crop, drop blank columns, compare pixels.

    Spellings that draw the same (``*`` vs ``\\ast``, ``\\text`` vs ``\\mathrm``) match; the
    display-math wrapper the model emits is stripped first; an unrenderable prediction misses.
    """
    try:
        p = _binary(render_formula(strip_display(pred)))
    except RenderError:
        return False
    t = _binary(render_formula(truth))
    return p.shape == t.shape and bool(np.array_equal(p, t))


def _binary(img: Image.Image) -> np.ndarray:
    ink = np.asarray(img) < 128
    ink = ink[:, ink.any(axis=0)]
    return ink[ink.any(axis=1)]


@dataclass
class EvalItem:
    id: str
    truth: str
    image: torch.Tensor  # preprocessed model input [C, H, W]


def evaluate_items(adapter: ModelAdapter, items: Sequence[EvalItem], max_length: int, batch_size: int,
                   image_match: bool = True, progress: bool = True, desc: str = "decode",
                   use_cache: bool = False) -> dict:
    """Decode ``items`` and return metrics plus per-item predictions.

    ``use_cache``: KV-cached greedy decoding (same tokens as the shipped full-prefix decoder,
    several times faster); the latency figures then describe the cached decoder.
    """
    images = torch.stack([it.image for it in items])
    bar = tqdm(total=len(items), desc=desc, disable=not progress)
    t0 = time.perf_counter()
    with torch.inference_mode():
        result = adapter.generate(images, max_length=max_length, batch_size=batch_size, progress=bar.update,
                                  use_cache=use_cache)
    wall = time.perf_counter() - t0
    bar.close()
    preds, truths = result.texts, [it.truth for it in items]
    rows = []
    img_hits = []
    for it, pred, steps, capped in zip(items, preds, result.steps, result.hit_cap):
        np_, nt = normalize(pred), normalize(it.truth)
        row = {"id": it.id, "truth": it.truth, "pred": pred, "exact": np_ == nt,
               "cer": (edit_distance(np_, nt) / len(nt)) if nt else float(bool(np_)),
               "steps": steps, "hit_cap": capped}
        if image_match:
            row["image_exact"] = bool(row["exact"]) or _safe_image_match(pred, it.truth)
            img_hits.append(row["image_exact"])
        rows.append(row)
    n = len(items)
    metrics = {
        "n": n,
        "exact_match": float(np.mean([r["exact"] for r in rows])) if n else 0.0,
        "image_exact_match": float(np.mean(img_hits)) if img_hits else None,
        "cer": corpus_cer(preds, truths),
        "cer_mean": float(np.mean([r["cer"] for r in rows])) if n else 0.0,
        "bleu": bleu4(preds, truths),
        "hit_cap_share": float(np.mean(result.hit_cap)) if n else 0.0,
        "mean_decode_steps": float(np.mean(result.steps)) if n else 0.0,
        "max_length": max_length,
        "layout_run_cap": int(adapter.layout_run_cap),
        "batch_size": batch_size,
        "kv_cache": use_cache,
        "encoder_ms_per_image": 1000 * result.encoder_seconds / max(n, 1),
        "decoder_ms_per_image": 1000 * result.decoder_seconds / max(n, 1),
        "total_ms_per_image": 1000 * wall / max(n, 1),
    }
    return {"metrics": metrics, "rows": rows}


def _safe_image_match(pred: str, truth: str) -> bool:
    try:
        return image_exact_match(pred, truth)
    except RenderError:
        return False  # the truth itself does not render (user data): no image verdict possible


def latency_batch1(adapter: ModelAdapter, images: torch.Tensor, max_length: int, use_cache: bool = False) -> dict:
    """Per-image latency at batch 1 (what a single request costs), encoder and decoder apart.

    ``use_cache=False`` times the decoder as the model ships it (whole prefix re-run each step)."""
    enc = dec = 0.0
    steps = 0
    with torch.inference_mode():
        for img in images:
            r = adapter.generate(img[None], max_length=max_length, batch_size=1, use_cache=use_cache)
            enc += r.encoder_seconds
            dec += r.decoder_seconds
            steps += r.steps[0]
    n = max(len(images), 1)
    return {"n": len(images), "encoder_ms": 1000 * enc / n, "decoder_ms": 1000 * dec / n,
            "total_ms": 1000 * (enc + dec) / n, "decoder_ms_per_step": 1000 * dec / max(steps, 1)}


def evaluate_sources(adapter: ModelAdapter, loaded: dict, max_length: int, batch_size: int, model: str,
                     image_match: bool, use_cache: bool, progress: bool) -> tuple[dict, list[dict]]:
    """Each source of ``loaded`` ({key: (items, description)}) read and scored: the metrics (the first
    source's at the top level, every source's under ``splits`` when there are several) and the rows."""
    per_split: dict[str, dict] = {}
    rows: list[dict] = []
    for key, (items, source) in loaded.items():
        result = evaluate_items(adapter, items, max_length, batch_size, image_match=image_match, progress=progress,
                                use_cache=use_cache, desc=f"decode {key}")
        per_split[key] = {**result["metrics"], "source": source, "model": model}
        rows += [{"split": key, **r} for r in result["rows"]]
    metrics = dict(per_split[next(iter(loaded))])  # the first split's figures stay at the top level, as before
    if len(per_split) > 1:
        metrics["splits"] = per_split
    return metrics, rows


def latency_of(adapter: ModelAdapter, items: Sequence[EvalItem], max_length: int) -> dict:
    """Batch-1 latency on ``items``, with the shipped decoder and, when the adapter has one, the
    KV-cached one ({} for no items)."""
    if not items:
        return {}
    sample = torch.stack([it.image for it in items])
    out = {"latency_batch1": latency_batch1(adapter, sample, max_length)}
    if adapter.cached_decoder() is not None:
        out["latency_batch1_cached"] = latency_batch1(adapter, sample, max_length, use_cache=True)
    return out
