"""Head removal is exact: MHA rewrite, slicing (ours and HF-style), scores, selection, FLOPs."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.adapters.attention import ExplicitAttention, remove_heads
from pipeline.errors import PipelineError
from pipeline.pruning import count, mlp, scores, select
from pipeline.pruning.heads import head_gates
from tiny_model import build_tiny


@pytest.fixture(scope="module")
def tiny():
    return build_tiny()


def _gates(counts, off):
    g = [torch.ones(h) for h in counts]
    for layer, hs in off.items():
        for h in hs:
            g[layer][h] = 0.0
    return g


def test_mha_rewrite_is_numerically_equal_with_and_without_masks():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    with torch.no_grad():
        mha.in_proj_bias.normal_()
        mha.out_proj.bias.normal_()
    exp = ExplicitAttention.from_mha(mha).eval()
    x, mem = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
    pad = torch.tensor([[False] * 5, [False, False, False, True, True]])
    with torch.no_grad():
        for args, kw in [((x, x, x), {}), ((x, mem, mem), {}),
                         ((x, x, x), {"attn_mask": causal, "key_padding_mask": pad})]:
            ref, _ = mha(*args, need_weights=False, **kw)
            got, _ = exp(*args, **kw)
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_tiny_model_rewrite_equals_package_model(tiny):
    from pipeline.adapters.latex_ocr_junia import build_model_reference

    ref = build_model_reference(tiny.model_config)
    ref.load_state_dict(tiny.reference_state)
    x = torch.rand(2, *tiny.input_shape)
    tokens = torch.tensor([[tiny.bos_id, 5, 6, 7], [tiny.bos_id, 8, 9, tiny.pad_id]])
    with torch.no_grad():
        torch.testing.assert_close(tiny.encode(x), ref.encode(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tiny.decode_logits(tokens, tiny.encode(x)), ref.decode(tokens, ref.encode(x)),
                                   atol=1e-4, rtol=1e-4)


def test_pooled_keys_attend_to_the_window_means_of_the_projected_keys():
    """``pool_keys``: every query kept, keys and values the means of each window of patches (pooling
    before the affine projections = pooling the projected keys); (1, 1) turns it off; a window that
    does not tile the grid is refused."""
    import math

    from pipeline.adapters.attention import ExplicitAttention

    torch.manual_seed(0)
    att = ExplicitAttention(16, 2, 8).eval()
    x = torch.randn(3, 4 * 8, 16)
    with torch.no_grad():
        plain = att(x, x, x)[0]
        att.pool_keys((4, 8), (2, 2))
        got = att(x, x, x)[0]
        # by hand: project, then average each 2x2 block of the 4x8 grid
        def pooled(t):
            return t.view(3, 2, 2, 4, 2, -1).mean(dim=(2, 4)).reshape(3, 8, -1)
        q, k, v = att.q_proj(x), pooled(att.k_proj(x)), pooled(att.v_proj(x))
        heads = lambda t: t.view(3, t.shape[1], 2, 8).transpose(1, 2)  # noqa: E731
        probs = torch.softmax(heads(q) @ heads(k).transpose(-1, -2) / math.sqrt(8), dim=-1)
        want = att.out_proj((probs @ heads(v)).transpose(1, 2).reshape(3, 32, 16))
    assert got.shape == plain.shape and not torch.allclose(got, plain, atol=1e-3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    att.pool_keys((4, 8), (1, 1))
    assert att.key_pool is None
    with torch.no_grad():
        torch.testing.assert_close(att(x, x, x)[0], plain)
    with pytest.raises(ValueError, match="does not tile the 4x8 patch grid"):
        att.pool_keys((4, 8), (3, 1))


def test_sliced_attention_equals_original_with_heads_zeroed():
    torch.manual_seed(1)
    attn = ExplicitAttention(24, 6, 4).eval()
    x = torch.randn(3, 9, 24)
    with torch.no_grad(), head_gates([attn], _gates([6], {0: [1, 4]})):
        want, _ = attn(x, x, x)
    with torch.no_grad():
        full, _ = attn(x, x, x)
    keep = remove_heads(attn, [4, 1])
    assert keep == [0, 2, 3, 5] and attn.num_heads == 4
    assert attn.q_proj.weight.shape == (16, 24) and attn.out_proj.weight.shape == (24, 16)
    with torch.no_grad():
        got, _ = attn(x, x, x)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(got, full, atol=1e-3)  # the removed heads did contribute


def test_pruned_tiny_model_equals_gated_original(tiny):
    import copy

    pruned = copy.copy(tiny)
    pruned.model = copy.deepcopy(tiny.model)
    remove = {0: [0, 2], 1: [3]}
    pruned.remove_encoder_heads(remove)
    assert pruned.encoder_head_counts() == [2, 3]
    x = torch.rand(2, *tiny.input_shape)
    attns = [tiny.encoder_attention(i) for i in range(2)]
    with torch.no_grad():
        with head_gates(attns, _gates([4, 4], remove)):
            want = tiny.encode(x)
        torch.testing.assert_close(pruned.encode(x), want, atol=1e-5, rtol=1e-5)
    assert count.encoder_flops(pruned) < count.encoder_flops(tiny)
    # per head: q/k/v rows and biases (3 x (8 x 32 + 8)) and the output projection columns (32 x 8)
    assert count.parameters(tiny) - count.parameters(pruned) == 3 * (3 * (8 * 32 + 8) + 32 * 8)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["vit", "siglip"])
def test_hf_style_attention_pruning(kind):
    from transformers import SiglipVisionConfig, ViTConfig

    from pipeline.adapters.hf_vit import HFVisionEncoder

    torch.manual_seed(0)
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  image_size=32, patch_size=8, num_channels=3)
    config = ViTConfig(**common, attn_implementation="eager") if kind == "vit" \
        else SiglipVisionConfig(**common, attn_implementation="eager")
    enc = HFVisionEncoder.from_config(config)
    assert enc.encoder_head_counts() == [4, 4]
    before = count.encoder_flops(enc)
    ref = HFVisionEncoder.from_config(config)
    ref.model.load_state_dict(enc.model.state_dict())
    x = torch.rand(2, 3, 32, 32)
    remove = {0: [1], 1: [0, 3]}
    with torch.no_grad():
        with head_gates([ref.encoder_attention(i) for i in range(2)], _gates([4, 4], remove)):
            want = ref.encode(x)
        full = ref.encode(x)
    enc.remove_encoder_heads(remove)
    assert enc.encoder_head_counts() == [3, 2]
    attn = enc.encoder_attention(1)
    assert attn.q_proj.weight.shape == (16, 32)
    with torch.no_grad():
        got = enc.encode(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(got, full, atol=1e-4)
    assert count.encoder_flops(enc) < before
    # the same recovery code refits HF blocks
    from pipeline.pruning import recover

    x8 = torch.rand(8, 3, 32, 32)
    with torch.no_grad():
        before = (enc.encode(x8) - ref.encode(x8)).norm()
    report = recover.refit(enc, ref, x8, [0, 1], ridge=1e-4, batch_size=4)
    assert report[1]["attn_rel_error_after"] < report[1]["attn_rel_error_before"]
    with torch.no_grad():
        assert (enc.encode(x8) - ref.encode(x8)).norm() < before
    # the same scoring code reads HF projections
    l2 = scores.l2_scores([enc.encoder_attention(i) for i in range(2)])
    assert [len(r) for r in l2] == [3, 2]


def test_hf_encoder_without_attention_is_refused():
    from pipeline.adapters.hf_vit import HFVisionEncoder

    with pytest.raises(PipelineError, match="no HF-style attention"):
        HFVisionEncoder(nn.Sequential(nn.Linear(4, 4)), image_size=4)


def test_l2_scores_match_hand_computation():
    attn = ExplicitAttention(4, 2, 2)
    with torch.no_grad():
        for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj):
            m.weight.zero_()
        attn.q_proj.weight[0, 0] = 3.0   # head 0
        attn.v_proj.weight[3, 1] = 4.0   # head 1
        attn.out_proj.weight[2, 0] = 12.0  # head 0's output column
    assert scores.l2_scores([attn]) == [[3.0, 4.0]]
    assert scores.l2_scores([attn], with_out=True) == [[pytest.approx(153 ** 0.5), 4.0]]


def test_selection_is_global_keeps_min_per_layer_and_normalizes():
    s = [[0.1, 0.2, 0.3], [5.0, 6.0, 7.0]]
    assert select.select_heads(s, 2, 1, "global") == {0: [0, 1]}
    assert select.select_heads(s, 3, 1, "global") == {0: [0, 1], 1: [0]}
    # per-layer normalization compares heads within their layer's scale
    assert select.select_heads(s, 2, 1, "layer") == {0: [0], 1: [0]}
    assert select.select_heads(s, 0, 1, "layer") == {}
    with pytest.raises(ValueError, match="at most 4 can go"):
        select.select_heads(s, 5, 1, "global")
    with pytest.raises(ValueError, match="min_per_layer must be at least 1"):
        select.select_heads(s, 1, 0, "global")


def test_ratio_and_flops_targets():
    assert select.heads_for_ratio([8, 8, 8, 8], 0.25) == 8
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match=r"^ratio must be in \[0, 1\)"):  # library: no CLI key names
            select.heads_for_ratio([8, 8], bad)
    assert select.heads_for_flops(0.3, 100.0, 2.0, [8, 8, 8, 8], 1) == 15
    with pytest.raises(ValueError, match="at most"):
        select.heads_for_flops(0.8, 100.0, 2.0, [8, 8, 8, 8], 1)


def test_how_many_heads_go_flops_first_then_a_count_then_the_ratio():
    counts = [8, 8, 8, 8]
    assert select.heads_to_remove(counts, 1, 0.25) == 8
    assert select.heads_to_remove(counts, 1, 0.25, num_heads=3) == 3
    assert select.heads_to_remove(counts, 1, 0.25, num_heads=3, flops_reduction=0.3, flops_full=100.0,
                                  flops_per_head=2.0) == 15
    assert select.heads_to_remove(counts, 7, 0.0, num_heads=4) == 4
    with pytest.raises(ValueError, match="removing 5 of 32 heads would leave a layer with fewer than 7 head"):
        select.heads_to_remove(counts, 7, 0.0, num_heads=5)
    with pytest.raises(ValueError, match="at most 4 can go"):
        select.heads_to_remove(counts, 7, 0.5)


def test_spearman():
    assert scores.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert scores.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert scores.against_ablation({"l2_qkv": [[1, 2]], "random": [[1, 2]]}) == {}
    got = scores.against_ablation({"l2_qkv": [[1, 2], [3, 4]], "random": [[4, 3], [2, 1]],
                                   "ablation": [[1, 2], [3, 5]]})
    assert got == pytest.approx({"l2_qkv": 1.0, "random": -1.0})


def test_the_verdict_takes_the_recovered_row_and_holds_only_within_every_tolerance():
    from pipeline.pruning import measure

    def row(em, cer, gflops, shift_em=None):
        return {"exact_match": em, "cer": cer, "encoder_gflops": gflops,
                "splits": {"eval": {"n": 10, "exact_match": em, "cer": cer},
                           "shift": {"n": 5, "exact_match": em if shift_em is None else shift_em, "cer": cer}}}

    variants = {"original": row(0.5, 0.2, 4.0), "pruned, before recovery": row(0.1, 0.9, 3.0),
                "pruned, after recovery": row(0.495, 0.205, 3.0, shift_em=0.4)}
    v = measure.verdict(variants, 0.01, 0.05)
    assert v["exact_match"] == 0.495 and v["flops_reduction"] == pytest.approx(0.25)
    assert v["splits"]["eval"]["holds"] and not v["splits"]["shift"]["holds"] and not v["holds_on_every_split"]
    del variants["pruned, after recovery"]  # no recovery: the pruned row before it
    v = measure.verdict(variants, 0.01, 0.05)
    assert v["exact_match"] == 0.1 and not v["splits"]["eval"]["holds"]


def test_refit_reduces_attention_error(tiny):
    import copy

    from pipeline.pruning import recover

    pruned = copy.copy(tiny)
    pruned.model = copy.deepcopy(tiny.model)
    pruned.remove_encoder_heads({0: [1, 2]})
    x = torch.rand(6, *tiny.input_shape)
    report = recover.refit(pruned, tiny, x, [0, 1], ridge=1e-4, batch_size=3)
    for layer in (0, 1):
        for part in ("attn", "mlp"):
            assert report[layer][f"{part}_rel_error_after"] <= report[layer][f"{part}_rel_error_before"]
    assert report[0]["attn_rel_error_after"] < report[0]["attn_rel_error_before"]
    with torch.no_grad():
        after = (pruned.encode(x) - tiny.encode(x)).norm()
    raw = copy.copy(tiny)
    raw.model = copy.deepcopy(tiny.model)
    raw.remove_encoder_heads({0: [1, 2]})
    with torch.no_grad():
        before = (raw.encode(x) - tiny.encode(x)).norm()
    assert after < before


def test_refit_replaying_each_block_gives_the_weights_of_real_passes_bit_for_bit(tiny):
    """The refit runs each block alone on its kept inputs (its output the next block's input) instead
    of the encoder from the image up to it: same batches, same modules, the same weights exactly; a
    block whose input is not the previous block's output falls back to real passes."""
    import copy

    from pipeline.pruning import recover

    x = torch.rand(7, *tiny.input_shape, generator=torch.Generator().manual_seed(5))

    def refit(replay: bool, model=None):
        pruned = copy.copy(tiny)
        pruned.model = copy.deepcopy(model or tiny.model)
        pruned.remove_encoder_heads({0: [1, 2], 1: [0]})
        pruned.pool_encoder_keys({0: [1, 2]})
        report = recover.refit(pruned, tiny, x, [0, 1], ridge=1e-1, batch_size=3, replay=replay)
        return pruned.model.state_dict(), report

    (fast, fast_report), (slow, slow_report) = refit(True), refit(False)
    assert fast_report == slow_report and all(torch.equal(fast[k], slow[k]) for k in slow)
    # a model that scales the stream between its blocks: block 0's output is not block 1's input
    import types

    def encode(self, images):
        x = self.patch_embed(images)
        for i, block in enumerate(self.encoder_blocks):
            x = block(x * 0.5 if i else x)
        return self.encoder_norm(x)

    twisted = copy.deepcopy(tiny.model)
    twisted.encode = types.MethodType(encode, twisted)
    (fast, fast_report), (slow, slow_report) = refit(True, twisted), refit(False, twisted)
    assert fast_report == slow_report and all(torch.equal(fast[k], slow[k]) for k in slow)


def test_refit_of_an_unpruned_model_keeps_it(tiny):
    """The ridge penalty pulls towards the current weights: with nothing pruned there is nothing to fix."""
    import copy

    from pipeline.pruning import recover

    twin = copy.copy(tiny)
    twin.model = copy.deepcopy(tiny.model)
    x = torch.rand(3, *tiny.input_shape, generator=torch.Generator().manual_seed(3))
    recover.refit(twin, tiny, x, [0, 1], ridge=1e-1, batch_size=3)
    for a, b in zip(twin.model.parameters(), tiny.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_stronger_ridge_keeps_the_refit_closer_to_the_current_weights(tiny):
    """The default ridge (1e-1, docs/prune.md: the shift split) trades fit on the refit images for
    staying near the sliced weights: the first layer's projections move less, and fit less tightly."""
    import copy

    from pipeline.pruning import recover
    from pipeline.pruning.heads import projections
    from pipeline.stages.prune import PruneConfig

    assert PruneConfig().ridge == 1e-1
    x = torch.rand(6, *tiny.input_shape, generator=torch.Generator().manual_seed(5))
    moved, err = {}, {}
    for ridge in (1e-4, 1e-1, 1e1):
        pruned = copy.copy(tiny)
        pruned.model = copy.deepcopy(tiny.model)
        pruned.remove_encoder_heads({0: [1, 2]})
        o = projections(pruned.encoder_attention(0))[3]
        w0 = o.weight.detach().clone()
        report = recover.refit(pruned, tiny, x, [0], ridge=ridge, batch_size=3)
        moved[ridge] = float((o.weight.detach() - w0).norm())
        err[ridge] = report[0]["attn_rel_error_after"]
        assert err[ridge] <= report[0]["attn_rel_error_before"] + 1e-9
    assert moved[1e-4] > moved[1e-1] > moved[1e1]
    assert err[1e-4] <= err[1e-1] + 1e-9 and err[1e-1] <= err[1e1] + 1e-9


def test_distill_lowers_block_error_and_is_deterministic(tiny):
    import copy

    from pipeline.pruning import recover

    def run():
        pruned = copy.copy(tiny)
        pruned.model = copy.deepcopy(tiny.model)
        pruned.remove_encoder_heads({0: [1, 2], 1: [0]})
        x = torch.rand(8, *tiny.input_shape, generator=torch.Generator().manual_seed(1))
        before = [p.detach().clone() for p in pruned.model.parameters()]
        report = recover.distill(pruned, tiny, x, [0, 1], epochs=3, lr=1e-3, batch_size=4, seed=0)
        after = list(pruned.model.parameters())
        return pruned, x, report, before, after

    pruned, x, report, before, after = run()
    assert sorted(report) == [0, 1]
    for layer in (0, 1):
        assert report[layer]["steps"] == report[layer]["steps_planned"] == 6
        assert report[layer]["block_rel_error_after"] < report[layer]["block_rel_error_before"]
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    again, _, report2, _, _ = run()
    assert report2 == report  # same seed, same steps, same numbers
    with torch.no_grad():
        assert torch.equal(again.encode(x), pruned.encode(x))
    assert recover.distill(pruned, tiny, x, [0], epochs=0) == {}


def test_distill_restores_a_block_it_made_worse(tiny):
    import copy

    from pipeline.pruning import recover

    pruned = copy.copy(tiny)
    pruned.model = copy.deepcopy(tiny.model)
    pruned.remove_encoder_heads({0: [1, 2]})
    x = torch.rand(4, *tiny.input_shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = pruned.encode(x)
    report = recover.distill(pruned, tiny, x, [0], epochs=2, lr=10.0, batch_size=2)  # a step size that diverges
    assert report[0]["kept"] is False
    assert report[0]["block_rel_error_after"] == report[0]["block_rel_error_before"]
    with torch.no_grad():
        assert torch.equal(pruned.encode(x), ref)


def test_real_model_rewrite_and_slicing_are_exact(real_adapter):
    """The shipped model: the MHA rewrite equals the package's own model, and removing the four
    heads of the default config equals switching them off, on one rendered formula."""
    import copy

    from pipeline.adapters.latex_ocr_junia import build_model_reference, package_assets, safe_load_checkpoint
    from pipeline.data.render import render_formula

    x = real_adapter.preprocess(render_formula("\\frac{a+b}{c}"))[None]
    ref = build_model_reference(real_adapter.model_config)
    ref.load_state_dict(safe_load_checkpoint(package_assets() / "best.pt")["model_state_dict"])
    remove = {1: [3, 6], 2: [7], 3: [1]}
    pruned = copy.copy(real_adapter)
    pruned.model = copy.deepcopy(real_adapter.model)
    pruned.remove_encoder_heads(remove)
    attns = [real_adapter.encoder_attention(i) for i in range(4)]
    with torch.no_grad():
        full = real_adapter.encode(x)
        torch.testing.assert_close(full, ref.encode(x), atol=1e-4, rtol=1e-4)
        with head_gates(attns, _gates([8, 8, 8, 8], remove)):
            want = real_adapter.encode(x)
        got = pruned.encode(x)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, full, atol=1e-3)
    assert pruned.encoder_head_counts() == [8, 6, 7, 7]


@pytest.mark.slow
def test_finetune_resumes_after_a_kill_to_the_same_weights(tiny, tmp_path):
    import copy

    from pipeline.pruning import recover

    def fresh():
        s = copy.copy(tiny)
        s.model = copy.deepcopy(tiny.model)
        s.remove_encoder_heads({0: [1]})
        return s

    x = torch.rand(6, *tiny.input_shape, generator=torch.Generator().manual_seed(4))
    latex = ["x^2", "a+b", "\\alpha", "k^n", "p_0", "y"]
    kwargs = dict(steps=4, minutes=10, lr=1e-3, batch_size=2, seed=0)
    straight = fresh()
    recover.finetune(straight, tiny, x, latex, **kwargs)

    state = tmp_path / "ft.pt"
    killed = fresh()
    calls = {"n": 0}
    real = killed.decode_logits

    def dies_on_third_step(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # as if the process were stopped during step 3
        return real(*a, **k)

    killed.decode_logits = dies_on_third_step
    with pytest.raises(KeyboardInterrupt):
        recover.finetune(killed, tiny, x, latex, state_file=state, save_every=2, **kwargs)
    assert state.is_file() and torch.load(state, weights_only=True)["step"] == 2

    resumed = fresh()
    info = recover.finetune(resumed, tiny, x, latex, state_file=state, save_every=2, **kwargs)
    assert info["resumed_at"] == 2 and info["steps"] == 4
    for a, b in zip(resumed.model.parameters(), straight.model.parameters()):
        assert torch.equal(a, b)


def test_finetune_encoder_scope_trains_the_encoder_alone(tiny):
    import copy

    from pipeline.pruning import recover

    student = copy.copy(tiny)
    student.model = copy.deepcopy(tiny.model)
    student.remove_encoder_heads({0: [1]})
    decoder = {id(p) for p in student.decoder_parameters()}
    before = {n: p.detach().clone() for n, p in student.model.named_parameters()}
    x = torch.rand(4, *tiny.input_shape, generator=torch.Generator().manual_seed(5))
    info = recover.finetune(student, tiny, x, ["x^2", "a+b", "k^n", "y"], steps=2, minutes=10, lr=1e-2,
                            batch_size=2, seed=0, scope="encoder", label_weight=0.0)
    assert info["steps"] == 2
    moved = {n for n, p in student.model.named_parameters() if not torch.equal(p, before[n])}
    frozen = {n for n, p in student.model.named_parameters() if id(p) in decoder}
    assert frozen and moved == set(before) - frozen  # every encoder weight learnt, the decoder is the original's
    with pytest.raises(ValueError, match="scope"):
        recover.finetune(student, tiny, x, ["y"] * 4, steps=1, minutes=1, scope="decoder")


@pytest.mark.slow
def test_finetune_on_the_originals_readings_ignores_the_labels(tiny):
    import copy

    from pipeline.pruning import recover
    from pipeline.pruning.scores import own_predictions

    x = torch.rand(4, *tiny.input_shape, generator=torch.Generator().manual_seed(6))
    ids = own_predictions(tiny, x, 12, use_cache=True)
    assert ids == own_predictions(tiny, x, 12)  # the cached decoder reads the same tokens

    def tuned(latex, targets):
        s = copy.copy(tiny)
        s.model = copy.deepcopy(tiny.model)
        s.remove_encoder_heads({0: [1]})
        recover.finetune(s, tiny, x, latex, steps=2, minutes=10, lr=1e-2, batch_size=2, seed=0, targets=targets)
        return [p.detach().clone() for p in s.model.parameters()]

    a = tuned(["x^2", "a+b", "k^n", "y"], ids)
    b = tuned(["\\alpha"] * 4, ids)  # other labels, same targets: the same run
    c = tuned(["x^2", "a+b", "k^n", "y"], None)  # the labels: another run
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not all(torch.equal(p, q) for p, q in zip(a, c))


def test_a_narrowed_mlp_reads_as_its_dropped_units_zeroed_and_reloads_with_its_widths(tiny, tmp_path):
    """``narrow_encoder_mlp`` removes hidden units physically: the same output as the whole MLP with the dropped
    units' weights back set to zero; the kept units are each layer's highest scored; the saved model rebuilds
    the narrowed layers."""
    from pipeline.adapters.latex_ocr_junia import LatexOcrJuniaAdapter

    torch.manual_seed(0)
    x = torch.rand(3, *tiny.input_shape)
    found = mlp.unit_scores(tiny, x)
    units = mlp.units_to_keep(found, 0.25)
    assert mlp.units_to_keep(found, 0.0) == {}
    for layer, keep in units.items():
        assert len(keep) == 48 and keep == sorted(keep)
        assert float(found[layer][keep].min()) >= float(found[layer][[u for u in range(64) if u not in keep]].max())
    narrowed, zeroed = tiny.clone(), tiny.clone()
    narrowed.narrow_encoder_mlp(units)
    assert narrowed.encoder_mlp_widths() == [48, 48]
    with torch.no_grad():
        for layer, keep in units.items():
            fc2 = zeroed.encoder_mlp(layer)[1]
            fc2.weight[:, [u for u in range(64) if u not in keep]] = 0.0
        torch.testing.assert_close(narrowed.encode(x), zeroed.encode(x), atol=1e-6, rtol=1e-6)
        assert not torch.allclose(narrowed.encode(x), tiny.encode(x), atol=1e-4)
    narrowed.save(tmp_path / "m")
    again = LatexOcrJuniaAdapter.load(str(tmp_path / "m"))
    assert again.encoder_mlp_widths() == [48, 48]
    with torch.no_grad():
        assert torch.equal(again.encode(x), narrowed.encode(x))
    with pytest.raises(ValueError, match="do not fit its 48"):
        again.narrow_encoder_mlp({0: [0, 60]})
