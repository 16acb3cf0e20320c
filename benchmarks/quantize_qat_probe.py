"""Quantization-aware finetune of the encoder: does training with INT8 noise close the gap that
static INT8 leaves on every projection?

The chain's ort_cpu package with every encoder projection INT8 is ≥ 1.5× faster than its float
package but loses ~0.9 point exact match (docs/quantize.md); the search keeps half the
projections float to hold the 0.5-point budget and the speed-up falls to 1.2×. This probe takes
the model the chain hands quantize (``--model``, default ``prune``) through
``pipeline.quantization.qat`` (ModelOpt INT8 fake quantizers on every encoder projection, input
ranges from the first ``--calib`` calibration rows, ``--steps`` AdamW steps of sequence-level
distillation from the float model) on the prune finetune's images (train formulas + the varied
grammar) instead of the stage's calibration rows. What is written is a float model
(``<artifacts>/<--name>/model`` with a manifest naming its upstream), which the quantize stage
quantizes as it would any model:

    python benchmarks/quantize_qat_probe.py artifacts --steps 200 --name qat
    python -m pipeline stage=quantize quantize.model=qat quantize.budget=0.99 ...

JSON on stdout: the finetune's report (steps, loss, seconds). The stage's own option is
``quantize.qat_steps`` (calibration rows as images); this probe is how it was first measured.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from calibration.calibrators import calib_images, load_calib_set  # noqa: E402
from pipeline.context import StageContext  # noqa: E402
from pipeline.data.render import render_inputs  # noqa: E402
from pipeline.data.templates import varied_formulas  # noqa: E402
from pipeline.quantization import qat  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", type=Path)
    ap.add_argument("--model", default="prune")
    ap.add_argument("--name", default="qat")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--minutes", type=float, default=40.0)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--train", type=int, default=128, help="train formulas in the finetune set")
    ap.add_argument("--varied", type=int, default=256, help="formulas of the varied grammar in it")
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--percentile", type=float, default=99.99)
    args = ap.parse_args()
    artifacts = args.artifacts.resolve()
    ctx = StageContext.compose(artifacts, ["stage=quantize"])
    torch.manual_seed(ctx.seed)
    torch.set_num_threads(2)
    max_length, batch = int(ctx.cfg.model.max_length), int(ctx.cfg.model.batch_size)
    teacher = ctx.load_model(args.model)
    teacher.model.eval()

    train = ctx.split("train")
    order = np.random.default_rng(ctx.seed).permutation(len(train))
    pairs = [(train[i].id, train[i].latex) for i in order]
    items = render_inputs(pairs, teacher.preprocess, args.train, True, "render train")
    items += render_inputs(list(enumerate(varied_formulas(args.varied, ctx.seed))), teacher.preprocess, None, True,
                           "render varied") if args.varied else []
    images = torch.stack([x for _, _, x in items])
    calib = torch.from_numpy(calib_images(load_calib_set(artifacts / "calibrate"), 0, args.calib))
    out, report = qat.finetuned_copy(teacher, calib, images, steps=args.steps, lr=args.lr, batch_size=args.batch,
                                     minutes=args.minutes, percentile=args.percentile, seed=ctx.seed,
                                     max_length=max_length, read_batch=batch, progress=True)
    folder = artifacts / args.name
    tmp = artifacts / f".{args.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    out.save(tmp / "model")
    result = {"model": args.model, **report}
    (tmp / "manifest.json").write_text(json.dumps({"stage": "qat-probe", "config": {"model_ref": args.model, **vars(args),
                                                                                      "artifacts": str(artifacts)},
                                                   "metrics": result}, indent=2, default=str))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
