"""Where one ``decoder_step`` call's time goes, at batch 1, for one or more packages (issue 38, part 4).

For each package: the step graph's nodes (in the file, and after ONNX Runtime's session
optimizations); ONNX Runtime's profiler over ``--calls`` calls after ``--past`` tokens (kernel time
per op type a call, their sum against the whole ``model_run``: what is not kernel time inside the
session is the call's overhead there); and the wall time of a reading's worth of steps (``--steps``,
the past growing from ``--past``), run two ways in turn: ``session.run`` with numpy arrays, as the
package runtime calls it, and IOBinding (the cross-attention K/V bound once as ONNX Runtime values,
each step's present K/V bound as the next step's past without a numpy copy, outputs left to ONNX
Runtime). The packages are read in turn within each repeat, so they see the same load: compare
them within one run. With ``--verify-widths`` the ``decoder_verify`` graph is profiled at those widths too:
each op type's kernel time by width, and what one more token a call checks adds to it.

    python benchmarks/decoder_call.py artifacts/export-ort_cpu artifacts/export-ort_cpu-float-original
    python benchmarks/decoder_call.py artifacts/export-ort_cpu --verify-widths 1 3 5 9
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.errors import PipelineError  # noqa: E402
from pipeline.export.runtime import OnnxPackage, session_options  # noqa: E402
from pipeline.names import DECODER_STEP, DECODER_VERIFY  # noqa: E402


def start(package: OnnxPackage, past_len: int) -> tuple[list, list]:
    """A past of ``past_len`` tokens and the cross K/V of a blank image (values do not change the time)."""
    memory = package.encode(np.ones((1, *package.meta["input_shape"]), np.float32))
    _, past, cross = package.first(np.asarray([[package.bos] + [package.eos] * (past_len - 1)]), memory)
    return past, cross


def options(threads: int):
    return session_options(threads)


def node_counts(path: Path, threads: int) -> tuple[int, int]:
    """Nodes in the graph file, and in the graph ONNX Runtime runs after its optimizations."""
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        so = options(threads)
        so.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        optimized = onnx.load(so.optimized_model_filepath, load_external_data=False)
    return len(onnx.load(str(path), load_external_data=False).graph.node), len(optimized.graph.node)


def profile(path: Path, feed: dict, calls: int, threads: int) -> dict:
    """ONNX Runtime's profiler: kernel microseconds a call per op type, their sum, the model_run's (means
    over the calls after ten warm-up calls)."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        so = options(threads)
        so.enable_profiling, so.profile_file_prefix = True, str(Path(tmp) / "step")
        session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        for _ in range(calls + 10):
            session.run(None, feed)
        events = json.loads(Path(session.end_profiling()).read_text())
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])[10:]  # warm
    kernels = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
               and e["ts"] >= runs[0]["ts"]]
    by_op = collections.Counter()
    for e in kernels:
        by_op[e["args"]["op_name"]] += e["dur"] / len(runs)
    return {"by_op": dict(by_op.most_common()), "kernels": sum(by_op.values()),
            "model_run": float(np.mean([e["dur"] for e in runs]))}


def plain_loop(package: OnnxPackage, past: list, cross: list, steps: int) -> tuple[float, np.ndarray]:
    """Milliseconds a step of ``steps`` steps through ``session.run``; the last step's logits."""
    session = package.sessions[DECODER_STEP]
    names = package.io[DECODER_STEP]["inputs"]
    token = np.asarray([[package.eos]], np.int64)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = session.run(None, dict(zip(names, [token, *past, *cross])))
        past = out[1:]
    return 1000 * (time.perf_counter() - t0) / steps, out[0]


def bound_loop(package: OnnxPackage, past: list, cross: list, steps: int) -> tuple[float, np.ndarray]:
    """The same steps through IOBinding (set up inside the timing); the last step's logits."""
    import onnxruntime as ort

    session = package.sessions[DECODER_STEP]
    names = package.io[DECODER_STEP]["inputs"]
    outputs = package.io[DECODER_STEP]["outputs"]
    n = len(past)
    t0 = time.perf_counter()
    binding = session.io_binding()
    for name, value in zip(names[1 + n:], cross):
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value))
    values = [ort.OrtValue.ortvalue_from_numpy(p) for p in past]
    token = np.asarray([[package.eos]], np.int64)
    for _ in range(steps):
        binding.bind_cpu_input(names[0], token)
        for name, value in zip(names[1:1 + n], values):
            binding.bind_ortvalue_input(name, value)
        for name in outputs:
            binding.bind_output(name, "cpu")
        session.run_with_iobinding(binding)
        got = binding.get_outputs()
        logits = got[0].numpy()  # what the loop reads
        values = got[1:]
    return 1000 * (time.perf_counter() - t0) / steps, logits


