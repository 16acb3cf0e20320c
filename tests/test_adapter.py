"""The latex-ocr-junia adapter: MHA rewrite equivalence, preprocessing of odd images, batching."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.adapters.attention import ExplicitAttention
from pipeline.data.render import render_formula


def test_mha_rewrite_is_numerically_equal(real_adapter):
    from latex_ocr_junia.utils import load_model_config

    from pipeline.adapters.latex_ocr_junia import build_model_reference, package_assets, safe_load_checkpoint

    ref = build_model_reference(load_model_config(package_assets() / "model_config.json"))
    ref.load_state_dict(safe_load_checkpoint(package_assets() / "best.pt")["model_state_dict"])
    assert not any(isinstance(m, torch.nn.MultiheadAttention) for m in real_adapter.model.modules())
    assert sum(isinstance(m, ExplicitAttention) for m in real_adapter.model.modules()) == 4 + 2 * 4
    x = torch.stack([real_adapter.preprocess(render_formula(f)) for f in [r"\frac{a}{b}", "x^{2}+1"]])
    tokens = torch.tensor([[1, 4, 5, 6, 7, 8], [1, 9, 10, 11, 12, 13]])
    with torch.no_grad():
        m_ref, m_new = ref.encode(x), real_adapter.encode(x)
        torch.testing.assert_close(m_new, m_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(real_adapter.decode_logits(tokens, m_new), ref.decode(tokens, m_ref),
                                   atol=1e-4, rtol=1e-4)


def test_explicit_attention_matches_mha_with_masks():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    exp = ExplicitAttention.from_mha(mha).eval()
    q = torch.randn(2, 5, 32)
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)
    pad = torch.tensor([[False] * 5, [False, False, False, False, True]])
    with torch.no_grad():
        a, _ = mha(q, q, q, attn_mask=causal, key_padding_mask=pad, need_weights=False)
        b, _ = exp(q, q, q, attn_mask=causal, key_padding_mask=pad)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "LA", "P", "I;16", "F", "1"])
def test_preprocess_handles_image_modes(real_adapter, mode):
    base = render_formula("x+y")
    ref = real_adapter.preprocess(base)
    arr = np.asarray(base)
    if mode == "I;16":
        img = Image.fromarray(arr.astype(np.uint16) * 257)
    elif mode == "F":
        img = Image.fromarray(arr.astype(np.float32) / 255.0, mode="F")
    elif mode in ("RGBA", "LA"):
        # ink as opaque black, background transparent: composited on white it is the same picture
        alpha = 255 - arr
        rgba = np.stack([np.zeros_like(arr)] * 3 + [alpha], axis=-1)
        img = Image.fromarray(rgba, mode="RGBA").convert(mode)
    else:
        img = base.convert(mode)
    out = real_adapter.preprocess(img)
    assert out.shape == ref.shape
    diff = (out - ref).abs().mean().item()
    assert diff < 0.02, diff


def test_white_on_black_is_inverted(real_adapter):
    base = render_formula(r"\alpha")
    inverted = Image.fromarray(255 - np.asarray(base))
    padded = Image.new("L", (base.width + 20, base.height + 20), 0)
    padded.paste(inverted, (10, 10))
    assert torch.equal(real_adapter.preprocess(padded), real_adapter.preprocess(base))


def test_zero_size_image_is_rejected(real_adapter):
    with pytest.raises(ValueError, match="zero size"):
        real_adapter.preprocess(Image.new("L", (0, 5)))


@pytest.mark.slow
def test_batched_decoding_equals_one_by_one(real_adapter):
    formulas = [r"\frac{a}{b}", "x^{2}+y", r"\alpha+\beta", r"\sqrt{x+1}"]
    x = torch.stack([real_adapter.preprocess(render_formula(f)) for f in formulas])
    # with the KV cache, as every reader decodes (the cache against the full prefix: the test below)
    batched = real_adapter.generate(x, max_length=60, batch_size=4, use_cache=True)
    single = [real_adapter.generate(x[i:i + 1], max_length=60, batch_size=1, use_cache=True).token_ids[0]
              for i in range(4)]
    assert batched.token_ids == single
    assert all(s == len(t) for s, t in zip(batched.steps, batched.token_ids))
    assert batched.encoder_seconds > 0 and batched.decoder_seconds > 0


@pytest.mark.slow
def test_kv_cached_decoding_gives_the_same_tokens(real_adapter):
    formulas = [r"\frac{a}{b}+c", r"\sum_{i=1}^{n} x_{i}", r"\alpha_{1}^{2}", r"\sqrt{x+1}"]
    x = torch.stack([real_adapter.preprocess(render_formula(f)) for f in formulas])
    full = real_adapter.generate(x, max_length=70, batch_size=4)
    cached = real_adapter.generate(x, max_length=70, batch_size=4, use_cache=True)
    assert cached.token_ids == full.token_ids
    assert cached.hit_cap == full.hit_cap


def test_one_head_view_for_pruning_and_the_hf_adapter():
    from torch import nn

    from pipeline.adapters import attention, hf_vit
    from pipeline.pruning import heads

    assert heads.projections is attention.projections and heads.num_heads is attention.num_heads
    assert hf_vit.num_heads is attention.num_heads

    class HF(nn.Module):  # o_proj naming, no stated head count: q's width over head_dim
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(8, 8) for _ in range(4))
            self.head_dim = 2

    hf = HF()
    assert attention.num_heads(hf) == 4 and attention.projections(hf)[3] is hf.o_proj
    assert hf_vit.is_hf_attention(hf) and hf_vit.remove_hf_heads(hf, [1]) == [0, 2, 3]
    assert attention.num_heads(attention.ExplicitAttention(8, 2, 4)) == 2
    with pytest.raises(TypeError, match="no explicit q/k/v/out"):
        attention.projections(nn.Linear(2, 2))
