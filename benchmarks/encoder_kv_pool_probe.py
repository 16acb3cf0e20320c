"""Fewer attention keys, retrained: does pooling the encoder's keys and values survive a short finetune?

Issue 11 asks the encoder ≥ 2× faster than the original's float encoder. With every projection
INT8, most of the INT8 encoder's time is its float attention (ONNX Runtime's CPU provider has no
INT8 attention kernel), whose two products grow with queries × keys. Merging blank patches without
retraining ruins the readings (``encoder_token_merge_probe.py``). This probe keeps every query (the
output still has one token per patch, so the decoder and the graph shapes are unchanged) and pools
the *keys and values* of each encoder self-attention over ``--pool`` neighbouring patches (``1x2``:
pairs along a row; ``2x2``: blocks), the spatial-reduction attention of PVT (Wang et al. 2021), with
the average taken before the key and value projections (the same thing: the projections are
affine), so those two projections shrink too. Then the encoder alone trains ``--steps`` AdamW steps
to read as the float model does (the prune stage's sequence-level distillation: cross-entropy on the
float model's greedy readings, KL to its logits, MSE to its encoder output) on the first
``--images`` calibration rows.

It reads ``--limit`` formulas of each ``--splits`` with the torch model: float, pooled before the
finetune, pooled after; a JSON line per reading (exact match, identical readings to float).

    python benchmarks/encoder_kv_pool_probe.py artifacts --pool 1x2 --steps 200 --limit 64
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from calibration.calibrators import calib_images, load_calib_set  # noqa: E402
from pipeline.context import StageContext  # noqa: E402
from pipeline.data.render import render_inputs  # noqa: E402
from pipeline.metrics import normalize  # noqa: E402
from pipeline.pruning import recover  # noqa: E402
from pipeline.pruning.scores import own_predictions  # noqa: E402


def pool_tokens(x: torch.Tensor, rows: int, cols: int, ph: int, pw: int) -> torch.Tensor:
    """[B, rows*cols, D] patch tokens (row-major) -> [B, rows/ph * cols/pw, D], the mean of each block."""
    b, _, d = x.shape
    x = x.view(b, rows // ph, ph, cols // pw, pw, d).mean(dim=(2, 4))
    return x.reshape(b, -1, d)


def pooled_forward(rows: int, cols: int, ph: int, pw: int):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.norm1(x)
        kv = pool_tokens(normed, rows, cols, ph, pw)
        attn_out, _ = self.attn(normed, kv, kv, need_weights=False)
        x = x + self.drop1(attn_out)
        return x + self.mlp(self.norm2(x))
    return forward


def pooled_copy(adapter, pool: str, layers: list[int] | None = None):
    ph, pw = (int(v) for v in pool.split("x"))
    _, ih, iw = adapter.input_shape
    p = adapter.model.patch_embed.patch_size
    rows, cols = ih // p, iw // p
    student = copy.copy(adapter)
    student.model = copy.deepcopy(adapter.model)
    for i, block in enumerate(student.model.encoder_blocks):
        if layers is not None and i not in layers:
            continue
        block.forward = types.MethodType(pooled_forward(rows, cols, ph, pw), block)
    return student


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", type=Path)
    ap.add_argument("--model", default="original")
    ap.add_argument("--pool", default="1x2", help="rows x cols of patches a key/value averages")
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="encoder blocks that pool (default all)")
    ap.add_argument("--each", action="store_true", help="first read each block pooled alone, no finetune")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--images", type=int, default=256, help="calibration rows the encoder trains on")
    ap.add_argument("--splits", nargs="+", default=["eval", "shift"])
    ap.add_argument("--limit", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=40.0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    ctx = StageContext.compose(args.artifacts.resolve(), ["stage=quantize", "progress=false"])
    torch.manual_seed(ctx.seed)
    teacher = ctx.load_model(args.model)
    teacher.model.eval()
    max_length = int(ctx.cfg.model.max_length)
    splits = {}
    for split in args.splits:
        items = render_inputs([(f.id, f.latex) for f in ctx.split(split)], teacher.preprocess, args.limit, False, split)
        splits[split] = (torch.stack([x for _, _, x in items]), [latex for _, latex, _ in items])

    def reading(adapter, name: str, reference: dict | None) -> dict:
        out = {}
        for split, (images, truths) in splits.items():
            t = time.perf_counter()
            with torch.no_grad():
                r = adapter.generate(images, max_length=max_length, batch_size=8, use_cache=True)
            em = float(np.mean([normalize(p) == normalize(t) for p, t in zip(r.texts, truths)]))
            row = {"reading": name, "split": split, "formulas": len(truths), "exact_match": round(em, 3),
                   "seconds": round(time.perf_counter() - t, 1)}
            if reference is not None:
                row["identical"] = round(float(np.mean([a == b for a, b in zip(r.token_ids, reference[split])])), 3)
            print(json.dumps(row), flush=True)
            out[split] = r.token_ids
        return out

    ref = reading(teacher, "float", None)
    if args.each:
        for i in range(len(teacher.model.encoder_blocks)):
            reading(pooled_copy(teacher, args.pool, [i]), f"pool {args.pool} in block {i} alone, no finetune", ref)
    student = pooled_copy(teacher, args.pool, args.layers)
    student.model.eval()
    where = "every block" if args.layers is None else f"blocks {args.layers}"
    reading(student, f"pool {args.pool} in {where}, no finetune", ref)
    if args.steps <= 0:
        return
    calib = load_calib_set(args.artifacts / "calibrate")
    images = torch.from_numpy(calib_images(calib, 0, args.images))
    t = time.perf_counter()
    targets = own_predictions(teacher, images, max_length, 8, use_cache=True)
    print(json.dumps({"teacher_readings_seconds": round(time.perf_counter() - t, 1)}), flush=True)
    log = recover.finetune(student, teacher, images, [""] * len(images), steps=args.steps, minutes=args.minutes,
                           lr=args.lr, batch_size=args.batch, scope="encoder", targets=targets, seed=ctx.seed,
                           progress=True)
    print(json.dumps({"finetune": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in log.items()}}), flush=True)
    student.model.eval()
    reading(student, f"pool {args.pool} in {where}, {args.steps} steps", ref)


if __name__ == "__main__":
    main()
