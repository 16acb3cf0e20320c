"""Parity of an exported package against the torch model it came from.

Tensors: encoder memory, first-step logits and cached-step logits (teacher-forced on the true
tokens, so every step is compared on the same prefix) - max-abs error, cosine, SNR in dB.
Tokens: greedy decoding with both, on the eval split - identical sequences, token agreement,
exact match against the truth.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np
import torch
from tqdm import tqdm

from pipeline.errors import PipelineError
from pipeline.metrics import normalize
from pipeline.names import DECODER_FIRST, DECODER_STEP, DECODER_VERIFY, ENCODER


def compare(ref: np.ndarray, out: np.ndarray) -> dict[str, float]:
    ref = np.asarray(ref, dtype=np.float64).ravel()
    out = np.asarray(out, dtype=np.float64).ravel()
    if ref.shape != out.shape:
        raise PipelineError(f"shape mismatch: torch {ref.shape} vs onnx {out.shape}")
    err = ref - out
    noise = float(np.sum(err ** 2))
    denom = float(np.linalg.norm(ref) * np.linalg.norm(out))
    return {
        "max_abs": float(np.max(np.abs(err))) if err.size else 0.0,
        "cosine": float(np.dot(ref, out) / denom) if denom else float(noise == 0.0),
        "snr_db": float(10 * np.log10(np.sum(ref ** 2) / noise)) if noise > 0 else float("inf"),
    }


def _merge(parts: list[dict[str, float]]) -> dict[str, float]:
    """Worst case over images: largest error, lowest cosine and SNR."""
    return {"max_abs": max(p["max_abs"] for p in parts), "cosine": min(p["cosine"] for p in parts),
            "snr_db": min(p["snr_db"] for p in parts), "n": len(parts)}


@torch.no_grad()
def tensor_parity(adapter, package, images: torch.Tensor, token_ids: Sequence[Sequence[int]]) -> dict[str, dict]:
    """Per output, worst case over ``images``; ``token_ids`` are the teacher-forced targets (BOS..EOS)."""
    mem_parts, first_parts, step_parts, verify_parts = [], [], [], []
    has_verify = DECODER_VERIFY in package.meta["graphs"]
    for img, ids in zip(images, token_ids):
        ids = list(ids)[: max(2, package.max_length)]
        memory_t = adapter.encode(img[None])
        memory_o = package.encode(img[None].numpy())
        mem_parts.append(compare(memory_t.numpy(), memory_o))
        logits_t = adapter.decode_logits(torch.tensor([ids]), memory_t)[0].float().numpy()  # [T, V]
        # the ONNX decoder reads the torch memory, so the logits compare the decoder alone
        lo, past, cross = package.first(np.array([[ids[0]]]), memory_t.numpy())
        first_parts.append(compare(logits_t[0], lo[0]))
        steps = []
        for t in range(1, len(ids)):
            lo, past = package.step(np.array([[ids[t]]]), past, cross)
            steps.append(lo[0])
        if steps:
            step_parts.append(compare(logits_t[1:len(ids)], np.stack(steps)))
        if has_verify and len(ids) > 1:  # the same tokens a verify call's width at a time after the first
            lo, past, cross = package.first(np.array([[ids[0]]]), memory_t.numpy())
            chunks = []
            width = package.verify_width
            for t in range(1, len(ids), width):
                lo, present = package.verify(np.array([ids[t:t + width]]), past, cross)
                chunks.append(lo[0])
                past = [p[:, :, :past[0].shape[2] + lo.shape[1]] for p in present]  # a padded call's extra K/V off
            verify_parts.append(compare(logits_t[1:len(ids)], np.concatenate(chunks)))
    result = {f"{ENCODER}.memory": _merge(mem_parts), f"{DECODER_FIRST}.logits": _merge(first_parts)}
    if step_parts:
        result[f"{DECODER_STEP}.logits"] = _merge(step_parts)
    if verify_parts:
        result[f"{DECODER_VERIFY}.logits"] = _merge(verify_parts)
    return result



@dataclass
class TokenParity:
    n: int
    identical: float          # share of formulas whose token sequences are identical
    token_agreement: float    # share of positions (up to the longer sequence) with the same token
    exact_match_torch: float
    exact_match_onnx: float
    rows: list[dict]
    reference: Any = None     # torch's DecodeResult (reused by the next target of the same model)
    package_ids: list = None  # the package's greedy token ids, row by row

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("rows", "reference", "package_ids")}


def token_parity(adapter, package, images: torch.Tensor, truths: Sequence[str], ids: Sequence[str],
                 max_length: int, batch_size: int, progress: bool = True, reference=None) -> TokenParity:
    """Greedy tokens of torch and of the package on the same images. ``reference``: torch's reading
    of these images already made (the same model for several targets), else it is decoded here, with
    the adapter's KV-cached decoder where it has one (the shipped decoder's tokens, tested, at a
    third of its time: it re-runs the whole prefix every step)."""
    bar = tqdm(total=(1 if reference is None else 0) * len(images) + len(images), desc="parity decode (torch, onnx)",
               disable=not progress)
    if reference is None:
        with torch.inference_mode():
            reference = adapter.generate(images, max_length=max_length, batch_size=batch_size, progress=bar.update,
                                         use_cache=adapter.cached_decoder() is not None)
    ref = reference
    got = package.generate(images.numpy(), max_length=max_length, batch_size=batch_size, progress=bar.update)
    bar.close()
    rows, same, agree, total = [], 0, 0, 0
    for fid, truth, a, b, ta, tb in zip(ids, truths, ref.token_ids, got.token_ids, ref.texts, got.texts):
        length = max(len(a), len(b))
        match = sum(x == y for x, y in zip(a, b))
        agree += match
        total += length
        same += a == b
        rows.append({"id": fid, "truth": truth, "torch": ta, "onnx": tb, "identical": a == b,
                     "exact_torch": normalize(ta) == normalize(truth), "exact_onnx": normalize(tb) == normalize(truth)})
    n = len(rows)
    return TokenParity(n=n, identical=same / max(n, 1), token_agreement=agree / max(total, 1), reference=ref,
                       package_ids=[list(map(int, ids)) for ids in got.token_ids],
                       exact_match_torch=float(np.mean([r["exact_torch"] for r in rows])) if n else 0.0,
                       exact_match_onnx=float(np.mean([r["exact_onnx"] for r in rows])) if n else 0.0, rows=rows)


# a package whose encoder was finetuned quantization-aware (stage quantize, ``quantize.qat_steps``) no
# longer holds the torch model's weights, so its greedy readings may differ from torch's on more
# formulas than ``min_identical`` allows without reading any worse: it passes the token check when it
# reads at most this share of the parity formulas fewer right than torch does (its tensor checks stay)
FINETUNED_MAX_EXACT_LOSS = 0.05


def check_tolerances(tensors: dict[str, dict], tokens: TokenParity | None, min_cosine: float, min_snr_db: float,
                     min_identical: float, finetuned: bool = False) -> list[str]:
    """Every output beyond tolerance, named. ``finetuned``: the package's encoder was finetuned
    quantization-aware (see :data:`FINETUNED_MAX_EXACT_LOSS`)."""
    bad = []
    for name, s in tensors.items():
        if not s["cosine"] >= min_cosine:
            bad.append(f"{name}: cosine {s['cosine']:.6f} < {min_cosine}")
        if not s["snr_db"] >= min_snr_db:
            bad.append(f"{name}: SNR {s['snr_db']:.1f} dB < {min_snr_db} dB")
    if tokens is not None and not tokens.identical >= min_identical:
        loss = tokens.exact_match_torch - tokens.exact_match_onnx
        if not finetuned:
            bad.append(f"greedy tokens: identical on {tokens.identical:.3f} of {tokens.n} formulas < {min_identical}")
        elif not loss <= FINETUNED_MAX_EXACT_LOSS + 1e-9:
            bad.append(f"greedy tokens: identical on {tokens.identical:.3f} of {tokens.n} formulas < {min_identical}, "
                       f"and the quantization-aware finetuned package reads {loss:.3f} fewer right than torch "
                       f"({tokens.exact_match_onnx:.3f} against {tokens.exact_match_torch:.3f}) > "
                       f"{FINETUNED_MAX_EXACT_LOSS}")
    return bad


def reused_reference(references: dict, key: tuple):
    """Torch's parity reading for ``key`` (model, formula ids, cap, batch) when this run made it, or
    the first rows of a longer one of the same model that starts with the same formulas in whole
    batches (each batch is decoded on its own, so its rows are the same); else None."""
    if key in references:
        return references[key]
    model, ids, cap, batch = key
    if len(ids) % batch:
        return None
    for (m, longer, c, b), ref in references.items():
        if (m, c, b) == (model, cap, batch) and longer[:len(ids)] == ids:
            n = len(ids)
            return replace(ref, token_ids=ref.token_ids[:n], texts=ref.texts[:n], steps=ref.steps[:n],
                           hit_cap=ref.hit_cap[:n])
    return None
