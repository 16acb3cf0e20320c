"""How far a package's verify graph rounds from its step graph: each formula's greedy reading (step graph)
teacher-forced through both, the verify graph in calls of its full width as speculative decoding makes
them, and at every position the change of the gap between the step's two best tokens. A speculative
reading can leave greedy's where the step put its two best tokens closer than that change
(``export.speculative_tie_margin``, docs/export.md).

    python benchmarks/verify_deviation.py artifacts export-ort_cpu --split eval --n 32
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.benchmarking.scripts import find_packages, rendered, split_packages_parser  # noqa: E402
from pipeline.context import StageContext  # noqa: E402
from pipeline.export.runtime import OnnxPackage  # noqa: E402


def gap_changes(package: OnnxPackage, image: np.ndarray, max_length: int) -> list[float]:
    """At each position of the package's greedy reading of ``image``: |(step gap) - (verify gap)| of the
    step logits' two best tokens, the verify graph fed the reading in calls of ``verify_width`` tokens."""
    memory = package.encode(image[None])
    ids = package.greedy_from_memory(memory, max_length)[0]
    logits, past, cross = package.first(np.full((1, 1), package.bos, np.int64), memory)
    step, kv = [], past
    for t in ids:
        logits, kv = package.step(np.full((1, 1), t, np.int64), kv, cross)
        step.append(logits[0])
    verify, kv, width = [], past, package.verify_width
    for at in range(0, len(ids), width):
        chunk = np.array([ids[at:at + width]], np.int64)
        rows, present = package.verify(chunk, kv, cross)
        verify.extend(rows[0])
        kv = [p[:, :, :kv[0].shape[2] + chunk.shape[1]] for p in present]
    changes = []
    for s, v in zip(step, verify):
        second, best = np.argsort(s)[-2:]
        changes.append(float(abs((s[best] - s[second]) - (v[best] - v[second]))))
    return changes


def main(argv=None) -> int:
    ap = split_packages_parser(__doc__.splitlines()[0], n=32, packages_help="package folders with a "
                               "decoder_verify graph (under artifacts, or paths)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    folders = find_packages(args)
    if folders is None:
        return 2
    ctx = StageContext.compose(args.artifacts)
    formulas = ctx.split(args.split)[:args.n]
    for name, folder in zip(args.packages, folders):
        package = OnnxPackage(folder, threads=args.threads)
        images = rendered(formulas, package.preprocess)
        d = np.array([c for x in images for c in gap_changes(package, x, ctx.limits.max_length)])
        print(f"{name}: {len(images)} {args.split} formulas, {len(d)} positions, verify width "
              f"{package.verify_width}: change of the top-2 gap p50 {np.median(d):.4f}, p99 "
              f"{np.quantile(d, 0.99):.4f}, max {d.max():.4f} logits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
