"""Measuring tokenizers side by side on the same normalized formulas.

Each candidate is seen through one small interface (:class:`Candidate`): ids for a formula, the
character span of every content token in the normalized formula, and the decoded text. From it:
tokens per formula (mean, p95), the share of LaTeX commands cut by a token boundary, round-trip
exactness, and encode time per formula, single and batched. The cache is measured on a replay
workload where requests repeat with a Zipf distribution over formulas and come in several spellings.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from tokenizers import Tokenizer

from pipeline.tokenization.atoms import command_spans
from pipeline.tokenization.serving import CachedEncoder


@dataclass
class Candidate:
    name: str
    vocab_size: int
    encode: Callable[[str], list[int]]                    # ids, bos/eos included
    encode_batch: Callable[[list[str]], list]             # many at once (the library's batch call)
    segment: Callable[[str], tuple[list[tuple[int, int]], str]]  # content-token spans, decoded text


def hf_candidate(name: str, tok: Tokenizer) -> Candidate:
    def segment(text: str) -> tuple[list[tuple[int, int]], str]:
        enc = tok.encode(text)
        spans = [o for o, special in zip(enc.offsets, enc.special_tokens_mask) if not special]
        return spans, tok.decode(enc.ids)
    return Candidate(name, tok.get_vocab_size(), lambda s: tok.encode(s).ids,
                     lambda xs: tok.encode_batch(xs), segment)


def char_candidate(name: str, char_tok) -> Candidate:
    """The model's own char-level tokenizer (``latex_ocr_junia.tokenizer.LatexTokenizer``)."""
    def segment(text: str) -> tuple[list[tuple[int, int]], str]:
        ids = char_tok.encode(text)
        return [(i, i + 1) for i in range(len(ids) - 2)], char_tok.decode(ids)
    # it has no batch call: a batch is a loop over formulas
    return Candidate(name, char_tok.vocab_size, char_tok.encode,
                     lambda xs: [char_tok.encode(x) for x in xs], segment)


def split_commands(text: str, spans: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """(commands cut by a token boundary, commands) in ``text`` given its content-token spans."""
    bounds = {s for s, _ in spans} | {e for _, e in spans}
    commands = command_spans(text)
    cut = sum(any(s < b < e for b in bounds) for s, e in commands)
    return cut, len(commands)


def segmentation_metrics(cand: Candidate, texts: Sequence[str],
                         expected: Sequence[str] | None = None, raw: Sequence[str] | None = None) -> dict:
    """Token counts, command integrity and round trip of ``cand`` on normalized ``texts``.

    Round trip: ``decode(encode(raw[i])) == expected[i]`` when given (ours encodes the raw spelling
    and must give back its normalized form), else ``decode(encode(texts[i])) == texts[i]``.
    """
    counts, cut, total, exact, failures = [], 0, 0, 0, []
    for i, text in enumerate(texts):
        spans, decoded = cand.segment(text)
        counts.append(len(spans))
        c, n = split_commands(text, spans)
        cut, total = cut + c, total + n
        if raw is not None:
            _, decoded = cand.segment(raw[i])
        target = expected[i] if expected is not None else text
        if decoded == target:
            exact += 1
        elif len(failures) < 5:
            failures.append({"input": raw[i] if raw is not None else text, "expected": target, "decoded": decoded})
    arr = np.asarray(counts, dtype=float)
    return {
        "n": len(texts),
        "vocab_size": cand.vocab_size,
        "tokens_mean": float(arr.mean()),
        "tokens_p95": float(np.percentile(arr, 95)),
        "tokens_max": int(arr.max()),
        "commands": total,
        "commands_split": cut,
        "commands_split_share": cut / total if total else 0.0,
        "round_trip_exact": exact / len(texts),
        "round_trip_failures": failures,
    }


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)  # the least disturbed run: other processes share these cores


def encode_times(cand: Candidate, texts: Sequence[str], repeats: int = 3) -> dict:
    """Milliseconds per formula: one call per formula, and one batch call for all of them."""
    texts = list(texts)
    single = _best_seconds(lambda: [cand.encode(t) for t in texts], repeats)
    batched = _best_seconds(lambda: cand.encode_batch(texts), repeats)
    return {"single_ms": 1000 * single / len(texts), "batched_ms": 1000 * batched / len(texts)}


def spelling_variants(latex: str) -> list[str]:
    """Ways a client writes the same formula: as is, inline or display math, with other spacing."""
    return [latex, f"${latex}$", f"\\[ {latex} \\]", "  ".join(latex.split(" ")) + " "]


def zipf_workload(formulas: Sequence[str], requests: int, exponent: float, seed: int) -> list[str]:
    """``requests`` formulas drawn with P(rank k) ~ 1/k^exponent over a seeded random ranking of
    ``formulas``, each in one of its spellings chosen at random."""
    rng = random.Random(seed)
    ranking = list(formulas)
    rng.shuffle(ranking)
    weights = [1.0 / (k ** exponent) for k in range(1, len(ranking) + 1)]
    picks = rng.choices(range(len(ranking)), weights=weights, k=requests)
    return [rng.choice(spelling_variants(ranking[i])) for i in picks]


def replay(tok: Tokenizer, workload: Sequence[str], capacity: int, key: str = "normalized",
           time_hits: bool = True) -> dict:
    """Replay ``workload`` through a fresh cache; hit rate and time per request, hit-only time."""
    enc = CachedEncoder(tok, capacity=capacity, key=key)
    t0 = time.perf_counter()
    for latex in workload:
        enc.encode(latex)
    total = time.perf_counter() - t0
    result = {
        "key": key, "capacity": capacity, "requests": len(workload),
        "distinct_requests": len(set(workload)),
        "hits": enc.stats.hits, "misses": enc.stats.misses, "evictions": enc.stats.evictions,
        "hit_rate": enc.stats.hit_rate,
        "ms_per_request": 1000 * total / len(workload),
    }
    if not time_hits:
        return result
    # a second pass over requests that are all in the cache now: the cost of a hit alone
    hot = [w for w in workload[: min(len(workload), 20000)]]
    warm = CachedEncoder(tok, capacity=max(capacity, len(set(hot)) * 4 + 16), key=key)
    for latex in hot:
        warm.encode(latex)
    hits_before = warm.stats.hits
    t1 = time.perf_counter()
    for latex in hot:
        warm.encode(latex)
    hit_seconds = time.perf_counter() - t1
    if warm.stats.hits - hits_before != len(hot):  # the hot pass must be hits only, or it times misses
        raise RuntimeError("hit-only pass had misses")
    result["ms_per_hit"] = 1000 * hit_seconds / len(hot)
    return result
