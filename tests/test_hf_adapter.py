"""Hugging Face VisionEncoderDecoder models (issue 41): tiny random models built from configs (ViT +
TrOCR, DeiT + mBART, ViT + mBART, DeiT + GPT-2), read through the adapter, pruned for real, saved and read back,
exported and decoded by the packages token for token as torch decodes them; unsupported models end
in one line."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import run_cli

PAIRS = [("vit", "trocr"), ("deit", "mbart"), ("vit", "mbart"), ("deit", "gpt2")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from tiny_model import tiny_hf_model

    root = tmp_path_factory.mktemp("hf")
    return {pair: tiny_hf_model(root / "-".join(pair), *pair, seed=i) for i, pair in enumerate(PAIRS)}


def _images(adapter, n=3, seed=0):
    from pipeline.data.render import render_formula

    formulas = ["x^2+1", "\\frac{a}{b}", "e^{i\\pi}", "\\sqrt{y}"][:n]
    return torch.stack([adapter.preprocess(render_formula(f)) for f in formulas])


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "+".join(p))
def test_the_cached_decoder_computes_the_hf_decoder_and_greedy_reads_the_same(folders, pair):
    from pipeline.adapters.base import CachedDecoder, load_adapter

    adapter = load_adapter("hf_vision_encoder_decoder", str(folders[pair]))
    images = _images(adapter)
    with torch.no_grad():
        memory = adapter.encode(images)
        ids = torch.tensor([[adapter.bos_id, 5, 9, 7, 11]] * images.shape[0])
        full = adapter.decode_logits(ids, memory)  # the HF decoder itself
        cached = adapter.cached_decoder()
        assert isinstance(cached, CachedDecoder)
        cross = cached.cross_kv(memory)
        first, past = cached.run(ids[:, :2], [], cross, causal=True, every=True)
        step, past = cached.run(ids[:, 2:3], past, cross, causal=False)
        verify, _ = cached.run(ids[:, 3:], past, cross, causal=True, every=True)
    torch.testing.assert_close(first, full[:, :2], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(step, full[:, 2], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(verify, full[:, 3:], atol=1e-5, rtol=1e-4)
    plain = adapter.generate(images, max_length=12)
    kv = adapter.generate(images, max_length=12, use_cache=True)
    assert plain.token_ids == kv.token_ids
    assert max(len(t) for t in plain.token_ids) > 1  # the tiny model writes something before EOS


def test_heads_are_removed_for_real_and_the_saved_model_reads_the_same(folders, tmp_path):
    from pipeline.adapters.base import load_adapter

    adapter = load_adapter("hf_vision_encoder_decoder", str(folders[("vit", "trocr")]))
    images = _images(adapter, n=2)
    adapter.remove_encoder_heads({0: [1], 1: [0, 2]})
    assert adapter.encoder_head_counts() == [3, 2]
    attn = adapter.encoder_attention(1)
    assert attn.q_proj.out_features == 2 * attn.head_dim and attn.o_proj.in_features == 2 * attn.head_dim
    with torch.no_grad():
        before = adapter.encode(images)
    adapter.save(tmp_path / "pruned")
    again = load_adapter("hf_vision_encoder_decoder", str(tmp_path / "pruned"))
    assert again.encoder_head_counts() == [3, 2]
    with torch.no_grad():
        torch.testing.assert_close(again.encode(images), before)
    assert again.generate(images, 12, use_cache=True).token_ids == adapter.generate(images, 12, use_cache=True).token_ids
    with pytest.raises(NotImplementedError):  # no key pooling for HF attention: prune names it in one line
        again.pool_encoder_keys({0: [2, 2]})


@pytest.mark.parametrize("target,pair", [("ort_cpu", ("deit", "gpt2")), ("metax", ("deit", "mbart")),
                                         ("tensorrt", ("vit", "trocr"))])
def test_every_target_package_reads_token_for_token_as_torch(folders, tmp_path, target, pair):
    """The float package of each target (FP16 on metax: the same tokens on these images) decoded by the
    package runtime alone, against the adapter's KV-cached torch greedy."""
    from pipeline.adapters.base import load_adapter
    from pipeline.export.build import build_graphs
    from pipeline.export.package import write_package
    from pipeline.export.runtime import OnnxPackage
    from pipeline.export.targets import resolve_target, target_config
    from pipeline.data.render import render_formula

    adapter = load_adapter("hf_vision_encoder_decoder", str(folders[pair]))
    tgt = resolve_target(target_config(target))
    built = build_graphs(adapter, tgt, simplify=True, qdq_encoder=None, progress=lambda *_: None)
    assert not built.violations
    folder = tmp_path / target
    folder.mkdir()
    meta = write_package(folder, adapter, built, tgt, max_length=12)
    assert meta["tokenizer"]["kind"] == "hf"
    package = OnnxPackage(folder, threads=1)
    formulas = ["x^2+1", "\\frac{a}{b}", "e^{i\\pi}"]
    pil = [render_formula(f) for f in formulas]
    images = torch.stack([adapter.preprocess(im) for im in pil])
    np.testing.assert_allclose(np.stack([package.preprocess(im) for im in pil]), images.numpy(), atol=1e-6)
    torch_ids = adapter.generate(images, 12, use_cache=True).token_ids
    onnx = package.generate(images.numpy(), 12)
    assert onnx.token_ids == torch_ids
    assert onnx.texts == [adapter.decode_text(t) for t in torch_ids]


