"""The benchmark's table rows: one per variant, from its readings, latency, memory and size, with its
ratios to the shipped model; and the notes on what the rows cannot compare (layout-run caps,
vocabularies)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from pipeline.benchmarking import measure
from pipeline.adapters.base import ModelAdapter
from pipeline.benchmarking.variants import Lineup, Variant, layout_run_cap, package_model, vocabulary


def table(lineup: Lineup, adapter: ModelAdapter, reads: dict[str, dict], splits: dict[str, dict[str, dict]],
          latency: dict[str, dict], memory: dict[str, dict], images: Optional[np.ndarray] = None
          ) -> tuple[list[dict], list[str]]:
    """One row per variant of ``lineup`` (its readings of the main split and of each other split, its
    batch-1 latency and peak memory, the patch tokens its encoder kept of ``images``), with its ratios to
    the shipped model; and the notes on what the rows cannot compare. ``adapter``: the torch variants' model."""
    reference = lineup.reference.label
    vocabularies = {v.label: vocabulary(v, adapter) for v in lineup.variants}
    notes = [n for n in (caps_note({v.label: layout_run_cap(v, adapter) for v in lineup.variants}),
                         vocabulary_note(vocabularies, reference)) if n]
    rows = [variant_row(v, reads[v.label], reads[reference], vocabularies[v.label] == vocabularies[reference],
                        latency[v.label], splits, memory.get(v.label, {})) for v in lineup.variants]
    for row, v in zip(rows, lineup.variants):
        row["tokens_kept"] = tokens_kept(v, adapter, images)
    add_ratios(rows)
    return rows, notes


def tokens_kept(v: Variant, adapter: ModelAdapter, images: Optional[np.ndarray]) -> Optional[dict]:
    """Patch tokens a variant's encoder keeps per image of ``images`` (its own count, before a batch tops it
    up): mean, p95, share; None where it reads every token."""
    from pipeline.tokens.policy import stats

    policy = v.package.token_policy if v.package is not None else getattr(adapter, "token_policy", None)
    if policy is None or images is None:
        return None
    return stats([policy.count(policy.ranks(im)) for im in images], policy.num_patches)


def twin_note(reads: dict[str, dict], label: str, twin: str, what: str) -> Optional[str]:
    """A note on whether two variants of one package (``twin``: the same with ``what`` off) read the same
    tokens, formula for formula; None when either is absent."""
    if label not in reads or twin not in reads:
        return None
    a, b = reads[label]["token_ids"], reads[twin]["token_ids"]
    n = min(len(a), len(b))
    same = sum(list(x) == list(y) for x, y in zip(a[:n], b[:n]))
    return (f"{what}: `{label}` and `{twin}` read {same} of {n} formulas token for token alike"
            + ("" if same == n else f" ({n - same} differ: near-ties rounded the other way)"))


def subset_em(reading: dict, n: int) -> float:
    """Exact match of a reading on its first ``n`` formulas (where two readings overlap)."""
    return float(np.mean(reading["exact"][:n])) if n else 0.0


def caps_note(caps: dict[str, int]) -> Optional[str]:
    """A note when the variants decode with different layout-run caps (label -> cap)."""
    if len(set(caps.values())) <= 1:
        return None
    return ("the variants decode with different layout-run caps (package.json: layout_run_cap; "
            "0 = none, a package exported before the cap): "
            + ", ".join(f"{label} {cap}" for label, cap in caps.items()))


def vocabulary_note(vocabulary: dict[str, str], reference_label: str) -> Optional[str]:
    """A note naming the variants whose token ids index another vocabulary than the reference's."""
    other = [label for label, vocab in vocabulary.items() if vocab != vocabulary[reference_label]]
    if not other:
        return None
    return (f"identical tokens: – for {', '.join(other)}, whose decoder speaks another vocabulary "
            f"({vocabulary[other[0]]}) than the reference's ({vocabulary[reference_label]}): their token ids "
            f"cannot be compared")


def variant_row(v: Variant, r: dict, reference: dict, same_vocabulary: bool, latency: dict,
                splits: dict[str, dict[str, dict]], memory: dict) -> dict:
    """One variant's row: its reading ``r`` of the main split, compared with the ``reference`` reading
    on the formulas both read (identical tokens only where the two speak one vocabulary)."""
    both = min(r["n"], reference["n"])
    row = {"label": v.label, "kind": v.kind, "location": v.location, "exact_match": r["exact_match"],
           "cer": r["cer"], "accuracy_n": r["n"], "hit_cap_share": r["hit_cap_share"],
           "steps_per_formula": r["steps_per_formula"], "encoder_ms_per_formula": r["encoder_ms_per_formula"],
           "decoder_ms_per_formula": r["decoder_ms_per_formula"],
           "accuracy_seconds": r["seconds"],
           "identical_tokens": (measure.identical_share(r["token_ids"][:both], reference["token_ids"][:both])
                                if same_vocabulary else None),
           "compared_n": both,
           "exact_match_points_vs_reference": 100 * (subset_em(r, both) - subset_em(reference, both)),
           "images_per_s": r["images_per_s"], "timed_n": r.get("timed_n", r["n"]), "batch_size": r["batch_size"],
           "latency": latency,
           "splits": {name: {"exact_match": r2[v.label]["exact_match"], "cer": r2[v.label]["cer"],
                             "n": r2[v.label]["n"]} for name, r2 in splits.items() if v.label in r2},
           "size_mb": v.size_bytes / 2**20, "peak_mb": memory.get("peak_mb"), "base_mb": memory.get("base_mb")}
    if v.package is not None:
        row["precision"] = v.package.meta.get("precision")
        row["model"] = package_model(Path(v.location))
    return row


def add_ratios(rows: list[dict]) -> None:
    """Each row's ratios to the first (the shipped model): speedup, throughput, size, memory."""
    base = rows[0]
    for row in rows:
        row["ratios"] = {
            "speedup_p50": base["latency"]["p50_ms"] / row["latency"]["p50_ms"],
            "speedup_p95": base["latency"]["p95_ms"] / row["latency"]["p95_ms"],
            "throughput": row["images_per_s"] / base["images_per_s"],
            "size": row["size_mb"] / base["size_mb"],
            "memory": (row["peak_mb"] / base["peak_mb"]) if row["peak_mb"] and base["peak_mb"] else None,
            "exact_match_points_vs_reference": row["exact_match_points_vs_reference"],
        }
