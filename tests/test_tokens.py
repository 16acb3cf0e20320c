"""Token reduction: the policy (blank, full, typical images; batches; bad indices), the default family's
encoder on the kept tokens, and the exported encoder with its ``keep`` input against its torch model."""
from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from tiny_model import FORMULAS, build_tiny, fake_ctx

from pipeline.errors import PipelineError
from pipeline.tokens.policy import FRAME, INK, NEIGHBOUR, TokenPolicy, for_grid

POLICY = for_grid(16, 64, 8)


def _formula_image(latex: str) -> np.ndarray:
    from pipeline.adapters.latex_ocr_junia import place_on_canvas, to_grey
    from pipeline.data.render import render_formula

    canvas = place_on_canvas(to_grey(render_formula(latex)), 128, 512)
    return (np.asarray(canvas, dtype=np.float32) / 255.0)[None]


def test_a_blank_image_keeps_the_floor_and_an_inked_one_keeps_all():
    blank = np.ones((1, 128, 512), np.float32)
    keep = POLICY.keep(blank)
    assert keep.size == POLICY.buckets[0] == 128 and keep.dtype == np.int64
    assert (np.diff(keep) > 0).all() and keep.min() >= 0 and keep.max() < 1024
    noise = np.random.default_rng(0).random((1, 128, 512), dtype=np.float32)  # ink everywhere: a photo
    assert POLICY.keep(noise).tolist() == list(range(1024))


def test_a_formula_keeps_its_ink_its_neighbours_and_the_frame_up_to_a_bucket():
    image = _formula_image(r"\frac{a}{b}+x^{2}")
    ranks = POLICY.ranks(image)
    ink = np.flatnonzero(ranks == INK)
    assert 0 < ink.size < 200
    keep = POLICY.keep(image)
    assert keep.size in POLICY.buckets and keep.size >= (ranks <= FRAME).sum()
    assert set(ink) <= set(keep) and set(np.flatnonzero(ranks == NEIGHBOUR)) <= set(keep)
    # the darkest pixel decides: a patch the formula never touches is not ink
    patches = image[0].reshape(16, 8, 64, 8).min(axis=(1, 3)).reshape(-1)
    assert (patches[ink] < 250 / 255).all() and (patches[np.flatnonzero(ranks != INK)] >= 250 / 255).all()


def test_a_batch_tops_up_shorter_rows_with_their_own_real_patches():
    images = np.stack([np.ones((1, 128, 512), np.float32), _formula_image(r"\sum_{i=1}^{n} i^{2} = \frac{n(n+1)(2n+1)}{6}")])
    keep = POLICY.keep_batch(images)
    alone = [POLICY.keep(im) for im in images]
    assert keep.shape == (2, max(a.size for a in alone))
    for row, own in zip(keep, alone):
        assert set(own) <= set(row) and len(set(row.tolist())) == row.size  # its own first, no repeats


def test_training_batches_hold_one_bucket_each_so_a_row_reads_what_it_keeps_alone():
    blank = np.ones((1, 128, 512), np.float32)
    formula = _formula_image(r"\sum_{i=1}^{n} i^{2} = \frac{n(n+1)(2n+1)}{6}")
    noise = np.random.default_rng(0).random((1, 128, 512), dtype=np.float32)
    images = np.stack([blank, formula, noise, blank, formula, blank, blank])
    order = [6, 2, 0, 4, 1, 3, 5]
    out = POLICY.batches_by_bucket(images, order, 2)
    assert len(out) % 2 == 0 and set(out) == set(order)  # every image, runs of whole batches
    for run in (out[j:j + 2] for j in range(0, len(out), 2)):
        counts = {POLICY.count(POLICY.ranks(images[i])) for i in run}
        assert len(counts) == 1 and POLICY.keep_batch(images[run]).shape[1] == counts.pop()  # no top-up
    assert out[:2] == [6, 0] and out == POLICY.batches_by_bucket(images, order, 2)  # as the order came; same again


def test_a_reading_batches_images_of_one_bucket_so_each_reads_what_it_keeps_alone():
    from pipeline.tokens.policy import grouped_batches, reading_batches

    blank = np.ones((1, 128, 512), np.float32)
    formula = _formula_image(r"\sum_{i=1}^{n} i^{2} = \frac{n(n+1)(2n+1)}{6}")
    noise = np.random.default_rng(0).random((1, 128, 512), dtype=np.float32)
    images = np.stack([noise, blank, formula, blank, noise, blank])
    runs = reading_batches(images, 2, POLICY)
    assert sorted(i for run in runs for i in run) == list(range(6)) and all(len(run) <= 2 for run in runs)
    assert [run[0] for run in runs] == sorted(run[0] for run in runs)  # in the order images came
    for run in runs:
        assert POLICY.keep_batch(images[run]).shape[1] == POLICY.keep(images[run[0]]).size  # nothing topped up
    assert reading_batches(images, 4) == [[0, 1, 2, 3], [4, 5]]  # no policy: consecutive
    assert grouped_batches(["a", "b", "a", "a", "b"], 2) == [[0, 2], [1, 4], [3]]


