"""Dynamic INT8 for the projections the ort_cpu plan keeps float: faster, and is it accurate enough?

The stage's ort_cpu plan keeps the projections whose static INT8 costs accuracy in FP32 (9 of 16 on
the chain's model), and they are most of the encoder's time. ONNX Runtime's *dynamic* quantization
computes each projection input's range per image at run time (``DynamicQuantizeLinear`` +
``MatMulInteger``), so no calibrated range clips an image's outliers. This script takes the stage's
ort_cpu encoder (``encoder.ort_cpu.qdq.onnx``) and the float package's encoder, and writes two
variants with ORT ``quantize_dynamic`` (per-channel symmetric INT8 weights; its registry has no Gemm,
so each float ``Gemm`` becomes ``MatMul`` + ``Add`` first):

* ``hybrid``: the plan's static INT8 projections as they are, its float projections dynamic INT8;
* ``dynamic``: every projection dynamic INT8.

Each is timed against float and the plan (batch 1, 1 thread, interleaved) and read greedily with the
float package's decoder on ``--split`` (default train: defaults may be chosen there), paired against
float. JSON lines on stdout.

    python benchmarks/quantize_dynamic_probe.py artifacts --split train
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.context import StageContext  # noqa: E402
from pipeline.data.render import render_inputs  # noqa: E402
from pipeline.export.runtime import OnnxPackage  # noqa: E402
from pipeline.quantization.measure import read  # noqa: E402
from pipeline.quantization.qdq import quiet  # noqa: E402


def float_projections_to_dynamic(src: Path, out: Path) -> list[str]:
    """Every float projection of ``src`` (a ``MatMul`` / ``Gemm`` whose inputs are not dequantized)
    dynamic INT8 with ORT ``quantize_dynamic``; the static QDQ ones stay. Returns their names."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(src))
    init = {i.name: i for i in model.graph.initializer}
    nodes, targets = [], []
    for n in model.graph.node:
        static = any(i.endswith("_DequantizeLinear_Output") for i in n.input)
        if n.op_type == "Gemm" and not static:
            at = {a.name: helper.get_attribute_value(a) for a in n.attribute}
            if at.get("transA", 0) or at.get("alpha", 1.0) != 1.0 or at.get("beta", 1.0) != 1.0:
                raise SystemExit(f"{n.name}: a Gemm with transA/alpha/beta is not a plain projection")
            if at.get("transB", 0):
                w = init[n.input[1]]
                w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w).T.copy(), w.name))
            nodes += [helper.make_node("MatMul", list(n.input[:2]), [n.output[0] + "_matmul"], name=n.name),
                      helper.make_node("Add", [n.output[0] + "_matmul", n.input[2]], list(n.output),
                                       name=n.name + "_bias")]
            targets.append(n.name)
        else:
            nodes.append(n)
            if n.op_type == "MatMul" and not static and n.input[1] in init:
                targets.append(n.name)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    plain = out.with_suffix(".matmul.onnx")
    onnx.save(model, str(plain))
    with quiet():
        quantize_dynamic(str(plain), str(out), per_channel=True, weight_type=QuantType.QInt8, nodes_to_quantize=targets,
                         op_types_to_quantize=["MatMul"], extra_options={"MatMulConstBOnly": True})
    return targets


def encoder_ms(paths: dict[str, Path], runs: int = 25) -> dict[str, float]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = 1, 1, 3
    sessions = {k: ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"]) for k, p in paths.items()}
    x = (np.random.default_rng(0).random((1, 1, 128, 512)) > 0.03).astype(np.float32)
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(runs):
        for k, s in sessions.items():
            t0 = time.perf_counter()
            s.run(None, {"images": x})
            times[k].append(time.perf_counter() - t0)
    return {k: round(1000 * float(np.median(t[3:])), 1) for k, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", type=Path)
    ap.add_argument("--quantize", default="quantize", help="the quantize artifact with encoder.ort_cpu.qdq.onnx")
    ap.add_argument("--package", default="export-ort_cpu-float-chain", help="the float package of the same model")
    ap.add_argument("--split", default="train")
    ap.add_argument("--limit", type=int, default=None, help="first formulas of the split (default: all)")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    art = args.artifacts.resolve()
    ctx = StageContext.compose(art, ["stage=quantize"])
    max_length = int(ctx.cfg.model.max_length)
    with tempfile.TemporaryDirectory(prefix="dynamic-probe-") as tmp:
        encoders = {"float": art / args.package / "encoder.onnx",
                    "plan": art / args.quantize / "encoder.ort_cpu.qdq.onnx",
                    "hybrid": Path(tmp) / "hybrid.onnx", "dynamic": Path(tmp) / "dynamic.onnx"}
        made = {"hybrid": float_projections_to_dynamic(encoders["plan"], encoders["hybrid"]),
                "dynamic": float_projections_to_dynamic(encoders["float"], encoders["dynamic"])}
        print(json.dumps({"dynamic_projections": {k: len(v) for k, v in made.items()},
                          "encoder_ms_batch1_1thread": encoder_ms(encoders)}), flush=True)
        readers = [OnnxPackage(art / args.package, threads=1) for _ in range(args.workers)]
        items = render_inputs([(f.id, f.latex) for f in ctx.split(args.split)], readers[0].preprocess, args.limit,
                              False, args.split)
        images = np.stack([x for _, _, x in items]).astype(np.float32)
        truths = [latex for _, latex, _ in items]
        ref = None
        for name, enc in encoders.items():
            r = read(readers, enc, images, truths, max_length, 16)
            ref = ref or r
            print(json.dumps({"split": args.split, "n": len(truths), "encoder": name, "exact_match": r.exact_match,
                              "cer": r.cer, "loss_points": round(100 * (ref.exact_match - r.exact_match), 2),
                              "identical": r.identical_to(ref), **r.paired(ref)}), flush=True)


if __name__ == "__main__":
    main()
