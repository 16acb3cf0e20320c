"""The chain hands over: prune's model goes to quantize, quantize's graphs and model to export
(what ``stage=all`` runs in order), on the tiny model; an unchanged rerun reuses every stage."""
from __future__ import annotations

import json

import numpy as np
import pytest
from omegaconf import OmegaConf

from tiny_model import FORMULAS, build_tiny, fake_ctx

CHAIN = ["model.max_length=8", "model.batch_size=4",
         "prune.num_heads=2", "prune.eval_limit=2", "prune.score_images=2", "prune.refit_images=4",
         "prune.compare_random=false", "prune.latency_images=1", "prune.finetune_steps=2", "prune.finetune_images=4",
         "prune.finetune_varied=2",
         "quantize.calib_images=8", "quantize.search_images=8", "quantize.decoder_search_images=8",
         "quantize.sensitivity_images=2", "quantize.eval_limit=2", "quantize.latency_images=1",
         "quantize.anchors=false", "quantize.methods=[minmax]", "export.targets=[ort_cpu]",
         "export.parity_limit=2", "export.parity_images=1", "export.min_cosine=0", "export.min_snr_db=-100",
         "export.min_identical=0"]


def _chain(root, original, extra=()):
    from pipeline.stages import export, prune, quantize

    (root / "formulas.txt").write_text("\n".join(FORMULAS[:3]) + "\n")
    ctx = fake_ctx(root, [f"prune.model={original}", f"export.formulas={root / 'formulas.txt'}", *CHAIN, *extra])
    return {name: mod.run(OmegaConf.to_object(ctx.cfg[key]), ctx)
            for name, mod, key in (("prune", prune, "prune"), ("quantize", quantize, "quantize"),
                                   ("export", export, "export"))}


def _tiny_with_calib_set(root):
    """The tiny model saved under ``root`` and a calibration set of its renderings (what calibrate writes)."""
    import datasets

    from pipeline.data.render import render_formula

    original = root / "tiny-model"
    adapter = build_tiny()
    adapter.save(original)
    images = np.stack([adapter.preprocess(render_formula(f)).numpy() for f in FORMULAS]).astype(np.float32)
    datasets.Dataset.from_dict({"pixel_values": images, "text": FORMULAS}).save_to_disk(
        str(root / "calibrate" / "calib_set"))
    return original, adapter


