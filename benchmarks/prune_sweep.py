"""Collect a prune sweep (Hydra multirun, one artifact folder per job) into a table and a PNG curve.

    python -m pipeline -m stage=prune prune.criterion=l2_qkv,ablation prune.num_heads=4,8,12 \
        prune.eval_limit=30 model.threads=1 artifacts.dir=artifacts
    python benchmarks/prune_sweep.py artifacts            # -> artifacts/prune-sweep/{report.md,sweep.png}

Best point: the most heads removed whose exact match after recovery is within ``--tolerance``
(default 0.01 = 1.0 point) of the original on the same formulas.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.artifacts import atomic_write_dir  # noqa: E402
from pipeline.names import MANIFEST  # noqa: E402
from pipeline.reports import markdown_table, savefig  # noqa: E402


def load(root: Path, prefix: str) -> list[dict]:
    runs = []
    for manifest in sorted(root.glob(f"{prefix}*/{MANIFEST}")):
        m = json.loads(manifest.read_text())
        if m.get("stage", "").startswith("prune-head-scores") or "variants" not in m.get("metrics", {}):
            continue
        runs.append({"folder": manifest.parent.name, "config": m["config"], "metrics": m["metrics"]})
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", type=Path)
    ap.add_argument("--prefix", default="prune")
    ap.add_argument("--tolerance", type=float, default=0.01)
    ap.add_argument("--out", default="prune-sweep")
    args = ap.parse_args()
    runs = load(args.artifacts, args.prefix)
    if not runs:
        sys.exit(f"error: no prune run with a manifest under {args.artifacts}/{args.prefix}*")
    rows, points = [], {}
    for r in sorted(runs, key=lambda r: (r["metrics"]["criterion"], r["metrics"]["heads_removed"], r["folder"])):
        m, v = r["metrics"], r["metrics"]["variants"]
        orig, raw = v["original"], v["pruned, before recovery"]
        rec = v.get("pruned, after recovery", raw)
        rnd = v.get("random heads, after recovery") or v.get("random heads")
        rows.append([m["criterion"], r["config"].get("normalize"), m["heads_removed"], f"{rec['encoder_gflops']:.2f}",
                     f"{m['flops_reduction']:.1%}", f"{orig['exact_match']:.3f}", f"{raw['exact_match']:.3f}",
                     f"{rec['exact_match']:.3f}", f"{rnd['exact_match']:.3f}" if rnd else "-", f"{rec['cer']:.3f}",
                     m["eval_n"], r["folder"]])
        points.setdefault(m["criterion"], []).append((rec["encoder_gflops"], raw["exact_match"], rec["exact_match"],
                                                      orig, m, r["folder"]))
    ok = [p for ps in points.values() for p in ps if p[2] >= p[3]["exact_match"] - args.tolerance]
    best = max(ok, key=lambda p: (p[4]["heads_removed"], p[2]), default=None)

    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    orig_gf = orig_em = None
    for i, (crit, ps) in enumerate(sorted(points.items())):
        ps = sorted(ps, key=lambda p: -p[0])
        orig_gf, orig_em = ps[0][3]["encoder_gflops"], ps[0][3]["exact_match"]
        color = f"C{i}"
        xs = [orig_gf] + [p[0] for p in ps]
        ax.plot(xs, [orig_em] + [p[2] for p in ps], "o-", color=color, label=f"{crit}, after recovery")
        ax.plot(xs, [orig_em] + [p[1] for p in ps], "x--", color=color, alpha=0.6, label=f"{crit}, before recovery")
    if orig_em is not None:
        ax.axhline(orig_em - args.tolerance, color="grey", lw=0.8, ls=":", label=f"original - {args.tolerance:g}")
        ax.axvline(0.7 * orig_gf, color="red", lw=0.8, ls=":", label="-30 % encoder FLOPs")
    if best:
        ax.annotate("best", (best[0], best[2]), textcoords="offset points", xytext=(5, 8))
    ax.set_xlabel("encoder GFLOPs per image")
    ns = sorted({r["metrics"]["eval_n"] for r in runs})
    ax.set_ylabel(f"exact match (eval split, n={'/'.join(map(str, ns))})")
    ax.invert_xaxis()
    ax.set_title("Head pruning: exact match vs encoder FLOPs")
    ax.legend(fontsize=7)
    table = markdown_table(["criterion", "normalize", "heads removed", "encoder GFLOPs", "FLOPs cut",
                            "EM original", "EM before recovery", "EM after recovery", "EM random (after rec.)",
                            "CER after", "n", "artifact"], rows)
    verdict = (f"Best: `{best[5]}`: {best[4]['heads_removed']} heads removed, exact match {best[2]:.3f} "
               f"vs original {best[3]['exact_match']:.3f}, encoder {best[0]:.2f} GFLOPs "
               f"({best[4]['flops_reduction']:.1%} less)." if best else
               f"No run kept exact match within {args.tolerance} of the original.")
    with atomic_write_dir(args.artifacts / args.out) as out:  # never a half-written report
        savefig(fig, out / "sweep.png")
        (out / "report.md").write_text(f"# Prune sweep\n\n{table}\n\n{verdict}\n\n![sweep](sweep.png)\n")
    print(table + "\n\n" + verdict)


if __name__ == "__main__":
    main()