def verify_profiles(package: OnnxPackage, past: list, cross: list, widths: list[int], calls: int,
                    threads: int) -> dict:
    """ONNX Runtime's profile of ``decoder_verify`` at each width: kernel microseconds a call by op type;
    printed as a table (op types as rows, widths as columns) with each op's microseconds per extra token."""
    path = package.folder / package.meta["graphs"][DECODER_VERIFY]
    out = {}
    for width in widths:
        ids = np.full((1, width), package.eos, dtype=np.int64)
        feed = dict(zip(package.io[DECODER_VERIFY]["inputs"], [ids, *past, *cross]))
        out[width] = profile(path, feed, calls, threads)
    widest = out[widths[-1]]["by_op"]
    ops = sorted({op for prof in out.values() for op in prof["by_op"]}, key=lambda op: -widest.get(op, 0))
    span = widths[-1] - widths[0]
    print(f"  decoder_verify, kernel us a call by width (past {len(past) and past[0].shape[2]}, {calls} calls)"
          + (f"; us per extra token from width {widths[0]} to {widths[-1]}" if span else ""))
    print(f"    {'op':<24}" + "".join(f"{w:>8d}" for w in widths) + ("  per token" if span else ""))
    for op in [*ops, "kernels", "model_run"]:
        row = [out[w]["by_op"].get(op, 0.0) if op in ops else out[w][op] for w in widths]
        per_token = f"  {(row[-1] - row[0]) / span:9.1f}" if span else ""
        print(f"    {op:<24}" + "".join(f"{v:8.0f}" for v in row) + per_token)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("packages", nargs="+", type=Path)
    ap.add_argument("--past", type=int, default=40, help="tokens already written when the profiled call runs")
    ap.add_argument("--steps", type=int, default=70, help="steps a timed loop takes (a reading's worth)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--calls", type=int, default=200, help="profiled calls")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--verify-widths", type=int, nargs="*", default=[],
                    help="also profile decoder_verify at these widths (the last written token + drafts)")
    ap.add_argument("--out", type=Path, help="also write the numbers as JSON here")
    args = ap.parse_args(argv)
    try:
        packages = {str(p): OnnxPackage(p, threads=args.threads, speculative=False) for p in args.packages}
    except PipelineError as exc:
        ap.error(str(exc))
    starts = {k: start(p, args.past) for k, p in packages.items()}
    walls = {k: {"run": [], "iobinding": []} for k in packages}
    same = {}
    for _ in range(args.repeats):
        for k, p in packages.items():
            ms, plain = plain_loop(p, *starts[k], args.steps)
            walls[k]["run"].append(ms)
            ms, bound = bound_loop(p, *starts[k], args.steps)
            walls[k]["iobinding"].append(ms)
            same[k] = bool(np.array_equal(plain, bound))  # both loops compute the same steps
    results = {}
    for k, p in packages.items():
        path = p.folder / p.meta["graphs"][DECODER_STEP]
        past, cross = starts[k]
        feed = dict(zip(p.io[DECODER_STEP]["inputs"], [np.asarray([[p.eos]], np.int64), *past, *cross]))
        prof = profile(path, feed, args.calls, args.threads)
        in_file, optimized = node_counts(path, args.threads)
        run, bound = (float(np.median(walls[k][w])) for w in ("run", "iobinding"))
        results[k] = {"nodes": in_file, "nodes_optimized": optimized, "step_ms": run, "step_ms_iobinding": bound,
                      "same_logits": same[k], **prof}
        print(f"\n{k}: decoder_step, batch 1, {args.threads} thread(s)")
        print(f"  nodes: {in_file} in the graph, {optimized} after ONNX Runtime's optimizations")
        print(f"  wall ms a step ({args.steps} steps from a past of {args.past}, median of {args.repeats}): "
              f"session.run {run:.3f}, IOBinding {bound:.3f} ({run / bound:.2f}x; the same logits: {same[k]})")
        print(f"  profiled call (past {args.past}, {args.calls} calls; the profiler's own cost included): "
              f"model_run {prof['model_run']:.0f} us, kernels {prof['kernels']:.0f} us "
              f"({100 * prof['kernels'] / prof['model_run']:.0f} %)")
        for op, us in prof["by_op"].items():
            print(f"    {op:<24} {us:7.0f} us  {100 * us / prof['kernels']:5.1f} % of kernel time")
        if args.verify_widths:
            results[k]["verify"] = verify_profiles(p, past, cross, args.verify_widths, args.calls, args.threads)
    if args.out:
        args.out.write_text(json.dumps({"past": args.past, "steps": args.steps, "repeats": args.repeats,
                                        "threads": args.threads, "packages": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