def test_indices_that_do_not_fit_are_one_error_and_settings_are_checked():
    with pytest.raises(PipelineError, match="outside the image's 1024 patches"):
        POLICY.check(np.array([[0, 1024]]), 1)
    with pytest.raises(PipelineError, match="do not fit a batch of 2"):
        POLICY.check(np.array([[0, 1]]), 2)
    with pytest.raises(PipelineError, match="must rise strictly"):
        TokenPolicy(16, 64, 8, buckets=(256, 128))
    with pytest.raises(PipelineError, match="not the policy's 16x64"):
        POLICY.keep(np.ones((1, 64, 64), np.float32))
    assert for_grid(4, 4, 8, {"buckets": [8, 4096]}).buckets == (8, 16)  # cut to the image's patches


def test_a_narrowing_policy_keeps_by_rank_and_lets_the_filler_skip_the_later_layers():
    narrow = for_grid(16, 64, 8, {"narrow_from": 2, "narrow_by": 128, "buckets": [256, 384, 1024]})
    image = _formula_image(r"\frac{a}{b}+x^{2}")
    keep, ranks = narrow.keep(image), narrow.ranks(image)
    wanted = int((ranks <= FRAME).sum())
    assert keep.size == narrow.count(ranks) == min(b for b in (256, 384, 1024) if b - 128 >= wanted)
    assert set(keep.tolist()) <= set(range(1024)) and len(set(keep.tolist())) == keep.size
    assert (np.diff(ranks[keep]) >= 0).all() and ranks[keep[0]] == INK  # by rank: ink first
    assert (ranks[keep[:narrow.narrowed(keep.size)]] <= FRAME).sum() == wanted  # all of them go on
    assert narrow.keep_batch(image[None])[0].tolist() == keep.tolist()
    for bad, message in [({"narrow_from": 2}, "both 0"), ({"narrow_from": 2, "narrow_by": 128, "buckets": [128]},
                                                            "below the smallest bucket 128")]:
        with pytest.raises(PipelineError, match=message):
            for_grid(16, 64, 8, bad)
    adapter = build_tiny()
    with pytest.raises(PipelineError, match="narrow_from=9, but the encoder has"):
        adapter.set_token_policy({"buckets": [8, 16], "narrow_from": 9, "narrow_by": 4})
    adapter.set_token_policy({"buckets": [8, 16], "narrow_from": 1, "narrow_by": 4})
    images, keep = torch.rand(2, *adapter.input_shape), torch.arange(16)[None].repeat(2, 1)
    seen = []
    adapter.model.encoder_blocks[1].register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1]))
    with torch.no_grad():  # layer 1 reads the first 12; the last 4 skip it and join the memory as they were
        memory = adapter.encode_kept(images, keep)
        pe = adapter.model.patch_embed  # keep: the first 16 patches, in order
        layer0 = adapter.model.encoder_blocks[0](pe.norm(pe.proj(images).flatten(2).transpose(1, 2) + pe.pos_emb)[:, :16])
    assert seen == [12] and memory.shape[1] == 16
    assert torch.allclose(memory[:, 12:], adapter.model.encoder_norm(layer0[:, 12:]), atol=1e-5)


def test_the_encoder_on_every_token_kept_equals_the_full_encoder():
    adapter = build_tiny()
    images = torch.rand(2, *adapter.input_shape)
    grid = adapter.token_grid()
    assert grid is not None
    everything = torch.arange(grid[0] * grid[1])[None].repeat(2, 1)
    with torch.no_grad():
        assert torch.allclose(adapter.encode_kept(images, everything), adapter.model.encode(images), atol=1e-5)
        some = everything[:, ::3]
        assert adapter.encode_kept(images, some).shape[1] == some.shape[1]


