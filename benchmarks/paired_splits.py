"""Two ONNX packages read the same whole split, formula by formula: how finely that split resolves the
difference between them (issue 10's tolerances: 1 point of exact match, 5 % relative CER).

Prints, per split: exact match of each, formulas gained / lost, the paired standard error of the
exact-match difference; corpus CER of each, the relative CER change with a paired bootstrap 95 %
interval (formulas resampled together, seeded), and how much of the CER difference comes from
readings that ran to the length cap. Writes the rows as JSON lines.

``--pool``: the variants are runs of one recipe (seeds, say); a last row per split pairs their mean
against the reference, formula by formula (each formula's change averaged over the runs), with its
standard error: what the recipe does, apart from what one run's seed did.

    python benchmarks/paired_splits.py artifacts export-ort_cpu-float-original export-ort_cpu-float-chain \
        --splits eval shift
    python benchmarks/paired_splits.py artifacts export-float-chain export-p-all export-qat-all   # several variants
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.data.render import render_inputs  # noqa: E402
from pipeline.export.runtime import OnnxPackage  # noqa: E402
from pipeline.metrics import edit_distance, normalize  # noqa: E402
from pipeline.context import StageContext  # noqa: E402
from pipeline.quantization.measure import Reading, read  # noqa: E402


def compare(a: Reading, b: Reading, truths, cap: int, resamples: int = 2000, seed: int = 0) -> dict:
    """B against A on the same formulas (the numbers this script prints; tested). Gained / lost and the
    paired SE are :meth:`Reading.paired`'s, the ones the quantize stage reports."""
    n = len(truths)
    ref_len = np.array([len(normalize(t)) for t in truths], float)
    a_edits = np.array([edit_distance(normalize(p), normalize(t)) for p, t in zip(a.texts, truths)], float)
    b_edits = np.array([edit_distance(normalize(p), normalize(t)) for p, t in zip(b.texts, truths)], float)
    paired = b.paired(a)
    cer_a, cer_b = a_edits.sum() / ref_len.sum(), b_edits.sum() / ref_len.sum()
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(resamples, n))
    a_sum, b_sum = a_edits[idx].sum(1), b_edits[idx].sum(1)
    with np.errstate(divide="ignore", invalid="ignore"):  # a resample without A's errors: 0 if B has none too
        ratio = np.where(a_sum > 0, b_sum / np.where(a_sum > 0, a_sum, 1) - 1, np.where(b_sum > 0, np.inf, 0.0))
    capped = (np.asarray(a.steps) >= cap) | (np.asarray(b.steps) >= cap)
    diff = b_edits.sum() - a_edits.sum()
    return {"n": n, "exact_match_a": a.exact_match, "exact_match_b": b.exact_match,
            "exact_match_change": b.exact_match - a.exact_match, "gained": paired["gained"], "lost": paired["lost"],
            "paired_se": paired["loss_se"],
            "cer_a": float(cer_a), "cer_b": float(cer_b), "cer_relative_change": float(cer_b / cer_a - 1) if cer_a else 0.0,
            "cer_change_ci95": [float(np.quantile(ratio, q, method="inverted_cdf")) for q in (0.025, 0.975)],
            "capped_formulas": int(capped.sum()),
            "cer_difference_from_capped": float((b_edits[capped].sum() - a_edits[capped].sum()) / diff) if diff else 0.0}


def pooled(a: Reading, runs: list[Reading]) -> dict:
    """The runs' mean against A, formula by formula: each formula's exact-match change (-1, 0, +1)
    averaged over the runs, then its mean over the formulas and that mean's standard error (tested)."""
    ref = np.asarray(a.exact, float)
    per_formula = np.mean([np.asarray(r.exact, float) - ref for r in runs], axis=0)
    n = len(per_formula)
    var = float(np.mean(per_formula ** 2) - np.mean(per_formula) ** 2) if n else 0.0
    return {"n": n, "runs": len(runs), "exact_match_a": a.exact_match,
            "exact_match_b": float(np.mean([r.exact_match for r in runs])),
            "exact_match_change": float(per_formula.mean()) if n else 0.0,
            "paired_se": float(np.sqrt(max(var, 0.0) / n)) if n else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", type=Path)
    ap.add_argument("a", help="package folder (under artifacts, or a path): the reference")
    ap.add_argument("b", nargs="+", help="package folder(s): the variant(s), each paired against the reference")
    ap.add_argument("--splits", nargs="+", default=["eval", "shift"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8, help="images a call (1: a token policy's own buckets)")
    ap.add_argument("--out", type=Path, default=None, help="JSON lines (default <artifacts>/paired-splits.jsonl)")
    ap.add_argument("--pool", action="store_true", help="the variants are runs of one recipe: one more row per "
                    "split, their mean against the reference")
    args = ap.parse_args()
    ctx = StageContext.compose(args.artifacts.resolve())
    cap = ctx.limits.max_length
    folders = [p if p.is_dir() else args.artifacts / p for p in (Path(args.a), *map(Path, args.b))]
    packages = [OnnxPackage(f, threads=args.threads) for f in folders]
    rows = []
    for split in args.splits:
        items = render_inputs([(f.id, f.latex) for f in ctx.split(split)], packages[0].preprocess, None, False, split)
        images = np.stack([np.asarray(x, np.float32) for _, _, x in items])
        truths = [latex for _, latex, _ in items]
        ra = read(packages[0], None, images, truths, cap, args.batch)
        runs = []
        for b, package in zip(args.b, packages[1:]):
            runs.append(read(package, None, images, truths, cap, args.batch))
            row = {"split": split, "a": args.a, "b": b, **compare(ra, runs[-1], truths, cap - 1)}
            print(json.dumps(row), flush=True)
            rows.append(row)
        if args.pool:
            rows.append({"split": split, "a": args.a, "b": "pooled: " + " ".join(args.b), **pooled(ra, runs)})
            print(json.dumps(rows[-1]), flush=True)
    with (args.out or args.artifacts / "paired-splits.jsonl").open("a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
