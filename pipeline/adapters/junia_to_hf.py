"""The default model's weights as a Hugging Face VisionEncoderDecoderModel (I-JEPA-style ViT encoder +
mBART decoder), written as a ``save_pretrained`` folder the ``hf_vision_encoder_decoder`` adapter reads.

The decoder maps exactly: latex-ocr-junia's decoder is a pre-LN transformer with an embedding
LayerNorm and a final LayerNorm, which is mBART's decoder (learned positions at offset 2, no embedding
scale, GELU); its output layer's bias, which mBART's ``lm_head`` lacks, is folded into the final
LayerNorm's bias (``W b' = W b + c`` solved by least squares: exact while the output layer's rows are
independent). The encoder maps but for one op: junia normalises the patch embeddings (conv + position)
with a LayerNorm before the first block, which no HF ViT-family encoder has (``IJepaModel`` is ViT
without the CLS token, the closest). That LayerNorm is folded as an affine map with the mean and scale
of a blank patch (most of a formula canvas), and ``distill_encoder`` then trains the HF encoder to give
the junia encoder's memory (mean squared error on rendered train-split formulas): a bounded recipe,
not an exact map. ``python -m pipeline.adapters.junia_to_hf OUT [--steps N]`` runs both.

Nothing of the package is copied into this repository: the weights are read from the installed wheel
when the recipe runs.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from pipeline.errors import PipelineError


def _hf_model(mc) -> nn.Module:
    from transformers import IJepaConfig, MBartConfig, VisionEncoderDecoderConfig, VisionEncoderDecoderModel

    enc = IJepaConfig(hidden_size=mc.d_model, num_hidden_layers=mc.num_encoder_layers,
                      num_attention_heads=mc.num_heads, intermediate_size=mc.mlp_dim, hidden_act="gelu",
                      image_size=[mc.image_height, mc.image_width], patch_size=mc.patch_size, num_channels=1,
                      layer_norm_eps=1e-6, qkv_bias=True, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)
    dec = MBartConfig(vocab_size=mc.vocab_size, d_model=mc.d_model, decoder_layers=mc.num_decoder_layers,
                      decoder_attention_heads=mc.num_heads, decoder_ffn_dim=mc.mlp_dim, encoder_layers=1,
                      activation_function="gelu", max_position_embeddings=mc.max_length, scale_embedding=False,
                      dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, is_decoder=True,
                      add_cross_attention=True, pad_token_id=mc.pad_token_id, bos_token_id=1, eos_token_id=2,
                      decoder_start_token_id=1, tie_word_embeddings=False)
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = 1, mc.pad_token_id, 2
    config.tie_word_embeddings = False
    return VisionEncoderDecoderModel(config=config).eval()


def _copy(dst: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    dst.weight.copy_(weight)
    if bias is not None:
        dst.bias.copy_(bias)


def _attention(dst: nn.Module, src: nn.Module, out_name: str = "out_proj") -> None:
    """junia's ExplicitAttention (q/k/v/out Linears) into an HF attention module."""
    for name in ("q_proj", "k_proj", "v_proj"):
        _copy(getattr(dst, name), getattr(src, name).weight, getattr(src, name).bias)
    _copy(getattr(dst, out_name), src.out_proj.weight, src.out_proj.bias)