def stand_for(keep: np.ndarray, grid_h: int, grid_w: int) -> np.ndarray:
    """The counts proportional attention weighs kept patches by, written apart in numpy (the oracle): each
    kept patch stands for itself and every patch whose nearest kept patch it is, the first of a tie."""
    yy, xx = np.divmod(np.arange(grid_h * grid_w), grid_w)
    ky, kx = np.divmod(np.asarray(keep), grid_w)
    owner = ((yy[:, None] - ky[..., None, :]) ** 2 + (xx[:, None] - kx[..., None, :]) ** 2).argmin(-1)
    return (owner[..., None] == np.arange(keep.shape[-1])).sum(-2)


def test_a_kept_patch_stands_for_itself_and_the_dropped_patches_nearest_it():
    from pipeline.adapters.attention import stand_for as in_torch

    keep = np.array([[0, 3, 60, 1023], [5, 6, 7, 8]])
    counts = in_torch(torch.from_numpy(keep), 16, 64).long().numpy()
    assert counts.sum(-1).tolist() == [1024, 1024] and (counts >= 1).all()
    assert in_torch(torch.arange(1024)[None], 16, 64).tolist() == [[1] * 1024]  # every patch kept: each stands for one
    # a 1x4 grid keeping patches 0 and 3: patch 1 is nearest 0, patch 2 nearest 3
    assert in_torch(torch.tensor([[0, 3]]), 1, 4).tolist() == [[2, 2]]
    assert in_torch(torch.tensor([[0, 2]]), 1, 3).tolist() == [[2, 1]]  # patch 1: a tie, the first kept one
    rng = np.random.default_rng(0)
    many = np.stack([np.sort(rng.choice(1024, 300, replace=False)) for _ in range(2)])
    assert in_torch(torch.from_numpy(many), 16, 64).long().numpy().tolist() == stand_for(many, 16, 64).tolist()
    proportional = for_grid(16, 64, 8, {"proportional": True})
    assert proportional.to_dict()["proportional"] is True and "proportional" not in POLICY.to_dict()
    assert TokenPolicy.from_dict(proportional.to_dict()) == proportional
    with pytest.raises(PipelineError, match="proportional attention and narrowing"):
        for_grid(16, 64, 8, {"proportional": True, "narrow_from": 2, "narrow_by": 64, "buckets": [128, 1024]})


def test_proportional_attention_reads_the_kept_patches_as_the_whole_grid_where_dropped_ones_repeat_them():
    """A blank image whose dropped patches carry their nearest kept patch's position: every dropped token is a
    copy of a kept one, so the whole encoder's memory at the kept patches is what the kept ones read when each
    weighs as the patches it stands for, and not what they read without the weights."""
    adapter = build_tiny()
    rows, cols, _ = adapter.token_grid()
    keep = torch.tensor([[0, 5, 9, 17, rows * cols - 1]])
    yy, xx = np.divmod(np.arange(rows * cols), cols)
    ky, kx = np.divmod(keep.numpy()[0], cols)
    owner = ((yy[:, None] - ky) ** 2 + (xx[:, None] - kx) ** 2).argmin(1)
    pe = adapter.model.patch_embed
    with torch.no_grad():
        pe.pos_emb.copy_(pe.pos_emb[:, keep[0][owner]])
    images = torch.ones(1, *adapter.input_shape)
    with torch.no_grad():
        whole = adapter.model.encode(images)[:, keep[0]]
        adapter.set_token_policy({"buckets": [5, rows * cols]})
        plain = adapter.encode_kept(images, keep)
        adapter.set_token_policy({"buckets": [5, rows * cols], "proportional": True})
        weighed = adapter.encode_kept(images, keep)
        assert torch.allclose(weighed, whole, atol=1e-5) and not torch.allclose(plain, whole, atol=1e-3)
        every = torch.arange(rows * cols)[None]  # every patch kept: the weights are all one, nothing changes
        assert torch.allclose(adapter.encode_kept(images, every), adapter.model.encode(images), atol=1e-5)


def test_a_family_whose_attention_takes_no_bias_refuses_proportional_attention_in_one_line(tmp_path):
    from tiny_model import tiny_hf_model

    from pipeline.adapters.hf_vision_encoder_decoder import HfVisionEncoderDecoderAdapter

    adapter = HfVisionEncoderDecoderAdapter.load(str(tiny_hf_model(tmp_path / "vit")))
    adapter.set_token_policy({"buckets": [8, 16]})  # it reads a subset ...
    with pytest.raises(PipelineError, match="proportional attention needs an encoder attention that takes a bias"):
        adapter.set_token_policy({"buckets": [8, 16], "proportional": True})  # ... but cannot weigh it


@pytest.mark.parametrize("narrowing", [{}, {"narrow_from": 1, "narrow_by": 4}, {"proportional": True}],
                         ids=["plain", "narrowed", "proportional"])
