"""Probe: does bias correction shrink what INT8 projections change in the ort_cpu encoder? (No.)

Every projection INT8 (the stage's graph with the given method and UINT8 activations), then each
INT8 projection's output mean error, measured on the calibration rows in the QDQ graph itself
(its float input before QuantizeLinear, times the float weights, against its INT8 output), is
added to its bias. Reads calibration-split rows calib..rows: float, INT8, INT8 + correction.

    python benchmarks/quantize_bias_probe.py artifacts --model prune     # results: docs/quantize.md, session 11
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from calibration import sensitivity  # noqa: E402
from calibration.calibrators import CalibSetReader, calib_images, load_calib_set  # noqa: E402
from pipeline.context import StageContext  # noqa: E402
from pipeline.quantization import qdq  # noqa: E402
from pipeline.quantization.graphs import float_graphs  # noqa: E402
from pipeline.quantization.groups import find_groups  # noqa: E402
from pipeline.quantization.measure import encoder_outputs, read  # noqa: E402


def correct(float_path: Path, qdq_path: Path, out: Path, images: np.ndarray) -> dict:
    import onnxruntime as ort

    fm = onnx.load(str(float_path))
    finit = {i.name: i for i in fm.graph.initializer}
    fnodes = {n.name: n for n in fm.graph.node}
    m = onnx.load(str(qdq_path))
    g = m.graph
    prod = {o: n for n in g.node for o in n.output}
    init = {i.name: i for i in g.initializer}
    targets = []  # (node, x tensor, y tensor)
    for n in g.node:
        if n.op_type in ("MatMul", "Gemm") and n.input[0] in prod and prod[n.input[0]].op_type == "DequantizeLinear":
            dq = prod[n.input[0]]
            q = prod[dq.input[0]]
            targets.append((n, q.input[0], n.output[0]))
    probe = onnx.load(str(qdq_path))
    names = sorted({t for _, x, y in targets for t in (x, y)})
    for t in names:
        probe.graph.output.append(helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(probe.SerializeToString(), so, providers=["CPUExecutionProvider"])
    sums = {n.name: None for n, _, _ in targets}
    count = 0
    for i in range(0, len(images), 4):
        outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"images": images[i:i + 4]})))
        for n, x, y in targets:
            fn = fnodes[n.name]
            w = numpy_helper.to_array(finit[fn.input[1]])
            xs = outs[x].reshape(-1, outs[x].shape[-1])
            if n.op_type == "Gemm":
                a = {a.name: helper.get_attribute_value(a) for a in fn.attribute}
                if a.get("transB", 0):
                    w = w.T
                ref = xs @ w + (numpy_helper.to_array(finit[fn.input[2]]) if len(fn.input) > 2 else 0)
            else:
                ref = xs @ w
            d = (ref - outs[y].reshape(ref.shape)).sum(0)
            sums[n.name] = d if sums[n.name] is None else sums[n.name] + d
        count += xs.shape[0]
    report = {}
    for n, _, y in targets:
        c = (sums[n.name] / count).astype(np.float32)
        report[n.name] = float(np.abs(c).mean())
        if n.op_type == "Gemm" and len(n.input) > 2:
            b = n.input[2]
            if b in init:
                arr = numpy_helper.to_array(init[b]) + c
                init[b].CopyFrom(numpy_helper.from_array(arr.astype(np.float32), b))
                continue
            dq = prod[b]
            q_arr = numpy_helper.to_array(init[dq.input[0]])
            scale = numpy_helper.to_array(init[dq.input[1]])
            new = q_arr + np.round(c / scale).astype(q_arr.dtype)
            init[dq.input[0]].CopyFrom(numpy_helper.from_array(new, dq.input[0]))
        else:  # no bias: an Add after it
            cname = n.name + "_bias_correction"
            g.initializer.append(numpy_helper.from_array(c, cname))
            new_out = n.output[0] + "_uncorrected"
            for other in g.node:
                for k, i in enumerate(other.input):
                    if i == n.output[0]:
                        other.input[k] = n.output[0] + "_corrected"
            n.output[0] = new_out
            g.node.append(helper.make_node("Add", [new_out, cname], [y + "_corrected"], name=n.name + "_BiasCorrection"))
            for o in g.output:
                if o.name == y:
                    o.name = y + "_corrected"
    # the Adds were appended at the end: ONNX Runtime's graph helper puts them back in order
    from onnxruntime.transformers.onnx_model import OnnxModel

    OnnxModel(m).topological_sort()
    onnx.save(m, str(out))
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", type=Path)
    ap.add_argument("--model", default="prune")
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--rows", type=int, default=288)
    ap.add_argument("--methods", nargs="+", default=["percentile_99.99", "entropy"])
    args = ap.parse_args()
    ctx = StageContext.compose(args.artifacts.resolve(), ["stage=quantize"])
    max_length = int(ctx.cfg.model.max_length)
    adapter = ctx.load_model(args.model)
    calib = load_calib_set(args.artifacts / "calibrate")
    images = calib_images(calib, args.calib, args.rows)
    cal_images = calib_images(calib, 0, args.calib)
    truths = calib[args.calib:args.rows]["text"]
    with tempfile.TemporaryDirectory(prefix="bias-probe-") as tmp:
        work = Path(tmp)
        graphs = float_graphs(adapter, work, max_length, f"bias-probe:{args.model}", threads=1)
        readers = graphs.open_readers(1, 2)
        fr = read(readers, graphs.encoder_ort, images, truths, max_length, 16)
        ref = encoder_outputs(graphs.package, graphs.encoder_ort, images[:16])
        print(json.dumps({"variant": "float", "em": fr.exact_match, "cer": fr.cer}), flush=True)
        nodes = [g.node for g in find_groups(onnx.load(str(graphs.encoder_ort))) if g.kind == "weights"]
        for method in args.methods:
            cache = work / f"ranges.{method}.json"
            qdq.calibrate(graphs.encoder_ort, CalibSetReader(calib, "images", batch_size=8, limit=args.calib), method, cache)
            plain = work / f"enc.{method}.onnx"
            qdq.quantize(graphs.encoder_ort, plain, cache, method, nodes, "uint8")
            fixed = work / f"enc.{method}.bc.onnx"
            corr = correct(graphs.encoder_ort, plain, fixed, cal_images)
            for tag, enc in (("int8", plain), ("int8+bc", fixed)):
                r = read(readers, enc, images, truths, max_length, 16)
                snr = sensitivity.SNR().score(ref, encoder_outputs(graphs.package, enc, images[:16]))
                print(json.dumps({"variant": f"{method} {tag}", "em": r.exact_match, "cer": r.cer, "snr_db": snr,
                                  "identical": r.identical_to(fr), **r.paired(fr)}), flush=True)
            print(json.dumps({"corrections_mean_abs": corr}), flush=True)


if __name__ == "__main__":
    main()