@pytest.mark.slow
def test_prune_quantize_export_hand_over_and_an_unchanged_rerun_reuses(tmp_path, monkeypatch):
    from pipeline.export import steps

    original, adapter = _tiny_with_calib_set(tmp_path)
    baselines = ["quantize.original=true", "export.baselines=true",  # stage=all's thorough settings
                 "quantize.qat_steps=2", "quantize.qat_images=8",
                 "prune.key_pool_layers=[0]", "prune.key_pool=[2,2]"]  # layer 0 pooled: q/k/v split there
    decoded = []  # models whose torch parity reading was decoded (not handed over from another package)
    real = steps.token_parity
    monkeypatch.setattr(steps, "token_parity", lambda adapter, *a, reference=None, **k: (
        decoded.append(adapter) if reference is None else None) or real(adapter, *a, reference=reference, **k))
    first = _chain(tmp_path, original, baselines)
    assert len(decoded) == 2  # the pruned model's reading serves its float package, the original's its INT8 one
    assert first["quantize"]["config"]["model_ref"] == "prune"  # quantize.model=auto took prune's model
    pruned_heads = json.loads((tmp_path / "prune" / "model" / "config.json").read_text())["encoder_heads"]
    assert sum(pruned_heads) == sum(adapter.encoder_head_counts()) - 2
    pkg = tmp_path / "export-ort_cpu"
    manifest = json.loads((pkg / "manifest.json").read_text())
    assert manifest["config"]["model_ref"] == "prune"  # export.model=auto: the model quantize used
    assert manifest["inputs"]["model"] == first["quantize"]["inputs"]["model"]
    assert manifest["inputs"]["qdq_encoder"] == first["quantize"]["outputs"]["encoder.ort_cpu.qdq.onnx"]
    meta = json.loads((pkg / "package.json").read_text())
    assert meta["precision"]["encoder"].startswith("int8 qdq")
    # the INT8 verify graph is in the package, the drafter only on request (export.drafter, off by default)
    assert meta["graphs"]["decoder_verify"] == "decoder_verify.onnx" and "drafter" not in meta
    assert meta["precision"]["decoder_verify"] == meta["precision"]["decoder_step"]

    # quantize.original: the model prune started from, with the chain's plan; export.baselines packages it
    applied = json.loads((tmp_path / "quantize-original" / "manifest.json").read_text())
    assert applied["config"]["model_ref"] == str(original) and applied["config"]["plan"].endswith("quantize/plan.json")
    plans = [json.loads((tmp_path / q / "plan.json").read_text()) for q in ("quantize", "quantize-original")]
    # the pooled layer 0's q/k/v groups are the original's merged qkv_proj, every other group the same
    chain_groups = {g: p["precision"] for g, p in plans[0]["groups"].items()}
    qkv = [f"encoder_blocks.0.attn.{r}_proj" for r in "qkv"]
    assert {g: p["precision"] for g, p in plans[1]["groups"].items()} == {
        **{g: p for g, p in chain_groups.items() if g not in qkv},
        "encoder_blocks.0.attn.qkv_proj": "int8" if all(chain_groups[g] == "int8" for g in qkv) else "float"}
    assert plans[1]["carried"] == {"encoder_blocks.0.attn.qkv_proj": sorted(qkv)}
    assert plans[1]["note"].startswith("applied from") and "carried over" in plans[1]["note"]
    assert plans[0]["qat"] == plans[1]["qat"] == {"steps": 2, "lr": 2e-5, "images": 8}  # the original finetuned too
    assert "plan applied from" in (tmp_path / "quantize-original" / "report.md").read_text()
    int8 = json.loads((tmp_path / "export-ort_cpu-int8-original" / "manifest.json").read_text())
    assert int8["config"]["model_ref"] == str(original)
    assert int8["inputs"]["qdq_encoder"] == applied["outputs"]["encoder.ort_cpu.qdq.onnx"]
    floats = {n: json.loads((tmp_path / f"export-ort_cpu-float-{n}" / "manifest.json").read_text())["config"]["model_ref"]
              for n in ("original", "chain")}
    assert floats == {"original": str(original), "chain": "prune"}
    assert set(first["export"]) == {"ort_cpu", "export-ort_cpu-float-original", "export-ort_cpu-float-chain",
                                    "export-ort_cpu-int8-original"}

    again = _chain(tmp_path, original, baselines)
    for stage in ("prune", "quantize"):
        assert again[stage]["key"] == first[stage]["key"], stage
    assert json.loads((tmp_path / "quantize-original" / "manifest.json").read_text())["key"] == applied["key"]
    assert {n: m["key"] for n, m in again["export"].items()} == {n: m["key"] for n, m in first["export"].items()}
    assert first["export"]["ort_cpu"]["key"] == manifest["key"]


