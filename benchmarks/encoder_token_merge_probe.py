"""Fewer encoder tokens without retraining: does merging blank patches keep the readings?

Issue 11 asks the encoder ≥ 2× faster; with its attention float (ONNX Runtime has no INT8 or BF16
attention kernel on x86) the INT8 package's ceiling is ≈1.55× (docs/quantize.md). The attention
grows with the square of the token count, and most of the default model's 1,024 patches are blank
canvas (``blank_share`` below). This probe merges blank patches the way token merging does (ToMe, Bolya et al. 2023):
a group of blank patches becomes one token, the mean of their patch embeddings (pixels and
positions), and every self-attention adds log(group size) to that key's scores (proportional
attention), so a merged token weighs what its members weighed; the encoder's output is copied back
to every member, so the decoder's cross-attention sees that weight too and is unchanged. Nothing is
retrained. Groups:

* ``pairs`` (``run:2``): runs of up to 2 horizontally adjacent blank patches, ``run:4`` up to 4;
* ``block:2``: 2×2 blocks of blank patches;
* ``run:1``: nothing merged (the check that the merged encoder is the model's own: identical readings).

It reads ``--limit`` formulas of each ``--splits`` with the torch model and KV cache, float and
merged, and prints tokens per image, exact match and identical readings (a JSON line per variant).
For the default model (``latex_ocr_junia``: its patch embedding and encoder blocks are used directly).

    python benchmarks/encoder_token_merge_probe.py artifacts --splits eval shift --limit 48
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.context import StageContext  # noqa: E402
from pipeline.data.render import render_inputs  # noqa: E402
from pipeline.metrics import normalize  # noqa: E402


def blank_patches(image: torch.Tensor, patch: int) -> torch.Tensor:
    """[rows, cols] True where a patch is the canvas colour throughout (the image's brightest value)."""
    img = image[0]
    rows, cols = img.shape[0] // patch, img.shape[1] // patch
    p = img.reshape(rows, patch, cols, patch).permute(0, 2, 1, 3).reshape(rows, cols, patch * patch)
    return (p - img.max()).abs().amax(-1) < 1e-3


def groups_of(blank: torch.Tensor, mode: str, k: int) -> list[list[int]]:
    """Token groups (flat patch indices, row-major as the patch embedding lays them out)."""
    rows, cols = blank.shape
    used = torch.zeros_like(blank)
    groups: list[list[int]] = []
    if mode == "block":
        for i in range(0, rows - k + 1, k):
            for j in range(0, cols - k + 1, k):
                if blank[i:i + k, j:j + k].all():
                    groups.append([a * cols + b for a in range(i, i + k) for b in range(j, j + k)])
                    used[i:i + k, j:j + k] = True
    elif mode == "run":
        for i in range(rows):
            j = 0
            while j < cols:
                if not blank[i, j]:
                    j += 1
                    continue
                end = j
                while end < cols and blank[i, end] and end - j < k:
                    end += 1
                groups.append([i * cols + b for b in range(j, end)])
                used[i, j:end] = True
                j = end
    else:
        raise SystemExit(f"unknown grouping {mode!r} (block, run)")
    groups += [[i * cols + j] for i in range(rows) for j in range(cols) if not used[i, j]]
    return groups


@torch.no_grad()
def merged_encode(model, image: torch.Tensor, mode: str, k: int) -> tuple[torch.Tensor, int]:
    """The encoder's output for one image with its blank patches merged, copied back to 1,024 tokens."""
    tokens = model.patch_embed(image[None])[0]
    groups = groups_of(blank_patches(image, model.patch_embed.patch_size), mode, k)
    mean = torch.zeros(len(groups), tokens.shape[0])
    index = torch.empty(tokens.shape[0], dtype=torch.long)
    for g, members in enumerate(groups):
        mean[g, members] = 1.0 / len(members)
        index[members] = g
    bias = torch.tensor([math.log(len(m)) for m in groups])  # proportional attention
    h = (mean @ tokens)[None]
    for block in model.encoder_blocks:
        a = block.attn
        n = block.norm1(h)
        q, key, v = (a._split(proj(n)) for proj in (a.q_proj, a.k_proj, a.v_proj))
        probs = F.softmax(q @ key.transpose(-1, -2) / math.sqrt(a.head_dim) + bias, dim=-1)
        h = h + a.out_proj((probs @ v).transpose(1, 2).reshape(1, -1, a.num_heads * a.head_dim))
        h = h + block.mlp(block.norm2(h))
    return model.encoder_norm(h)[0][index], len(groups)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", type=Path)
    ap.add_argument("--model", default="original", help="original, or a prune artifact folder name")
    ap.add_argument("--splits", nargs="+", default=["eval", "shift"])
    ap.add_argument("--limit", type=int, default=48)
    ap.add_argument("--groupings", nargs="+", default=["run:1", "run:2", "run:4", "block:2"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    ctx = StageContext.compose(args.artifacts, ["stage=quantize", "progress=false"])
    adapter = ctx.load_model(args.model)
    model, max_length = adapter.model, int(ctx.cfg.model.max_length)
    own_encode = model.encode
    for split in args.splits:
        items = render_inputs([(f.id, f.latex) for f in ctx.split(split)], adapter.preprocess, args.limit,
                              False, split)
        images, truths = torch.stack([x for _, _, x in items]), [latex for _, latex, _ in items]

        def reading() -> tuple[list[list[int]], float]:
            r = adapter.generate(images, max_length=max_length, batch_size=8, use_cache=True)
            return r.token_ids, float(np.mean([normalize(p) == normalize(t) for p, t in zip(r.texts, truths)]))

        float_ids, float_em = reading()
        blank = float(np.mean([blank_patches(img, model.patch_embed.patch_size).float().mean().item() for img in images]))
        for grouping in args.groupings:
            mode, k = grouping.split(":")
            counts: list[int] = []

            def encode(batch: torch.Tensor, mode=mode, k=int(k), counts=counts) -> torch.Tensor:
                outs = [merged_encode(model, img, mode, k) for img in batch]
                counts.extend(n for _, n in outs)
                return torch.stack([o for o, _ in outs])

            model.encode = encode
            try:
                ids, em = reading()
            finally:
                model.encode = own_encode
            print(json.dumps({"split": split, "formulas": len(truths), "grouping": grouping,
                              "blank_share": round(blank, 3),
                              "tokens_mean": round(float(np.mean(counts)), 1), "exact_match": round(em, 3),
                              "float_exact_match": round(float_em, 3),
                              "identical": round(float(np.mean([a == b for a, b in zip(ids, float_ids)])), 3)}),
                  flush=True)


if __name__ == "__main__":
    main()