@torch.no_grad()
def map_weights(junia, blank: torch.Tensor) -> nn.Module:
    """The HF model with junia's weights (``junia``: the default adapter; ``blank``: one blank canvas,
    [1, H, W], whose patches set the folded embedding LayerNorm's mean and scale)."""
    src, mc = junia.model, junia.model_config
    hf = _hf_model(mc)
    # encoder: conv + positions, LayerNorm folded as an affine map (see the module's docstring)
    pe, emb = src.patch_embed, hf.encoder.embeddings
    e = pe.proj(blank[None].to(pe.proj.weight)).flatten(2).transpose(1, 2) + pe.pos_emb  # [1, N, D]
    mu, sigma = e.mean(-1, keepdim=True), (e.var(-1, unbiased=False, keepdim=True) + pe.norm.eps).sqrt()
    scale = pe.norm.weight / sigma.mean()  # one scale for every token (the conv's weights are shared)
    _copy(emb.patch_embeddings.projection, pe.proj.weight * scale.view(-1, 1, 1, 1), pe.proj.bias * scale)
    emb.position_embeddings.copy_((pe.pos_emb - mu) * scale + pe.norm.bias)
    for blk, layer in zip(src.encoder_blocks, hf.encoder.layers):
        _copy(layer.layernorm_before, blk.norm1.weight, blk.norm1.bias)
        _attention(layer.attention, blk.attn, "o_proj")
        _copy(layer.layernorm_after, blk.norm2.weight, blk.norm2.bias)
        _copy(layer.mlp.fc1, blk.mlp[0].weight, blk.mlp[0].bias)
        _copy(layer.mlp.fc2, blk.mlp[3].weight, blk.mlp[3].bias)
    _copy(hf.encoder.layernorm, src.encoder_norm.weight, src.encoder_norm.bias)
    # decoder: mBART's, exactly
    dec, demb = hf.decoder.model.decoder, src.decoder_embed
    dec.embed_tokens.weight.copy_(demb.token_emb.weight)
    dec.embed_positions.weight.zero_()
    dec.embed_positions.weight[2:2 + mc.max_length].copy_(demb.pos_emb.weight)
    _copy(dec.layernorm_embedding, demb.norm.weight, demb.norm.bias)
    for blk, layer in zip(src.decoder_blocks, dec.layers):
        _copy(layer.self_attn_layer_norm, blk.self_norm.weight, blk.self_norm.bias)
        _attention(layer.self_attn, blk.self_attn)
        _copy(layer.encoder_attn_layer_norm, blk.cross_norm.weight, blk.cross_norm.bias)
        _attention(layer.encoder_attn, blk.cross_attn)
        _copy(layer.final_layer_norm, blk.ffn_norm.weight, blk.ffn_norm.bias)
        _copy(layer.fc1, blk.ffn[0].weight, blk.ffn[0].bias)
        _copy(layer.fc2, blk.ffn[3].weight, blk.ffn[3].bias)
    head = src.lm_head
    lin = hf.decoder.get_output_embeddings()
    lin.weight.copy_(head.weight)
    # W (g*n + beta') = W (g*n + beta) + c  <=>  W beta' = W beta + c
    w64 = head.weight.double()
    fix = torch.linalg.lstsq(w64, head.bias.double()[:, None]).solution[:, 0]
    if (w64 @ fix - head.bias.double()).abs().max() > 1e-6:
        raise PipelineError("the output layer's bias cannot be folded into the final LayerNorm (dependent rows)")
    _copy(dec.layer_norm, src.decoder_norm.weight, src.decoder_norm.bias + fix.to(head.bias))
    return hf.eval()


