"""Token policies compared on whole splits: one package whose encoder reads kept tokens, read under
several policies, each paired formula by formula against a reference package (today's model, all
tokens). Per policy and split: tokens kept (mean, p95; the policy's count per image, and what the
encoder read once a batch tops its rows up to the batch's bucket), exact match, CER, gained / lost,
the paired SE; per policy the encoder's p50 ms (batch 1, one thread, the first --timing-n eval
images). Writes <out>.jsonl, <out>.md and <out>.png (tokens kept against exact match).

A policy is ``name:key=value,...`` over ``package.json: token_policy``'s fields (``buckets`` as
``128/256/1024``; ``all`` keeps every token):

    python benchmarks/token_policies.py artifacts today-float tokens-float \\
        default: dilate2:dilate=2 stride2:frame_stride=2 all:all --out artifacts/token-policies
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from paired_splits import compare  # noqa: E402
from pipeline.context import StageContext  # noqa: E402
from pipeline.data.render import render_inputs  # noqa: E402
from pipeline.export.runtime import OnnxPackage  # noqa: E402
from pipeline.errors import PipelineError  # noqa: E402
from pipeline.files import find_package  # noqa: E402
from pipeline.quantization.measure import read  # noqa: E402
from pipeline.tokens.policy import TokenPolicy, stats  # noqa: E402


def parse_policy(spec: str, base: TokenPolicy) -> tuple[str, TokenPolicy]:
    """``name:key=value,...`` applied to ``base``; ``name:all`` keeps every patch (one bucket, all)."""
    name, _, body = spec.partition(":")
    if body == "all":
        return name, dataclasses.replace(base, buckets=(base.num_patches,))
    changes = {}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        if key not in {f.name for f in dataclasses.fields(TokenPolicy)} - {"grid_h", "grid_w", "patch", "kind"}:
            raise SystemExit(f"error: policy {spec!r}: {key!r} is not a token policy field")
        changes[key] = tuple(int(v) for v in value.split("/")) if key == "buckets" else type(getattr(base, key))(value)
    return name, dataclasses.replace(base, **changes)


def encoder_ms(package: OnnxPackage, images: np.ndarray) -> float:
    times = []
    for image in images:
        package.encode(image[None])  # warm
        t0 = time.perf_counter()
        package.encode(image[None])
        times.append(1000 * (time.perf_counter() - t0))
    return float(np.median(times))


def plot(rows: list[dict], reference: dict[str, float], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for split, marker in (("eval", "o"), ("shift", "s")):
        pts = [r for r in rows if r["split"] == split]
        ax.scatter([r["tokens_read_mean"] for r in pts], [r["exact_match_b"] for r in pts], marker=marker, label=split)
        for r in pts:
            ax.annotate(r["policy"], (r["tokens_read_mean"], r["exact_match_b"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        if split in reference:
            ax.axhline(reference[split], ls="--", lw=0.8, color="C0" if split == "eval" else "C1")
            ax.axhspan(reference[split] - 0.005, reference[split] + 0.005, alpha=0.12,
                       color="C0" if split == "eval" else "C1")
    ax.set_xlabel("tokens the encoder read per image (mean)")
    ax.set_ylabel("exact match")
    ax.set_title("Token policies against today's model (dashed: all tokens; band: 0.5 points)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", type=Path)
    ap.add_argument("reference", help="package read with all tokens (under artifacts, or a path)")
    ap.add_argument("package", help="package with a token policy (under artifacts, or a path)")
    ap.add_argument("policies", nargs="+", help="name:key=value,... ('name:' the package's own policy)")
    ap.add_argument("--splits", nargs="+", default=["eval", "shift"])
    ap.add_argument("--limit", type=int, default=None, help="the first N formulas of each split (default: all)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--timing-n", type=int, default=32)
    ap.add_argument("--out", type=Path, required=True, help="path stem: <out>.jsonl, <out>.md, <out>.png")
    args = ap.parse_args(argv)
    try:
        folders = [find_package(args.reference, args.artifacts, "reference"),
                   find_package(args.package, args.artifacts, "package")]
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ref, pkg = (OnnxPackage(f, threads=1) for f in folders)
    if pkg.token_policy is None:
        print(f"error: {args.package} has no token policy (package.json: token_policy)", file=sys.stderr)
        return 2
    base = pkg.token_policy
    policies = [parse_policy(s, base) for s in args.policies]
    ctx = StageContext.compose(args.artifacts.resolve())
    cap = ctx.limits.max_length
    rows, reference = [], {}
    timing = None
    for split in args.splits:
        formulas = ctx.split(split)[:args.limit]
        items = render_inputs([(f.id, f.latex) for f in formulas], pkg.preprocess, None, False, split)
        images = np.stack([np.asarray(x, np.float32) for _, _, x in items])
        truths = [latex for _, latex, _ in items]
        if timing is None:
            timing = images[:args.timing_n]
        ra = read(ref, None, images, truths, cap, args.batch)
        reference[split] = ra.exact_match
        for name, policy in policies:
            pkg.token_policy = policy
            pkg.tokens_kept.clear()
            rb = read(pkg, None, images, truths, cap, args.batch)
            own = stats([policy.count(policy.ranks(im)) for im in images], policy.num_patches)
            read_counts = [k for k, n in pkg.tokens_kept.items() for _ in range(n)]
            row = {"policy": name, "split": split, "token_policy": policy.to_dict(),
                   "tokens_kept_mean": own["mean"], "tokens_kept_p95": own["p95"],
                   "tokens_read_mean": float(np.mean(read_counts)), **compare(ra, rb, truths, cap - 1)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    ms = {"reference": encoder_ms(ref, timing)}
    for name, policy in policies:
        pkg.token_policy = policy
        ms[name] = encoder_ms(pkg, timing)
    for row in rows:
        row["encoder_ms"], row["reference_encoder_ms"] = ms[row["policy"]], ms["reference"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".jsonl"), "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    plot(rows, reference, args.out.with_suffix(".png"))
    lines = [f"Reference `{args.reference}` (all tokens) against `{args.package}` under each policy; batch "
             f"{args.batch}; encoder p50 at batch 1, one thread, {len(timing)} eval images "
             f"(reference {ms['reference']:.1f} ms).", "",
             "| policy | split | n | tokens kept mean / p95 | tokens read mean | exact match (ref → policy) | "
             "change (points) | gained / lost | paired SE | CER change | encoder ms (×) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['split']} | {r['n']} | {r['tokens_kept_mean']:.0f} / "
                     f"{r['tokens_kept_p95']:.0f} | {r['tokens_read_mean']:.0f} | {r['exact_match_a']:.3f} → "
                     f"{r['exact_match_b']:.3f} | {100 * r['exact_match_change']:+.1f} | {r['gained']} / {r['lost']} | "
                     f"{100 * r['paired_se']:.1f} | {100 * r['cer_relative_change']:+.1f} % | {r['encoder_ms']:.1f} "
                     f"({ms['reference'] / r['encoder_ms']:.2f}×) |")
    lines += ["", f"![tokens kept against exact match]({args.out.with_suffix('.png').name})", ""]
    args.out.with_suffix(".md").write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
