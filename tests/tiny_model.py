"""A tiny random latex-ocr-junia model of the real model's shape (2 encoder layers x 4 heads), a
corpus of templated formulas, and tiny Hugging Face VisionEncoderDecoder folders, for fast tests.
(No tests here: helpers the other test modules import.)"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

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


def tiny_hf_model(folder: Path, encoder: str = "vit", decoder: str = "trocr", seed: int = 0,
               image_size: tuple[int, int] = (32, 128), channels: int = 1, vocab: Sequence[str] | None = None) -> Path:
    """A small randomly initialised Hugging Face VisionEncoderDecoderModel of a supported pair, written
    as a save_pretrained folder (with its tokenizer.json and preprocessor_config.json)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import (DeiTConfig, MBartConfig, TrOCRConfig, ViTConfig, VisionEncoderDecoderConfig,
                              VisionEncoderDecoderModel)

    from pipeline.adapters.hf_vision_encoder_decoder import PREPROCESSOR, TOKENIZER

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    chars = list(vocab) if vocab is not None else list(
        "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ+-=()[]{}^_\\,.;:!|<>/*' ")
    table = {t: i for i, t in enumerate(specials + [c for c in dict.fromkeys(chars) if c not in specials])}
    tok = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    tok.save(str(folder / TOKENIZER))
    enc_cls = {"vit": ViTConfig, "deit": DeiTConfig}[encoder]
    enc = enc_cls(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  image_size=list(image_size), patch_size=8, num_channels=channels)
    common = dict(vocab_size=len(table), pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                  max_position_embeddings=256)
    if decoder == "gpt2":
        from transformers import GPT2Config

        dec = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_inner=64, n_positions=256, add_cross_attention=True,
                         is_decoder=True, tie_word_embeddings=False,
                         **{k: v for k, v in common.items() if k != "max_position_embeddings"})
    elif decoder == "trocr":
        dec = TrOCRConfig(d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64, **common)
    else:
        dec = MBartConfig(d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64,
                          encoder_layers=1, is_decoder=True, add_cross_attention=True, **common)
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = 2, 1, 2
    torch.manual_seed(seed)
    model = VisionEncoderDecoderModel(config=config).eval()
    with torch.no_grad():  # random weights that read something: a peaked output layer, EOS less likely
        head = model.decoder.get_output_embeddings()
        head.weight.mul_(8.0)
        head.weight[2].mul_(0.25)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / PREPROCESSOR).write_text(json.dumps({
        "image_processor_type": "ViTImageProcessor", "do_resize": True,
        "size": {"height": image_size[0], "width": image_size[1]}, "resample": 2, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5] * channels,
        "image_std": [0.5] * channels}, indent=2) + "\n")
    return folder