def _write(folder, config, weights="model.safetensors"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / weights).write_bytes(b"\0")
    for name in ("tokenizer.json", "preprocessor_config.json"):
        (folder / name).write_text("{}")
    return folder


def test_unsupported_models_end_in_one_line_saying_what_is_supported(folders, tmp_path):
    from pipeline.adapters.base import load_adapter
    from pipeline.errors import PipelineError

    good = json.loads((folders[("vit", "trocr")] / "config.json").read_text())
    swin = {**good, "encoder": {**good["encoder"], "model_type": "swin"}}
    remote = {**good, "auto_map": {"AutoModel": "modeling_mine.Mine"}}
    bert = {**good, "decoder": {**good["decoder"], "model_type": "bert"}}
    cases = {
        "swin encoder": (_write(tmp_path / "swin", swin), "unsupported model"),
        "remote code": (_write(tmp_path / "remote", remote), "remote code is never run"),
        "bert decoder": (_write(tmp_path / "bert", bert), "unsupported model"),
        "pickle only": (_write(tmp_path / "pickle", good, weights="pytorch_model.bin"), "pickle checkpoint"),
        "not a model": (_write(tmp_path / "other", {"model_type": "bert"}), "unsupported model"),
    }
    for what, (folder, says) in cases.items():
        with pytest.raises(PipelineError) as err:
            load_adapter("hf_vision_encoder_decoder", str(folder))
        text = str(err.value)
        assert says in text and "supported: a vision-encoder-decoder with a vit, deit or ijepa encoder and a trocr, mbart or gpt2 decoder" in text, what
        assert "\n" not in text, what
    with pytest.raises(PipelineError, match="set model.path"):
        load_adapter("hf_vision_encoder_decoder", "package")


@pytest.mark.slow
def test_a_pickle_checkpoint_is_refused_on_the_command_line_in_one_line(folders, tmp_path):
    folder = tmp_path / "pickled"
    shutil.copytree(folders[("vit", "trocr")], folder)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    proc = run_cli("stage=evaluate", "model=hf_vision_encoder_decoder", f"model.path={folder}",
                   f"artifacts.dir={tmp_path / 'a'}", "eval.limit=2", "progress=false")
    assert proc.returncode != 0
    last = [line for line in proc.stderr.strip().splitlines() if line.strip()][-1]
    assert "pickle checkpoint" in last and "model.safetensors" in last