def test_a_model_with_a_policy_saves_it_exports_a_keep_input_and_its_package_reads_as_torch(tmp_path, narrowing):
    from pipeline.adapters.latex_ocr_junia import LatexOcrJuniaAdapter
    from pipeline.data.render import render_formula
    from pipeline.export.runtime import OnnxPackage
    from pipeline.stages import export

    adapter = build_tiny()
    adapter.set_token_policy({"buckets": [8, 16, 32, adapter.token_grid()[0] * adapter.token_grid()[1]],
                              "frame_stride": 2, **narrowing})
    adapter.save(tmp_path / "tiny-tokens")
    loaded = LatexOcrJuniaAdapter.load(str(tmp_path / "tiny-tokens"))
    assert loaded.token_policy == adapter.token_policy
    (tmp_path / "formulas.txt").write_text("\n".join(FORMULAS[:4]) + "\n")
    ctx = fake_ctx(tmp_path, [f"export.model={tmp_path / 'tiny-tokens'}", "export.quantized=none",
                              f"export.formulas={tmp_path / 'formulas.txt'}", "model.max_length=8",
                              "export.parity_images=2", "export.parity_limit=2", "export.min_identical=0",
                              "export.drafter=none", "export.targets=[ort_cpu,tensorrt,metax]"])
    export.run(OmegaConf.to_object(ctx.cfg.export), ctx)  # each target validated by its own rules
    for target in ("tensorrt", "metax"):
        other = json.loads((tmp_path / f"export-{target}" / "package.json").read_text())
        assert other["io"]["encoder"]["inputs"] == ["images", "keep"] and other["token_policy"]
    from pipeline.export.tensorrt import profiles

    shapes = profiles(json.loads((tmp_path / "export-tensorrt" / "package.json").read_text()), 4, 8)
    assert shapes["encoder"]["keep"] == ((1, 8), (1, 16), (4, adapter.token_policy.buckets[-1]))
    assert [shape[1] for shape in shapes["decoder_first"]["memory"]] == [8, 16, adapter.token_policy.buckets[-1]]
    folder = tmp_path / "export-ort_cpu"
    meta = json.loads((folder / "package.json").read_text())
    assert meta["token_policy"] == adapter.token_policy.to_dict()
    if adapter.token_policy.proportional:  # the weights are computed in the graph and fused as MHA's attention_bias
        import onnx

        nodes = onnx.load(str(folder / "encoder.onnx")).graph.node
        mha = [n for n in nodes if n.op_type == "MultiHeadAttention"]
        assert mha and not any(n.op_type == "Softmax" for n in nodes) and all(len(n.input) == 6 and n.input[5] for n in mha)
    assert meta["io"]["encoder"]["inputs"] == ["images", "keep"]
    package = OnnxPackage(folder, threads=1)
    images = np.stack([package.preprocess(render_formula(f)) for f in FORMULAS[:3]]).astype(np.float32)
    keep = adapter.token_policy.keep_batch(images)
    with torch.no_grad():
        ref = loaded.encode_kept(torch.from_numpy(images), torch.from_numpy(keep)).numpy()
    got = package.encode(images)
    assert got.shape == ref.shape and np.abs(got - ref).max() < 1e-4
    every = np.argsort(-np.arange(adapter.token_policy.num_patches))[None].repeat(3, 0)  # another count, order
    with torch.no_grad():  # (a narrowing's split is computed from the count in the graph, not traced in)
        ref = loaded.encode_kept(torch.from_numpy(images), torch.from_numpy(every)).numpy()
    assert np.abs(package.encode(images, every) - ref).max() < 1e-4
    with torch.no_grad():
        want = loaded.generate(torch.from_numpy(images), max_length=8, batch_size=3, use_cache=True).token_ids
    package.tokens_kept.clear()
    assert package.generate(images, 8, batch_size=3).token_ids == want
    own = [package.token_policy.keep(im).size for im in images]  # a batch holds one bucket: no top-up
    assert package.tokens_kept == {k: own.count(k) for k in set(own)}
    alone = [package.generate(im[None], 8, batch_size=1).token_ids[0] for im in images]
    assert alone == want  # a reading does not depend on what else its batch held
    with pytest.raises(PipelineError, match="outside the image"):
        package.encode(images[:1], np.array([[0, 10**6]]))
    from pipeline.benchmarking.rows import tokens_kept
    from pipeline.benchmarking.summary import _kept
    from pipeline.benchmarking.variants import PACKAGE, Variant

    v = Variant("tokens", PACKAGE, str(folder), 1, package.generate, {}, package)
    kept = tokens_kept(v, loaded, images)  # each image's own count, before a batch tops it up
    assert kept["n"] == 3 and kept["mean"] == np.mean([package.token_policy.keep(im).size for im in images])
    assert _kept(kept) == f"{kept['mean']:.0f} / {kept['p95']:.0f}" and _kept(None) == "all"
    # a policy package is format v2 (a v1 runtime would not feed "keep"); a format this runtime does not
    # know is refused by stage=infer in one line, exit 2
    from conftest import run_cli

    assert meta["format"] == "formula-compress onnx package v2"
    (tmp_path / "img.png").write_bytes(b"")
    render_formula("x^2").save(tmp_path / "img.png")
    meta["format"] = "formula-compress onnx package v9"
    (folder / "package.json").write_text(json.dumps(meta))
    done = run_cli("stage=infer", f"infer.package={folder}", f"infer.image={tmp_path / 'img.png'}",
                   f"artifacts.dir={tmp_path}")
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("error: package ")
    assert "format 'formula-compress onnx package v9' is not one this runtime reads" in done.stderr


