"""A tiny random latex-ocr-junia model of the real model's shape (2 encoder layers x 4 heads), and a
corpus of templated formulas, for fast prune tests. (No tests here: helpers the other prune test
modules import.)"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

FORMULAS = ["x^2", "a+b", "\\frac{a}{b}", "\\alpha_i", "y=mx+c", "\\sqrt{x}", "e^{i\\pi}", "x_1+x_2",
            "\\sum_i a_i", "\\int f", "a-b", "\\beta^2", "z=x+y", "\\gamma", "k^n", "p_0", "\\theta",
            "m+n", "\\lambda x", "q^2-1", "f(x)", "\\sin x", "\\cos y", "u+v"]


def build_tiny(encoder_layers: int = 2, seed: int = 0, d_model: int = 32):
    from latex_ocr_junia.model import ModelConfig
    from latex_ocr_junia.tokenizer import LatexTokenizer

    from pipeline.adapters.attention import replace_mha
    from pipeline.adapters.latex_ocr_junia import LatexOcrJuniaAdapter, build_model_reference, package_assets

    tok_path = package_assets() / "tokenizer.json"
    tok = LatexTokenizer.load(tok_path)
    config = ModelConfig(image_height=32, image_width=64, patch_size=8, d_model=d_model, num_heads=4,
                         num_encoder_layers=encoder_layers, num_decoder_layers=1, mlp_dim=64, dropout=0.0,
                         max_length=64, vocab_size=tok.vocab_size, pad_token_id=tok.pad_id)
    torch.manual_seed(seed)
    ref = build_model_reference(config)
    with torch.no_grad():  # non-zero biases so bias handling is exercised
        for name, p in ref.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    replace_mha(ref)
    adapter = LatexOcrJuniaAdapter(ref, config, tok, tok_path)
    adapter.reference_state = state
    return adapter


SHIFT_FORMULAS = ["\\Gamma(z)", "\\binom{n}{k}", "n!", "\\zeta(s)", "\\log x", "\\delta_{ij}"]


def tiny_shift():
    from pipeline.data.corpus import Formula
    from pipeline.metrics import normalize

    return [Formula(f"s{i:03d}", t, normalize(t), "shift", "tests") for i, t in enumerate(SHIFT_FORMULAS)]


def tiny_corpus():
    from pipeline.data.corpus import Formula
    from pipeline.metrics import normalize

    splits = ["train", "train", "eval"]
    return [Formula(f"f{i:03d}", t, normalize(t), splits[i % 3], "tests") for i, t in enumerate(FORMULAS)]


def fake_ctx(artifacts_dir, overrides=None):
    """A StageContext whose corpus is :data:`FORMULAS` and shift split :data:`SHIFT_FORMULAS` (the real
    ones take minutes to build)."""
    from conftest import compose_cfg

    from pipeline.context import StageContext

    @dataclass
    class TinyCorpusContext(StageContext):
        formulas: list = field(default_factory=tiny_corpus)

        def corpus(self):
            return list(self.formulas)

        def shift_split(self):
            return tiny_shift()

        def split_hash(self, name):  # no corpus folder: the split's formulas stand for its file
            import hashlib

            return hashlib.sha256("\n".join(f.latex for f in self.split(name)).encode()).hexdigest()

    return TinyCorpusContext(compose_cfg([f"artifacts.dir={artifacts_dir}", "progress=false", *(overrides or [])]))