@pytest.mark.slow
def test_stage_all_runs_the_chain_on_a_tiny_hf_model_and_writes_the_summary(folders, tmp_path, monkeypatch):
    """``stage=all model=hf_vision_encoder_decoder model.path=<folder>``: the default chain's settings
    (sizes shrunk as for the default model's test), every target exported from the pruned model with its
    INT8 encoder, each package token for token its torch model on the parity formulas."""
    from conftest import compose_cfg
    from pipeline.__main__ import run_stages
    from pipeline.context import StageContext
    from test_chain_default import SIZES, _corpus

    _corpus(monkeypatch)
    root = tmp_path / "artifacts"
    cfg = compose_cfg(["stage=all", "model=hf_vision_encoder_decoder", f"model.path={folders[('vit', 'trocr')]}",
                       f"artifacts.dir={root}", "progress=false", *SIZES])
    assert list(cfg.prune.key_pool_layers) == []  # the model's config turns key pooling off, nothing else
    done = run_stages(cfg, StageContext(cfg))
    assert {"prune", "tokenizer", "calibrate", "quantize", "export", "benchmark"} <= set(done)
    heads = json.loads((root / "prune" / "model" / "formula_compress.json").read_text())["encoder_heads"]
    assert sum(heads) == 4 + 4 - 2  # prune.num_heads=2 removed for real
    for target in cfg.export.targets:
        manifest = json.loads((root / f"export-{target}" / "manifest.json").read_text())
        assert manifest["metrics"]["tokens"]["identical"] == 1.0, target
        assert manifest["metrics"]["precision"]["encoder"].startswith("int8 qdq"), target
        assert json.loads((root / f"export-{target}" / "package.json").read_text())["tokenizer"]["kind"] == "hf"
    summary = (root / "summary.md").read_text()
    assert "deployable" in summary and "float-original" in summary


@pytest.mark.slow
def test_the_default_models_weights_map_onto_hf_classes_and_the_folder_reads_back(tmp_path):
    """junia -> I-JEPA encoder + mBART decoder (pipeline/adapters/junia_to_hf.py) on a tiny junia model: the
    decoder maps exactly (its logits on the same memory equal junia's), the encoder's distillation lowers
    its loss, and the written folder loads through the adapter with junia's canvas preprocessing."""
    from pipeline.adapters.base import load_adapter
    from pipeline.adapters.hf_vision_encoder_decoder import HfCachedDecoder
    from pipeline.adapters.junia_to_hf import distill_encoder, map_weights, write_folder
    from pipeline.data.render import render_formula
    from tiny_model import FORMULAS, build_tiny

    junia = build_tiny(d_model=176)  # wider than the vocabulary (166), as the real model (256): the bias folds
    c, h, w = junia.input_shape
    hf = map_weights(junia, torch.ones(c, h, w))
    images = torch.stack([junia.preprocess(render_formula(f)) for f in FORMULAS[:8]])
    with torch.no_grad():
        memory = junia.encode(images)
        ours, theirs = junia.cached_decoder(), HfCachedDecoder(hf.decoder, "pre").eval()
        ids = torch.tensor([[junia.bos_id, 10, 11, 12]] * len(images))
        a, _ = ours.run(ids, [], ours.cross_kv(memory), causal=True, every=True)
        b, _ = theirs.run(ids, [], theirs.cross_kv(memory), causal=True, every=True)
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)  # mBART's LayerNorm eps is 1e-5, junia's 1e-6
    def error() -> float:
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(hf.encoder(pixel_values=images).last_hidden_state, memory))

    before = error()
    distill_encoder(hf, junia, images, steps=20, batch_size=8, lr=3e-5)
    assert error() < 0.9 * before  # the folded embedding LayerNorm's error shrinks as the encoder learns
    folder = write_folder(hf, junia, tmp_path / "hf", {"distill_steps": 12})
    adapter = load_adapter("hf_vision_encoder_decoder", str(folder))
    assert adapter.preprocess_spec()["kind"] == "latex_ocr_junia.canvas"
    pil = render_formula(FORMULAS[0])
    torch.testing.assert_close(adapter.preprocess(pil), junia.preprocess(pil))
    assert adapter.vocabulary(str(folder)) == junia.vocabulary("package")[:junia.vocab_size] or \
        len(adapter.vocabulary(str(folder))) == junia.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(adapter.encode(images), hf.encoder(pixel_values=images).last_hidden_state)
    text = adapter.generate(images[:2], 10, use_cache=True).texts
    assert text == [adapter.decode_text(t) for t in adapter.generate(images[:2], 10).token_ids]
