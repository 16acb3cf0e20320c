"""The encoder's time per image, package against package, and the tokens each keeps: batch 1, one
thread, images interleaved across the packages (each in its own session mode), on the first N
formulas of a split.

    python benchmarks/encoder_tokens.py artifacts export-ort_cpu tokens-float --split eval --n 64
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.benchmarking.scripts import find_packages, rendered, split_packages_parser  # noqa: E402
from pipeline.context import StageContext  # noqa: E402
from pipeline.export.runtime import OnnxPackage  # noqa: E402
from pipeline.tokens.policy import stats  # noqa: E402


def main(argv=None) -> int:
    ap = split_packages_parser(__doc__.splitlines()[0], n=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    folders = find_packages(args)
    if folders is None:
        return 2
    packages = [OnnxPackage(f, threads=1) for f in folders]
    ctx = StageContext.compose(args.artifacts)
    images = np.stack(rendered(ctx.split(args.split)[:args.n], packages[0].preprocess))
    ms = {i: [] for i in range(len(packages))}
    for _ in range(args.rounds):
        for image in images:
            for i, p in enumerate(packages):
                p.encode(image[None])  # warm, and the mode
                t0 = time.perf_counter()
                p.encode(image[None])
                ms[i].append(1000 * (time.perf_counter() - t0))
    base = float(np.median(ms[0]))
    print(f"{len(images)} {args.split} formulas, batch 1, 1 thread, {args.rounds} rounds interleaved")
    for i, (p, name) in enumerate(zip(packages, args.packages)):
        kept = stats([p.token_policy.count(p.token_policy.ranks(im)) for im in images], p.token_policy.num_patches) \
            if p.token_policy is not None else None
        med = float(np.median(ms[i]))
        print(f"{name}: encoder p50 {med:.1f} ms, mean {np.mean(ms[i]):.1f} ms ({base / med:.2f}x the first); tokens "
              + (f"kept mean {kept['mean']:.0f}, p95 {kept['p95']:.0f} ({100 * kept['share']:.0f} %)" if kept else "all"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
