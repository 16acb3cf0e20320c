"""SmoothQuant's fold (pipeline/quantization/smooth.py) on the tiny model: the float function stays
the same, the projections' input channels get flatter, the weights take the scales."""
from __future__ import annotations

import numpy as np
import torch

from pipeline.data.render import render_formula
from pipeline.quantization import smooth
from tiny_model import FORMULAS, build_tiny


def _images(adapter):
    return torch.from_numpy(np.stack([adapter.preprocess(render_formula(f)).numpy() for f in FORMULAS[:4]]))


def test_the_fold_keeps_the_function_and_flattens_the_channels():
    adapter = build_tiny()
    images = _images(adapter)
    pairs = adapter.smoothing_pairs()
    blocks = len(adapter.model.encoder_blocks)
    assert [p.name for p in pairs[:3]] == ["encoder_blocks.0.attn.qkv_proj", "encoder_blocks.0.mlp.mlp.0",
                                           "encoder_blocks.0.attn.out_proj"] and len(pairs) == 3 * blocks
    with torch.no_grad():
        # an outlier channel, as ViT LayerNorms have: the fold must flatten it and keep the function
        adapter.model.encoder_blocks[0].norm1.weight[3] *= 40.0
        before = adapter.encode(images).clone()
    stats = smooth.input_absmax(adapter, pairs, images)
    q_before = adapter.model.encoder_blocks[0].attn.q_proj.weight.detach().clone()
    s = smooth.scales(stats["encoder_blocks.0.attn.qkv_proj"], pairs[0].consumers, 0.5)
    report = smooth.fold(pairs, stats, alpha=0.5)
    with torch.no_grad():
        after = adapter.encode(images)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    qkv = report["encoder_blocks.0.attn.qkv_proj"]
    assert qkv["before"] > 10 and qkv["after"] < qkv["before"] / 3
    again = smooth.input_absmax(adapter, pairs, images)["encoder_blocks.0.attn.qkv_proj"]
    assert float(again.max() / again.median()) < qkv["before"] / 3   # what the quantizer now sees
    torch.testing.assert_close(adapter.model.encoder_blocks[0].attn.q_proj.weight, q_before * s)  # columns x s


def test_alpha_zero_and_one_put_the_range_on_one_side():
    """alpha 1: the activations' channels become all equal (max 1); alpha 0: the weights' columns do."""
    adapter = build_tiny()
    pair = adapter.smoothing_pairs()[1]
    absmax = torch.linspace(0.5, 20.0, pair.consumers[0].in_features)
    s1 = smooth.scales(absmax, pair.consumers, 1.0)
    torch.testing.assert_close(absmax / s1, torch.ones_like(absmax))
    s0 = smooth.scales(absmax, pair.consumers, 0.0)
    w = pair.consumers[0].weight.detach().abs().amax(0)
    torch.testing.assert_close(w * s0, torch.ones_like(w))