PRUNE_FAST = ["model.max_length=8", "model.batch_size=4", "prune.eval_limit=4", "prune.score_images=2",
              "prune.refit_images=4", "prune.finetune_steps=2", "prune.finetune_images=4", "prune.finetune_varied=2",
              "prune.finetune_batch=2", "prune.latency_images=1", "prune.compare_random=false"]


def _prune(root, folder, *overrides):
    from pipeline.stages import prune

    ctx = fake_ctx(root, [f"prune.model={folder}", *PRUNE_FAST, *overrides])
    return ctx, prune.run(OmegaConf.to_object(ctx.cfg.prune), ctx)


def test_prune_tokens_recovers_the_model_to_read_its_kept_tokens_and_saves_the_policy(tmp_path, monkeypatch):
    from pipeline.pruning import recover

    trained_with = []
    finetune = recover.finetune
    monkeypatch.setattr(recover, "finetune", lambda student, *a, **k: (
        trained_with.append(student.token_policy.buckets), finetune(student, *a, **k))[1])
    build_tiny().save(tmp_path / "tiny")
    ctx, manifest = _prune(tmp_path, tmp_path / "tiny", "prune.num_heads=0",
                           "prune.tokens.enabled=true", "prune.tokens.train_buckets=[8,32]",
                           "prune.tokens.buckets=[8,16,32]", "prune.tokens.frame_stride=2")
    assert trained_with == [(8, 32)]  # the finetune's batches: the training buckets; the model keeps its own
    assert manifest["config"]["tokens"]["train_buckets"] == [8, 32]
    m = manifest["metrics"]
    assert m["token_policy"]["buckets"] == [8, 16, 32] and m["token_policy"]["frame_stride"] == 2
    assert len(m["recovery"]["rounds"]) == 1 and m["recovery"]["rounds"][0]["finetune"]["steps"] == 2
    assert m["reload_identical"] is True and manifest["config"]["tokens"]["buckets"] == [8, 16, 32]
    model = ctx.load_model("prune")
    assert model.token_policy is not None and model.token_policy.buckets == (8, 16, 32)
    blank = torch.ones(1, *model.input_shape)
    assert model.encode(blank).shape[1] == 8  # a blank image: the floor


def test_prune_saves_a_proportional_policy_without_a_recovery_and_the_key_only_when_it_is_on(tmp_path):
    build_tiny().save(tmp_path / "tiny")
    policy = ["prune.num_heads=0", "prune.tokens.enabled=true", "prune.tokens.buckets=[8,16]",
              "prune.tokens.frame_stride=2", "prune.recovery=false"]
    ctx, manifest = _prune(tmp_path, tmp_path / "tiny", *policy, "prune.tokens.proportional=true")
    assert manifest["config"]["tokens"]["proportional"] is True
    model = ctx.load_model("prune")
    assert model.token_policy.proportional and model.encode(torch.ones(1, *model.input_shape)).shape[1] == 8
    _, plain = _prune(tmp_path / "plain", tmp_path / "tiny", *policy)
    assert "proportional" not in plain["config"]["tokens"]  # earlier policy artifacts keep their keys


