"""Exact-match loss of the ort_cpu encoder against the number of projections kept float, read on
many formulas: does a faster plan exist within the budget, at a resolution the search set lacks?

The stage's search reads 256 calibration formulas (paired standard error ≈ 0.8-1.5 points against a
0.5-point budget). This script takes the ranking a quantize run wrote (``plan.json``: the groups'
sensitivity), the stage's ranges (the given method, the first 32 calibration rows, UINT8
activations), and for each ``k`` keeps the ``k`` most sensitive projections float and the rest INT8;
each encoder is read greedily with the package's float decoder on the formulas of ``--split``
(default train: the split the model's defaults may be chosen on), paired against float: exact
match, loss, formulas gained / lost, paired SE, identical readings. JSON lines on stdout.

    python benchmarks/quantize_plan_curve.py artifacts --ks 0 2 3 4 5 6 9 --method percentile_99.99
    python benchmarks/quantize_plan_curve.py artifacts --quantize quantize-sq08 --smoothquant 0.8 --ks 0 1 2 3 4

``--smoothquant ALPHA`` folds SmoothQuant into the model first (the stage's way: the activation maxima
of the first ``--calib`` calibration rows); float is then the smoothed model in float, which reads
as the model does (the fold is exact up to rounding).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from calibration import sensitivity  # noqa: E402
from calibration.calibrators import CalibSetReader, calib_images, load_calib_set  # noqa: E402
from pipeline.context import StageContext  # noqa: E402
from pipeline.data.render import render_inputs  # noqa: E402
from pipeline.quantization import qdq  # noqa: E402
from pipeline.quantization.graphs import float_graphs  # noqa: E402
from pipeline.quantization.groups import find_groups  # noqa: E402
from pipeline.quantization.measure import read  # noqa: E402


def ort_ranking(plan: dict, projections: set[str]) -> list[str]:
    """The ort_cpu projections, most sensitive first, ranked as the stage ranks them, from the
    sensitivity numbers ``plan.json`` carries."""
    rows = [sensitivity.GroupSensitivity(name, *[float(g["sensitivity"].get(k, float("nan")))
                                                 for k in ("only", "all_but", "gain")])
            for name, g in plan["groups"].items() if name in projections]
    return [r.group for r in sensitivity.ranking(rows)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", type=Path)
    ap.add_argument("--quantize", default="quantize", help="the quantize artifact whose plan.json ranks the groups")
    ap.add_argument("--model", default="prune")
    ap.add_argument("--split", default="train")
    ap.add_argument("--limit", type=int, default=None, help="first formulas of the split (default: all)")
    ap.add_argument("--method", default="percentile_99.99")
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 2, 3, 4, 5, 6, 9])
    ap.add_argument("--smoothquant", type=float, default=None, help="SmoothQuant alpha folded in first")
    args = ap.parse_args()
    ctx = StageContext.compose(args.artifacts.resolve(), ["stage=quantize"])
    max_length = int(ctx.cfg.model.max_length)
    adapter = ctx.load_model(args.model)
    plan = json.loads((args.artifacts / args.quantize / "plan.json").read_text())
    calib = load_calib_set(args.artifacts / "calibrate")
    if args.smoothquant is not None:
        import torch

        from pipeline.quantization import smooth

        adapter, _ = smooth.smoothed_copy(adapter, torch.from_numpy(calib_images(calib, 0, args.calib)),
                                          args.smoothquant)
    items = render_inputs([(f.id, f.latex) for f in ctx.split(args.split)], lambda im: adapter.preprocess(im).numpy(),
                          args.limit, True, args.split)
    images = np.stack([x for _, _, x in items]).astype(np.float32)
    truths = [latex for _, latex, _ in items]
    with tempfile.TemporaryDirectory(prefix="plan-curve-") as tmp:
        work = Path(tmp)
        graphs = float_graphs(adapter, work, max_length, f"plan-curve:{args.model}", threads=1)
        readers = graphs.open_readers(1, 2)
        groups = {g.name: g for g in find_groups(onnx.load(str(graphs.encoder_ort))) if g.kind == "weights"}
        order = ort_ranking(plan, set(groups))
        cache = work / "ranges.json"
        qdq.calibrate(graphs.encoder_ort, CalibSetReader(calib, "images", batch_size=8, limit=args.calib), args.method, cache)
        fr = read(readers, graphs.encoder_ort, images, truths, max_length, 16)
        print(json.dumps({"split": args.split, "n": len(truths), "smoothquant": args.smoothquant,
                          "float": fr.exact_match, "float_cer": fr.cer,
                          "ranking": order}), flush=True)
        for k in args.ks:
            enc = work / f"enc.{k}.onnx"
            qdq.quantize(graphs.encoder_ort, enc, cache, args.method, [groups[n].node for n in order[k:]], "uint8")
            r = read(readers, enc, images, truths, max_length, 16)
            print(json.dumps({"k_float": k, "int8": len(order) - k, "exact_match": r.exact_match, "cer": r.cer,
                              "loss_points": round(100 * (fr.exact_match - r.exact_match), 2),
                              "identical": r.identical_to(fr), **r.paired(fr), "float_now": order[:k]}), flush=True)


if __name__ == "__main__":
    main()