def distill_encoder(hf: nn.Module, teacher, images: torch.Tensor, steps: int, batch_size: int = 8,
                    lr: float = 3e-4, seed: int = 0, progress: Callable[[int, float], None] | None = None) -> list[float]:
    """Train ``hf``'s encoder so its memory matches the teacher encoder's (MSE), the decoder untouched:
    AdamW, one-cycle learning rate peaking at ``lr``. ``images``: preprocessed canvases [N, 1, H, W]
    (train-split renders); returns the loss per step."""
    torch.manual_seed(seed)
    with torch.no_grad():
        targets = torch.cat([teacher.encode(images[i:i + 32]) for i in range(0, len(images), 32)])
    encoder = hf.encoder.train()
    opt = torch.optim.AdamW(encoder.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=max(0.05, 2.0 / steps))
    losses = []
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        idx = torch.randint(0, len(images), (batch_size,), generator=gen)
        out = encoder(pixel_values=images[idx]).last_hidden_state
        loss = torch.nn.functional.mse_loss(out, targets[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(step + 1, losses[-1])
    hf.eval()
    return losses


def tokenizer_json(junia, path: Path) -> None:
    """junia's char vocabulary as an HF ``tokenizers`` JSON (same ids; one char a token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    table = dict(junia.tokenizer.token_to_id)
    tok = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<pad>", "<bos>", "<eos>", "<unk>"])
    tok.save(str(path))


def write_folder(hf: nn.Module, junia, folder: Path, recipe: dict) -> Path:
    """``folder`` as the ``hf_vision_encoder_decoder`` adapter reads it: the HF config and safetensors
    weights, the tokenizer, an HF image processor config (for HF's own tools), and in
    ``formula_compress.json`` the preprocessing the weights were trained with (junia's canvas: the ink
    crop centred on a white canvas, which no HF image processor does)."""
    from pipeline.adapters.hf_vision_encoder_decoder import OWN, PREPROCESSOR, TOKENIZER, HfVisionEncoderDecoderAdapter

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer_json(junia, folder / TOKENIZER)
    c, h, w = junia.input_shape
    (folder / PREPROCESSOR).write_text(json.dumps({
        "image_processor_type": "ViTImageProcessor", "do_resize": True, "size": {"height": h, "width": w},
        "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": False,
        "image_mean": [0.0], "image_std": [1.0]}, indent=2) + "\n")
    (folder / OWN).write_text(json.dumps({"preprocess": junia.preprocess_spec()}) + "\n")
    adapter = HfVisionEncoderDecoderAdapter(hf, folder, json.loads(hf.config.to_json_string()))
    adapter.save(folder)
    (folder / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
    return folder


def main(argv: Sequence[str] | None = None) -> None:
    from pipeline.adapters.base import load_adapter

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=0, help="encoder distillation steps (0: the mapping alone)")
    parser.add_argument("--images", type=int, default=512, help="train-split formulas rendered for distillation")
    parser.add_argument("--corpus", type=Path, default=Path("artifacts"), help="artifacts.dir holding the corpus")
    args = parser.parse_args(argv)
    if args.out.exists():
        raise PipelineError(f"{args.out} exists: give a new folder")
    torch.manual_seed(0)
    junia = load_adapter("latex_ocr_junia", "package")
    c, h, w = junia.input_shape
    hf = map_weights(junia, torch.ones(c, h, w))
    recipe = {"from": "latex-ocr-junia", "encoder": "ijepa (embedding LayerNorm folded)", "decoder": "mbart (exact)",
              "distill_steps": args.steps}
    if args.steps:
        images = _train_canvases(junia, args.corpus, args.images)
        t0 = time.time()
        losses = distill_encoder(hf, junia, images, args.steps, progress=lambda s, l: print(
            f"step {s}/{args.steps} loss {l:.5f} ({time.time() - t0:.0f} s)", flush=True) if s % 20 == 0 else None)
        recipe.update(distill_images=len(images), first_loss=losses[0], last_loss=losses[-1],
                      distill_seconds=round(time.time() - t0, 1))
    tmp = args.out.with_name(f".tmp-{args.out.name}")  # the folder appears whole or not at all
    shutil.rmtree(tmp, ignore_errors=True)
    write_folder(hf, junia, tmp, recipe)
    tmp.rename(args.out)
    print(json.dumps(recipe))


def _train_canvases(junia, artifacts: Path, n: int) -> torch.Tensor:
    """The first ``n`` train-split formulas of the corpus under ``artifacts`` (built there when missing,
    as any stage does), rendered and preprocessed the way junia was trained."""
    from pipeline.context import StageContext
    from pipeline.data.render import render_inputs

    train = [(f.id, f.latex) for f in StageContext.compose(artifacts.resolve()).corpus() if f.split == "train"]
    images = [x for _, _, x in render_inputs(train, junia.preprocess, limit=n, desc="distillation formulas")]
    if not images:
        raise PipelineError(f"no renderable train-split formulas in the corpus under {artifacts}")
    return torch.stack(images)


if __name__ == "__main__":
    try:
        main()
    except PipelineError as exc:
        raise SystemExit(f"error: {exc}") from None