def test_qat_finetunes_a_policy_model_against_itself_at_the_tokens_both_keep():
    """QAT's teacher is the float model with the same policy: its memory is already at the kept tokens (the
    prune recovery's teacher reads every token and is gathered); a teacher keeping other tokens is refused."""
    from pipeline.pruning import recover
    from pipeline.quantization import qat

    adapter = build_tiny()
    adapter.set_token_policy({"buckets": [8, 16, 32], "frame_stride": 2})
    blank = torch.ones(1, *adapter.input_shape)
    corner = blank.clone()
    corner[..., :8, :16] = torch.rand(1, 8, 16)  # ink in 2 of 32 patches: a short bucket, not every patch
    images = torch.cat([blank, corner, blank, corner])
    kept = {adapter.keep_indices(im[None]).shape[1] for im in images}
    assert max(kept) < 32  # the tokens kept are a subset, so a second gather would index past them
    finetuned, report = qat.finetuned_copy(adapter, images, images, steps=2, batch_size=2, max_length=6)
    assert report["steps"] == 2 and finetuned.token_policy == adapter.token_policy
    other = adapter.clone()
    other.set_token_policy({"buckets": [16, 32]})
    with pytest.raises(ValueError, match="must keep the student's"):
        recover.finetune(other, adapter, images, [""] * 4, steps=1, minutes=1, targets=[[1, 2]] * 4)


@pytest.mark.parametrize("override, message", [
    ("prune.key_pool_layers=[0] prune.key_pool=[2,2] prune.tokens.enabled=true",
     "needs every encoder layer's keys unpooled"),
    ("prune.tokens.enabled=true prune.tokens.buckets=[0,16]", r"within 1..32 \(the image.s patches\)"),
    ("prune.tokens.enabled=true prune.tokens.dilate=-1", "dilate=-1, frame_stride=4 must be >= 0"),
])
def test_a_token_policy_the_model_cannot_read_with_is_one_error_before_the_work(tmp_path, override, message):
    build_tiny().save(tmp_path / "tiny")
    with pytest.raises(PipelineError, match=message):
        _prune(tmp_path, tmp_path / "tiny", "prune.num_heads=1", *override.split())
    assert not [p for p in tmp_path.glob("prune*")]


@pytest.mark.slow
def test_the_chain_hands_a_token_policy_from_prune_through_quantize_to_every_targets_package(tmp_path):
    """prune.tokens on: quantize calibrates, searches and finetunes through the kept tokens (its readers feed
    the encoder's keep input), and each target's package reads the INT8 encoder with the policy. The MLPs are
    narrowed too (prune.mlp_ratio): the narrower projections go through QAT and INT8 to every target."""
    from test_chain import CHAIN, _tiny_with_calib_set

    from pipeline.export.runtime import OnnxPackage
    from pipeline.stages import export, prune, quantize

    original, _ = _tiny_with_calib_set(tmp_path)
    (tmp_path / "formulas.txt").write_text("\n".join(FORMULAS[:3]) + "\n")
    ctx = fake_ctx(tmp_path, [f"prune.model={original}", f"export.formulas={tmp_path / 'formulas.txt'}", *CHAIN,
                              "prune.tokens.enabled=true", "prune.tokens.buckets=[8,16,32]", "prune.mlp_ratio=0.5",
                              "quantize.qat_steps=2",
                              "quantize.qat_images=8", "export.targets=[ort_cpu,tensorrt,metax]"])
    for mod, key in ((prune, "prune"), (quantize, "quantize"), (export, "export")):
        mod.run(OmegaConf.to_object(ctx.cfg[key]), ctx)
    assert ctx.load_model("prune").encoder_mlp_widths() == [32, 32]
    for target in ("ort_cpu", "tensorrt", "metax"):
        folder = tmp_path / f"export-{target}"
        meta = json.loads((folder / "package.json").read_text())
        assert meta["token_policy"]["buckets"] == [8, 16, 32] and meta["precision"] != "fp32", target
        package = OnnxPackage(folder, threads=1)
        blank = np.ones((1, *meta["input_shape"]), np.float32)
        assert package.encode(blank).shape[1] == 8  # the floor
        assert package.generate(blank, 8, 1).token_ids  # a blank image reads (empty is fine), never a crash


