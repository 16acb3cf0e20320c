"""The ort_cpu encoder with every projection INT8: symmetric INT8 activations (zero point 0) against
asymmetric UINT8 (zero point fitted to the range), with and without SmoothQuant, read greedily on
calibration-set formulas (issue 11; docs/quantize.md, "Activations on ONNX Runtime CPU").

For each SmoothQuant setting the model's graphs are exported (the quantize stage's own code), the
ranges come from the first ``--calib`` calibration rows (percentile 99.99, the stage's default),
and the rows after them up to ``--rows`` are read with the float package and with each INT8 encoder
(the package's float decoder): exact match, CER, formulas gained / lost against float and the
paired standard error of the loss, readings identical to float, encoder-output SNR; also the first
256 rows alone (the stage's search set).

    python benchmarks/quantize_activations.py artifacts --model prune --alphas none 0.8
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from calibration import sensitivity  # noqa: E402
from calibration.calibrators import CalibSetReader, calib_images, load_calib_set  # noqa: E402
from pipeline.quantization import qdq, smooth  # noqa: E402
from pipeline.quantization.graphs import float_graphs  # noqa: E402
from pipeline.quantization.groups import find_groups  # noqa: E402
from pipeline.context import StageContext  # noqa: E402
from pipeline.quantization.measure import encoder_outputs, read  # noqa: E402

METHOD = "percentile_99.99"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", type=Path)
    ap.add_argument("--model", default="prune", help="a stage with a model, or original")
    ap.add_argument("--calib", type=int, default=32, help="calibration rows the ranges come from")
    ap.add_argument("--rows", type=int, default=512, help="read rows calib..rows of the calibration set")
    ap.add_argument("--alphas", nargs="+", default=["none", "0.8"], help="SmoothQuant alphas; none = off")
    ap.add_argument("--out", type=Path, default=None, help="JSON lines (default <artifacts>/quantize-activations.jsonl)")
    args = ap.parse_args()
    ctx = StageContext.compose(args.artifacts.resolve(), ["stage=quantize"])
    max_length = int(ctx.cfg.model.max_length)
    base = ctx.load_model(args.model)
    calib = load_calib_set(args.artifacts / "calibrate")
    images = calib_images(calib, args.calib, args.rows)
    calib_rows = torch.from_numpy(calib_images(calib, 0, args.calib))
    truths = calib[args.calib:args.rows]["text"]
    out_path = args.out or args.artifacts / "quantize-activations.jsonl"
    work = Path(tempfile.mkdtemp(prefix="quantize-activations-"))
    results = []
    try:
        for spec in args.alphas:
            alpha = None if spec == "none" else float(spec)
            adapter = base if alpha is None else smooth.smoothed_copy(base, calib_rows, alpha)[0]
            folder = work / spec
            folder.mkdir()
            graphs = float_graphs(adapter, folder, max_length, f"activations-probe:{args.model}:{spec}", threads=1)
            readers = graphs.open_readers(1, 2)
            float_reading = read(readers, graphs.encoder_ort, images, truths, max_length, 16)
            ref = encoder_outputs(graphs.package, graphs.encoder_ort, images[:16])
            nodes = [g.node for g in find_groups(onnx.load(str(graphs.encoder_ort))) if g.kind == "weights"]
            cache = folder / "ranges.json"
            qdq.calibrate(graphs.encoder_ort, CalibSetReader(calib, "images", batch_size=8, limit=args.calib),
                          METHOD, cache)
            for acts in ("int8", "uint8"):
                encoder = folder / f"encoder.{acts}.onnx"
                qdq.quantize(graphs.encoder_ort, encoder, cache, METHOD, nodes, acts)
                r = read(readers, encoder, images, truths, max_length, 16)
                row = {"model": args.model, "smoothquant": alpha, "activations": acts, "n": len(truths),
                       "float_exact_match": float_reading.exact_match, "float_cer": float_reading.cer,
                       "exact_match": r.exact_match, "cer": r.cer, "identical": r.identical_to(float_reading),
                       **r.paired(float_reading),
                       "snr_db": sensitivity.SNR().score(ref, encoder_outputs(graphs.package, encoder, images[:16])),
                       "first_256": {"exact_match": float(np.mean(r.exact[:256])),
                                     "float_exact_match": float(np.mean(float_reading.exact[:256]))}}
                print(json.dumps(row), flush=True)
                results.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with out_path.open("a", encoding="utf-8") as f:
        for row in results:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
