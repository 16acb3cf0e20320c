"""Variants' paired exact-match changes in one PNG: each ``label=file`` is what ``paired_splits.py --out``
wrote (one JSON line per split); each split's change is drawn with its paired SE, the variants side by
side, the issue's bar (``--bar`` points) dashed. Prints the table it drew.

    python benchmarks/paired_plot.py "floor 384=runs/a.json" "narrowed=runs/b.json" --out docs/results/x.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def rows(path: Path) -> dict[str, dict]:
    """The split -> result lines of one paired_splits output."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("{"):
            r = json.loads(line)
            out[r["split"]] = r
    if not out:
        raise SystemExit(f"error: no paired results in {path}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help="label=paired.json")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--bar", type=float, default=0.5, help="the accuracy bar, points (drawn at minus it)")
    ap.add_argument("--title", default="exact match change against the reference, paired (± 1 SE)")
    args = ap.parse_args(argv)
    variants = []
    for spec in args.variants:
        label, sep, file = spec.partition("=")
        if not sep:
            print(f"error: {spec!r} is not label=paired.json", file=sys.stderr)
            return 2
        variants.append((label, rows(Path(file))))
    splits = sorted({s for _, r in variants for s in r})
    for label, r in variants:
        print(label + ": " + "; ".join(f"{s} {100 * r[s]['exact_match_change']:+.1f} (+{r[s]['gained']}/-{r[s]['lost']}, "
                                        f"SE {100 * r[s]['paired_se']:.1f}, n {r[s]['n']})" for s in splits if s in r))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(variants) + 2), 4))
    width = 0.8 / len(splits)
    for j, split in enumerate(splits):
        xs = [i + (j - (len(splits) - 1) / 2) * width for i, (_, r) in enumerate(variants) if split in r]
        ys = [100 * r[split]["exact_match_change"] for _, r in variants if split in r]
        es = [100 * r[split]["paired_se"] for _, r in variants if split in r]
        ax.bar(xs, ys, width, yerr=es, capsize=3, label=split)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.axhline(-args.bar, color="grey", linestyle="--", linewidth=0.8, label=f"bar (-{args.bar:g})")
    ax.set_xticks(range(len(variants)), [label for label, _ in variants], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("exact match change, points")
    ax.set_title(args.title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