def test_the_anchors_calibrate_a_policy_encoder_through_its_keep_input(tmp_path):
    """NNCF's and ModelOpt's calibration get the kept indices the package's runtime would compute (without
    them a policy's encoder cannot run: both anchors were "not run")."""
    import datasets

    from pipeline.data.render import render_formula
    from pipeline.quantization import anchors
    from pipeline.quantization.graphs import float_graphs

    adapter = build_tiny()
    adapter.set_token_policy({"buckets": [8, 16, 32], "frame_stride": 2})
    images = np.stack([adapter.preprocess(render_formula(f)).numpy() for f in FORMULAS]).astype(np.float32)
    calib = datasets.Dataset.from_dict({"pixel_values": images})
    graphs = float_graphs(adapter, tmp_path, 8, "tiny-tokens", threads=1)
    policy = graphs.package.token_policy
    assert policy is not None
    feeds = anchors._feeds(images[:3], policy)
    assert feeds["keep"].tolist() == policy.keep_batch(images[:3]).tolist()
    assert anchors._feeds(images[:3], None).keys() == {"images"}
    if importlib.util.find_spec("nncf"):
        path, share, _, note = anchors._nncf(graphs.encoder_ort, tmp_path, calib, 4, graphs.memory_length,
                                             graphs.hidden_size, lambda _, rows: (1.0, [1.0] * len(rows)), 4,
                                             0.5, policy)
        assert path is not None and path.is_file() and share > 0, note
    if importlib.util.find_spec("modelopt"):
        path, _, _, note = anchors._modelopt(graphs.encoder_std, tmp_path, calib, 4, graphs.memory_length,
                                             graphs.hidden_size, policy)
        assert path is not None and path.is_file(), note


