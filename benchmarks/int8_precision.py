"""An ort_cpu INT8 package on this CPU with ONNX Runtime's U8S8 kernels as they come and with
``session.x64quantprecision=1`` (what packages record): the encoder's output against the same graph run
op by op (QuantizeLinear, DequantizeLinear, float MatMul: the arithmetic QAT trained for), and the time,
encoder and end to end, batch 1, one thread, interleaved. On x86 CPUs without VNNI the U8S8 kernel adds
pairs of products in 16 bits, which saturate; with VNNI both rows are the same.

    python benchmarks/int8_precision.py artifacts export-ort_cpu --n 48
    python benchmarks/paired_splits.py ...   # the readings of whole splits: two copies of the package whose
                                             # package.json differ in that entry
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.benchmarking.scripts import find_packages, rendered, split_packages_parser  # noqa: E402
from pipeline.context import StageContext  # noqa: E402
from pipeline.export.runtime import PRECISE_INT8, OnnxPackage, session_options  # noqa: E402
from pipeline.names import ENCODER  # noqa: E402

MODES = {"U8S8 as it comes": "0", "x64quantprecision=1": "1"}


def _op_by_op(package: OnnxPackage):
    """The package's encoder with no graph optimization: each QDQ pair and MatMul runs as written."""
    import onnxruntime as ort

    so = session_options(1)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(package.folder / package.meta["graphs"][ENCODER]), so,
                                providers=["CPUExecutionProvider"])


def main(argv=None) -> int:
    ap = split_packages_parser(__doc__.splitlines()[0], n=48, packages_help="one ort_cpu package")
    args = ap.parse_args(argv)
    folders = find_packages(args)
    if folders is None:
        return 2
    packages = {m: OnnxPackage(folders[0], threads=1, session_entries={PRECISE_INT8: v}) for m, v in MODES.items()}
    first = next(iter(packages.values()))
    ctx = StageContext.compose(args.artifacts)
    images = rendered(ctx.split(args.split)[:args.n], first.preprocess)
    reference = _op_by_op(first)
    snr, enc_ms, e2e_ms = ({m: [] for m in MODES} for _ in range(3))
    for k, image in enumerate(images):
        x = image[None]
        feed = {"images": x, **({"keep": first.token_policy.keep_batch(x)} if first.token_policy else {})}
        ref = reference.run(["memory"], feed)[0]
        for m, p in (packages.items() if k % 2 == 0 else reversed(packages.items())):
            p.encode(x)  # warm, as benchmarks/encoder_tokens.py
            t0 = time.perf_counter()
            got = p.encode(x)
            enc_ms[m].append(1000 * (time.perf_counter() - t0))
            snr[m].append(10 * np.log10(np.sum(ref ** 2) / max(float(np.sum((got - ref) ** 2)), 1e-30)))
            t0 = time.perf_counter()
            p.generate(x, p.max_length, 1)
            e2e_ms[m].append(1000 * (time.perf_counter() - t0))
    print(f"{len(images)} {args.split} formulas, batch 1, 1 thread, interleaved; encoder SNR against the op-by-op graph")
    base = float(np.median(e2e_ms[next(iter(MODES))]))
    for m in MODES:
        print(f"{m}: encoder SNR mean {np.mean(snr[m]):.1f} dB (min {np.min(snr[m]):.1f}); encoder p50 "
              f"{np.median(enc_ms[m]):.1f} ms; end to end p50 {np.median(e2e_ms[m]):.1f} ms "
              f"({np.median(e2e_ms[m]) / base:.3f}x the first's time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