@pytest.mark.slow
def test_with_distill_in_the_chain_quantize_and_export_take_the_bpe_student(tmp_path):
    """``distill.in_chain=true``: prune -> distill -> quantize -> export, the package speaks the BPE."""
    from pipeline.stages import distill, export, prune, quantize
    from pipeline.tokenization.atoms import normalize_formula
    from pipeline.adapters.latex_ocr_junia import char_vocabulary as model_char_vocabulary
    from pipeline.tokenization.train import SPECIALS, train_formula_bpe

    original, _ = _tiny_with_calib_set(tmp_path)
    extra = [t for t in model_char_vocabulary().token_to_id if t not in SPECIALS]
    (tmp_path / "tokenizer").mkdir()
    train_formula_bpe([normalize_formula(f) for f in FORMULAS * 3], 400, extra_atoms=extra).tokenizer.save(
        str(tmp_path / "tokenizer" / "tokenizer.json"))
    (tmp_path / "formulas.txt").write_text("\n".join(FORMULAS[:3]) + "\n")
    ctx = fake_ctx(tmp_path, [f"prune.model={original}", f"export.formulas={tmp_path / 'formulas.txt'}", *CHAIN,
                              "distill.in_chain=true", "distill.steps=2", "distill.batch=4", "distill.templated=0",
                              "distill.varied=0", "distill.eval_images=2", "distill.eval_every=0"])
    done = {name: mod.run(OmegaConf.to_object(ctx.cfg[name]), ctx)
            for name, mod in (("prune", prune), ("distill", distill), ("quantize", quantize), ("export", export))}
    assert done["distill"]["config"]["model_ref"] == "prune"      # the student of the pruned model
    assert done["quantize"]["config"]["model_ref"] == "distill"   # quantize took the student
    pkg = tmp_path / "export-ort_cpu"
    assert json.loads((pkg / "manifest.json").read_text())["config"]["model_ref"] == "distill"
    meta = json.loads((pkg / "package.json").read_text())
    assert meta["tokenizer"]["kind"] == "bpe" and meta["precision"]["encoder"].startswith("int8 qdq")
    assert (pkg / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer" / "tokenizer.json").read_bytes()


def test_baselines_are_the_original_and_the_chain_model_in_float_and_the_original_with_the_plan(tmp_path, monkeypatch):
    """``export.baselines``: the float ort_cpu package of the original (the model prune started from)
    and, when the chain has a model (prune's here), that model in float and, when quantize wrote
    it, the original model quantized with the chain's plan."""
    from pipeline.stages import export

    made = []
    monkeypatch.setattr(export, "_run_one", lambda cfg, ctx, tcfg, refs=None, drafts=None: made.append(
        (cfg.name, cfg.model, cfg.quantized)) or {})
    ctx = fake_ctx(tmp_path, ["export.targets=[ort_cpu]", "export.baselines=true"])
    export.run(OmegaConf.to_object(ctx.cfg.export), ctx)
    assert made == [(None, "auto", "auto"), (export.FLOAT_BASELINE, "original", "none")]  # no chain model yet
    (tmp_path / "prune" / "model").mkdir(parents=True)
    (tmp_path / "prune" / "model" / "config.json").write_text("{}")
    (tmp_path / "prune" / "manifest.json").write_text(json.dumps({"config": {"model": "my-model"}}))
    made.clear()
    export.run(OmegaConf.to_object(ctx.cfg.export), ctx)
    assert made[1:] == [(export.FLOAT_BASELINE, "my-model", "none"), (export.FLOAT_CHAIN, "prune", "none")]
    (tmp_path / export.QUANTIZE_ORIGINAL).mkdir()
    (tmp_path / export.QUANTIZE_ORIGINAL / "manifest.json").write_text("{}")
    made.clear()
    export.run(OmegaConf.to_object(ctx.cfg.export), ctx)
    assert made[3:] == [(export.INT8_ORIGINAL, "my-model", str(tmp_path / export.QUANTIZE_ORIGINAL))]


def test_a_shorter_parity_reading_is_the_first_whole_batches_of_a_longer_one():
    from pipeline.adapters.base import DecodeResult
    from pipeline.export.parity import reused_reference

    ref = DecodeResult([[1], [2], [3], [4]], ["a", "b", "c", "d"], 1.0, 2.0, [1, 1, 1, 1], [False] * 4)
    refs = {("m", ("f1", "f2", "f3", "f4"), 8, 2): ref}
    short = reused_reference(refs, ("m", ("f1", "f2"), 8, 2))
    assert short.token_ids == [[1], [2]] and short.texts == ["a", "b"] and short.steps == [1, 1]
    assert reused_reference(refs, ("m", ("f1", "f2", "f3", "f4"), 8, 2)) is ref
    assert reused_reference(refs, ("m", ("f1",), 8, 2)) is None            # not whole batches: batch 1 differs
    assert reused_reference(refs, ("m", ("f2", "f3"), 8, 2)) is None       # not the first formulas
    assert reused_reference(refs, ("other", ("f1", "f2"), 8, 2)) is None   # another model
    assert reused_reference(refs, ("m", ("f1", "f2"), 16, 2)) is None      # another cap