def test_the_policy_loads_alone_where_only_numpy_is():
    """A runtime of its own (the MacaRT stand-in) loads pipeline/tokens/policy.py by file path: numpy and
    the standard library, the project's error type only where the project is installed."""
    import ast
    from pathlib import Path

    import pipeline.tokens.policy as module

    tree = ast.parse(Path(module.__file__).read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert roots - {"__future__", "dataclasses", "typing"} == {"numpy", "pipeline"}


@pytest.mark.slow
def test_a_metax_package_with_a_policy_reads_alike_on_onnxruntime_1_12(tmp_path):
    """The Metax package of a model with a token policy, on ONNX Runtime 1.12.1 (MacaRT's base) through
    tests/macart_decode.py, which computes the kept indices with the policy file alone."""
    import macart_env

    from pipeline.data.render import render_formula
    from pipeline.export.runtime import OnnxPackage
    from pipeline.stages import export

    try:
        macart_env.macart_python()
    except macart_env.MacaRTEnvError as exc:
        pytest.fail(f"MacaRT stand-in unavailable: {exc}")
    adapter = build_tiny()
    adapter.set_token_policy({"buckets": [8, 16, 32], "frame_stride": 2})
    adapter.save(tmp_path / "tiny-tokens")
    (tmp_path / "formulas.txt").write_text("\n".join(FORMULAS[:4]) + "\n")
    ctx = fake_ctx(tmp_path, [f"export.model={tmp_path / 'tiny-tokens'}", "export.quantized=none", "target=metax",
                              f"export.formulas={tmp_path / 'formulas.txt'}", "model.max_length=8",
                              "export.parity_images=1", "export.parity_limit=1", "export.min_identical=0",
                              "export.drafter=none"])
    export.run(OmegaConf.to_object(ctx.cfg.export), ctx)
    folder = tmp_path / "export-metax"
    package = OnnxPackage(folder, threads=1)
    images = np.stack([np.ones(package.meta["input_shape"], np.float32),
                       *[package.preprocess(render_formula(f)) for f in FORMULAS[:5]]]).astype(np.float32)
    np.save(tmp_path / "images.npy", images)
    old = macart_env.decode(folder, tmp_path / "images.npy", tmp_path / "ort112.json", threads=1)
    assert old["onnxruntime"] == "1.12.1"
    assert old["sequences"] == package.generate(images, 8, batch_size=1).token_ids


@pytest.mark.parametrize("encoder", ["vit", "deit"])
def test_an_hf_encoder_reads_its_special_tokens_and_the_kept_patches(tmp_path, encoder):
    """HF VisionEncoderDecoder: the class token(s) always kept (ViT one, DeiT two, I-JEPA none), the kept
    patches gathered after the embeddings; every patch kept is the full encoder; the policy is saved."""
    from tiny_model import tiny_hf_model as tiny_model

    from pipeline.adapters.hf_vision_encoder_decoder import HfVisionEncoderDecoderAdapter

    folder = tiny_model(tmp_path / encoder, encoder, "trocr")
    adapter = HfVisionEncoderDecoderAdapter.load(str(folder))
    rows, cols, patch = adapter.token_grid()
    images = torch.rand(2, *adapter.input_shape) * 2 - 1  # the normalized scale (mean 0.5, std 0.5)
    every = torch.arange(rows * cols)[None].repeat(2, 1)
    with torch.no_grad():
        full = adapter.encode(images)
        assert torch.allclose(adapter.encode_kept(images, every), full, atol=1e-5)
        specials = full.shape[1] - rows * cols
        assert specials == {"vit": 1, "deit": 2, "ijepa": 0}[encoder]
        assert adapter.encode_kept(images, every[:, :5]).shape[1] == specials + 5
    adapter.set_token_policy({"buckets": [4, 8, rows * cols]})
    assert adapter.token_policy.ink_below == pytest.approx((250 / 255 - 0.5) / 0.5)  # on the normalized scale
    blank = torch.ones(1, *adapter.input_shape)  # white, normalized
    with torch.no_grad():
        assert adapter.encode(blank).shape[1] == specials + 4
    adapter.save(tmp_path / "saved")
    assert HfVisionEncoderDecoderAdapter.load(str(tmp_path / "saved")).token_policy == adapter.token_policy
    adapter.set_token_policy({"buckets": [4, 8, rows * cols], "narrow_from": 1, "narrow_by": 3})
    seen = []
    adapter.model.encoder.layers[1].register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    with torch.no_grad():  # the class token(s) and the first kept patches read layer 1; the memory holds all
        assert adapter.encode_kept(images, every[:, :8]).shape[1] == specials + 8 and seen == [specials + 5]


def test_an_hf_model_whose_channels_are_normalized_apart_is_refused_in_one_line(tmp_path):
    from tiny_model import tiny_hf_model as tiny_model

    from pipeline.adapters.hf_vision_encoder_decoder import HfVisionEncoderDecoderAdapter

    adapter = HfVisionEncoderDecoderAdapter.load(str(tiny_model(tmp_path / "m", "vit", "trocr")))
    adapter._spec = {**adapter._spec, "image_mean": [0.4, 0.5, 0.6], "image_std": [0.2, 0.2, 0.2]}
    with pytest.raises(PipelineError, match="normalizes each channel differently"):
        adapter.set_token_policy({})


def test_the_chain_runs_a_model_that_cannot_read_a_subset_without_a_policy_in_one_line(tmp_path, caplog):
    """prune.tokens.skip_unsupported (stage=all): such a model is pruned reading every token, one warning
    says why; the stage alone (false) refuses it in one line; a model that can keeps its policy."""
    from dataclasses import replace

    from tiny_model import tiny_hf_model as tiny_model

    from pipeline.adapters.hf_vision_encoder_decoder import HfVisionEncoderDecoderAdapter
    from pipeline.stages import prune

    adapter = HfVisionEncoderDecoderAdapter.load(str(tiny_model(tmp_path / "m", "vit", "trocr")))
    chain = prune.PruneConfig(tokens=prune.TokensConfig(enabled=True, skip_unsupported=True))
    assert prune._tokens_if_readable(chain, adapter) is chain  # a ViT reads its kept patches
    adapter._spec = {**adapter._spec, "image_mean": [0.4, 0.5, 0.6], "image_std": [0.2, 0.2, 0.2]}
    with caplog.at_level("WARNING"):
        skipped = prune._tokens_if_readable(chain, adapter)
    assert not skipped.tokens.enabled and not prune._changes(skipped, adapter, 0, {})
    assert [r.message for r in caplog.records if "no token policy" in r.message] == [
        f"[prune] no token policy: {adapter.token_policy_refusal()}; every token is read "
        f"(prune.tokens.skip_unsupported)"]
    alone = replace(chain, tokens=replace(chain.tokens, skip_unsupported=False))
    with pytest.raises(PipelineError, match="prune.tokens: .*normalizes each channel differently"):
        prune._changes(prune._tokens_if_readable(alone, adapter), adapter, 0, {})


def test_the_policy_comparison_script_reads_policies_over_the_packages_own():
    """benchmarks/token_policies.py's policy specs: fields over the package's policy, `all`, a bad field refused."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parent.parent / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("token_policies", bench / "token_policies.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(bench))
    assert module.parse_policy("own:", POLICY) == ("own", POLICY)
    name, p = module.parse_policy("floor384:buckets=384/1024,dilate=2", POLICY)
    assert (name, p.buckets, p.dilate, p.frame_stride) == ("floor384", (384, 1024), 2, POLICY.frame_stride)
    assert module.parse_policy("all:all", POLICY)[1].keep(np.ones((1, 128, 512), np.float32)).size == 1024
    with pytest.raises(SystemExit, match="'grid_h' is not a token policy field"):
        module.parse_policy("x:grid_h=2", POLICY)
