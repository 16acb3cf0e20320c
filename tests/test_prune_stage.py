"""The prune stage end to end on a tiny random model of the real shape, its bad inputs, and the CLI."""
from __future__ import annotations

import json
import shutil

import pytest
from omegaconf import OmegaConf

from pipeline.artifacts import sha256_file
from pipeline.errors import PipelineError
from pipeline.pruning import measure
from pipeline.stages import prune
from tiny_model import build_tiny, fake_ctx

FAST = ["model.max_length=8", "model.batch_size=4", "prune.eval_limit=4", "prune.score_images=2",
        "prune.refit_images=4", "prune.distill_images=4", "prune.distill_epochs=1", "prune.finetune_steps=1", "prune.finetune_images=4", "prune.finetune_varied=2", "prune.finetune_batch=2",
        "prune.latency_images=1"]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny") / "model"
    build_tiny().save(folder)
    return folder


def _run(root, folder, *overrides):
    ctx = fake_ctx(root, [f"prune.model={folder}", *FAST, *overrides])
    return ctx, prune.run(OmegaConf.to_object(ctx.cfg.prune), ctx)


@pytest.mark.slow
def test_prune_stage_writes_a_smaller_model_that_reloads_and_is_deterministic(tmp_path, tiny_folder):
    ctx, manifest = _run(tmp_path / "a", tiny_folder, "prune.num_heads=3", "prune.criterion=gradient")
    out = tmp_path / "a" / "prune"
    m = manifest["metrics"]
    assert m["heads_removed"] == 3 and sum(m["encoder_heads"]) == 5 and min(m["encoder_heads"]) >= 1
    assert json.loads((out / "model" / "config.json").read_text())["encoder_heads"] == m["encoder_heads"]
    assert set(m["variants"]) == {"original", "pruned, before recovery", "pruned, after recovery",
                                  "random heads, after recovery"}
    v = m["variants"]
    assert v["pruned, after recovery"]["encoder_gflops"] < v["original"]["encoder_gflops"]
    assert v["pruned, after recovery"]["params"] < v["original"]["params"]
    assert m["reload_identical"] is True
    assert m["recovery"]["rounds"][0]["finetune"]["steps"] == 1
    assert "finetune 1 step(s), loss" in (out / "report.md").read_text()
    assert not list((tmp_path / "a" / ".resume").glob("*"))  # finetune checkpoints go once the artifact is complete
    for name in ("report.md", "head_scores.png", "head_scores.json", "model/model.safetensors"):
        assert (out / name).is_file(), name
    assert "| original |" in (out / "report.md").read_text()
    # every variant is scored on the eval split and the shift split, side by side
    from tiny_model import SHIFT_FORMULAS
    for variant in v.values():
        assert set(variant["splits"]) == {"eval", "shift"} and variant["splits"]["shift"]["n"] == 4
        assert variant["exact_match"] == variant["splits"]["eval"]["exact_match"]
    assert len(SHIFT_FORMULAS) > 4  # eval_limit=4 of each split
    after, orig = v["pruned, after recovery"]["splits"]["shift"], v["original"]["splits"]["shift"]
    assert m["splits"]["shift"]["cer"] == after["cer"] and m["splits"]["shift"]["cer_original"] == orig["cer"]
    assert m["holds_on_every_split"] == all(s["holds"] for s in m["splits"].values())
    report = (out / "report.md").read_text()
    assert "exact match (shift)" in report and "CER (eval)" in report and "| shift | 4 |" in report
    scores = json.loads((out / "head_scores.json").read_text())
    assert set(scores["scores"]) == {"gradient", "random"}  # the chosen criterion and the random baseline only
    assert [p.name.split("-")[3] for p in (tmp_path / "a" / "cache").glob("prune-head-scores-*")] == ["gradient"]
    # the stage's model is what every later stage loads by name
    assert ctx.load_model("prune").encoder_head_counts() == m["encoder_heads"]
    # same config and seed: the same model and the same scores
    _run(tmp_path / "b", tiny_folder, "prune.num_heads=3", "prune.criterion=gradient")
    for name in ("model/model.safetensors", "head_scores.json"):
        assert sha256_file(out / name) == sha256_file(tmp_path / "b" / "prune" / name), name
    # unchanged inputs: reused, not recomputed
    _, again = _run(tmp_path / "a", tiny_folder, "prune.num_heads=3", "prune.criterion=gradient")
    assert again["key"] == manifest["key"]


def test_flops_target_iterations_and_named_artifact(tmp_path, tiny_folder):
    _, manifest = _run(tmp_path, tiny_folder, "prune.flops_reduction=0.1", "prune.iterations=2",
                       "prune.compare_random=false", "prune.finetune_steps=0", "prune.name=prune-f10",
                       "prune.refit_varied=3", "prune.check_before_recovery=false")
    m = manifest["metrics"]
    assert m["flops_reduction"] >= 0.1
    # stage=all's setting: no reading of the pruned model before its recovery, the rest as usual
    assert set(m["variants"]) == {"original", "pruned, after recovery"}
    assert "check reading before recovery" not in m["phase_seconds"] and "recovery" in m["phase_seconds"]
    assert "## Where the time went" in (tmp_path / "prune-f10" / "report.md").read_text()
    assert len(m["recovery"]["rounds"]) == 2
    # the varied grammar's images join the train images in every round's refit
    assert [r["refit_images"] for r in m["recovery"]["rounds"]] == [4 + 3, 4 + 3]
    assert manifest["config"]["refit_varied"] == 3
    assert (tmp_path / "prune-f10" / "model" / "config.json").is_file()
    assert not (tmp_path / "prune").exists()


@pytest.mark.slow
def test_sequence_distillation_finetune_trains_the_encoder_alone(tmp_path, tiny_folder):
    """prune.finetune_targets=teacher + prune.finetune_scope=encoder: the saved model's decoder is the
    original's, byte for byte; the varied formulas join the finetune; the options enter the key."""
    import torch

    ctx, manifest = _run(tmp_path, tiny_folder, "prune.num_heads=2", "prune.compare_random=false",
                         "prune.distill_epochs=0", "prune.finetune_steps=2", "prune.finetune_varied=2",
                         "prune.finetune_scope=encoder", "prune.finetune_targets=teacher",
                         "prune.finetune_label_weight=0.5", "prune.lr=1e-2")
    assert manifest["metrics"]["recovery"]["rounds"][0]["finetune"]["steps"] == 2
    cfg = manifest["config"]
    assert (cfg["finetune_targets"], cfg["finetune_scope"], cfg["finetune_varied"]) == ("teacher", "encoder", 2)
    original, pruned = ctx.load_model(str(tiny_folder)), ctx.load_model("prune")
    for a, b in zip(original.decoder_parameters(), pruned.decoder_parameters()):
        assert torch.equal(a, b)
    # these are the defaults now
    d = prune.PruneConfig()
    assert (d.finetune_targets, d.finetune_scope, d.finetune_steps > 0) == ("teacher", "encoder", True)
    # the finetune as it was before these options keeps its key
    assert not {"finetune_targets", "finetune_scope", "finetune_varied", "finetune_label_weight"} & set(
        _run(tmp_path / "d", tiny_folder, "prune.num_heads=2", "prune.compare_random=false",
             "prune.finetune_targets=labels", "prune.finetune_scope=model", "prune.finetune_varied=0")[1]["config"])


@pytest.mark.parametrize("override, message", [
    ("prune.ratio=1.0", r"prune.ratio must be in \[0, 1\)"),
    ("prune.ratio=-0.2", r"prune.ratio must be in \[0, 1\)"),
    ("prune.num_heads=7", "would leave a layer with fewer than"),
    ("prune.flops_reduction=0.9", "would leave a layer with fewer than"),
    ("prune.min_heads_per_layer=0", "at least 1"),
    ("prune.criterion=l1", "prune.criterion and prune.compare_criteria take l2_qkv"),
    ("prune.distill_lr=0", "prune.lr and prune.distill_lr must be > 0"),
    ("prune.distill_epochs=-1", "prune.distill_epochs, prune.distill_minutes"),
    ("prune.ridge=-0.1", "prune.ridge must be >= 0"),
    ("prune.refit_varied=-1", "prune.refit_varied and prune.finetune_varied must be >= 0"),
    ("prune.finetune_varied=-2", "prune.refit_varied and prune.finetune_varied must be >= 0"),
    ("prune.finetune_label_weight=-1", "prune.finetune_label_weight must be >= 0"),
    ("prune.key_pool_layers=[2]", r"prune.key_pool_layers=\[2\]: each an encoder layer in 0..1"),
    ("prune.key_pool_layers=[0,0]", "at most once"),
    ("prune.key_pool_layers=[0] prune.key_pool=[3,1]", "does not tile the 4x8 patch grid"),
    ("prune.key_pool_layers=[0] prune.key_pool=[2]", r"\[rows, cols\] of patches"),
    ("prune.mlp_ratio=1.0", r"prune.mlp_ratio must be in \[0, 1\), got 1.0"),
    ("prune.mlp_ratio=-0.1", r"prune.mlp_ratio must be in \[0, 1\)"),
])
def test_bad_targets_fail_with_one_message_and_no_artifact(tmp_path, tiny_folder, override, message):
    with pytest.raises(PipelineError, match=message):
        _run(tmp_path, tiny_folder, *override.split())
    assert not [p for p in tmp_path.glob("prune*")]


def test_an_adapter_that_cannot_pool_keys_is_one_error_line_saying_how_to_turn_it_off(tmp_path, tiny_folder,
                                                                                      monkeypatch):
    """prune.key_pool_layers on a model whose adapter cannot pool keys (the base adapter's default) stops
    before any work with the option that runs it without pooling."""
    from pipeline.adapters.base import ModelAdapter

    adapter_cls = type(build_tiny())
    monkeypatch.setattr(adapter_cls, "pool_encoder_keys", ModelAdapter.pool_encoder_keys)
    with pytest.raises(PipelineError, match=r"prune.key_pool_layers=\[0\]: \w+ cannot pool encoder keys; "
                                            r"'prune.key_pool_layers=\[\]' prunes without pooling"):
        _run(tmp_path, tiny_folder, "prune.key_pool_layers=[0]", "prune.key_pool=[2,2]")
    assert not [p for p in tmp_path.glob("prune*")]


@pytest.mark.slow
def test_pooled_keys_without_removed_heads_are_recovered_saved_and_reloaded(tmp_path, tiny_folder):
    """prune.key_pool_layers alone (no head removed): one recovery round for it, fewer FLOPs, the
    saved model pools the same layers after a reload, and the options enter the key."""
    ctx, manifest = _run(tmp_path, tiny_folder, "prune.num_heads=0", "prune.compare_random=false",
                         "prune.key_pool_layers=[0]", "prune.key_pool=[2,2]")
    m = manifest["metrics"]
    assert m["heads_removed"] == 0 and m["encoder_key_pools"] == [[2, 2], [1, 1]]
    assert len(m["recovery"]["rounds"]) == 1 and m["recovery"]["rounds"][0]["finetune"]["steps"] == 1
    assert m["variants"]["pruned, after recovery"]["encoder_gflops"] < m["variants"]["original"]["encoder_gflops"]
    assert m["reload_identical"] is True
    assert ctx.load_model("prune").encoder_key_pools() == [[2, 2], [1, 1]]
    assert manifest["config"]["key_pool_layers"] == [0] and manifest["config"]["key_pool"] == [2, 2]
    # without pooling the config keys are the ones earlier artifacts were made with
    _, plain = _run(tmp_path / "plain", tiny_folder, "prune.num_heads=1", "prune.compare_random=false",
                    "prune.finetune_steps=0")
    assert "key_pool_layers" not in plain["config"] and "key_pool" not in plain["config"]
    assert "encoder_key_pools" not in json.loads((tmp_path / "plain" / "prune" / "model" / "config.json").read_text())


def test_an_adapter_that_cannot_narrow_its_mlp_is_one_error_line_saying_how_to_turn_it_off(tmp_path, tiny_folder,
                                                                                           monkeypatch):
    from pipeline.adapters.base import ModelAdapter

    monkeypatch.setattr(type(build_tiny()), "encoder_mlp", ModelAdapter.encoder_mlp)
    with pytest.raises(PipelineError, match=r"prune.mlp_ratio=0.5: \w+ cannot narrow its encoder's MLP; "
                                            r"'prune.mlp_ratio=0' prunes heads alone"):
        _run(tmp_path, tiny_folder, "prune.mlp_ratio=0.5")
    assert not [p for p in tmp_path.glob("prune*")]


@pytest.mark.slow
def test_narrowed_mlps_without_removed_heads_are_recovered_saved_and_reloaded(tmp_path, tiny_folder):
    """prune.mlp_ratio alone (no head removed): each encoder layer keeps half its MLP units, one recovery round
    refits and finetunes them, fewer FLOPs, the saved model has the same widths after a reload, and the option
    enters the key only when it is on."""
    ctx, manifest = _run(tmp_path, tiny_folder, "prune.num_heads=0", "prune.compare_random=false",
                         "prune.mlp_ratio=0.5")
    m = manifest["metrics"]
    assert m["heads_removed"] == 0 and m["encoder_mlp"] == [32, 32]
    assert len(m["recovery"]["rounds"]) == 1 and m["recovery"]["rounds"][0]["finetune"]["steps"] == 1
    assert sorted(m["recovery"]["rounds"][0]["refit"]) == [0, 1]  # every narrowed layer refitted
    v = m["variants"]
    assert v["pruned, after recovery"]["encoder_gflops"] < v["original"]["encoder_gflops"]
    assert v["pruned, after recovery"]["params"] < v["original"]["params"]
    assert m["reload_identical"] is True
    assert ctx.load_model("prune").encoder_mlp_widths() == [32, 32]
    assert json.loads((tmp_path / "prune" / "model" / "config.json").read_text())["encoder_mlp"] == [32, 32]
    assert manifest["config"]["mlp_ratio"] == 0.5
    assert v["original"]["encoder_mlp"] == [64, 64] and v["pruned, after recovery"]["encoder_mlp"] == [32, 32]
    assert "| MLP units per layer |" in (tmp_path / "prune" / "report.md").read_text()
    _, plain = _run(tmp_path / "plain", tiny_folder, "prune.num_heads=1", "prune.compare_random=false",
                    "prune.finetune_steps=0")
    assert "mlp_ratio" not in plain["config"]
    assert "encoder_mlp" not in json.loads((tmp_path / "plain" / "prune" / "model" / "config.json").read_text())


def test_model_without_encoder_attention_is_refused(tmp_path):
    folder = tmp_path / "no-attention"
    build_tiny(encoder_layers=0).save(folder)
    # the model folder's schema refuses it on load, naming the field, before prune looks for heads
    with pytest.raises(PipelineError, match=r"'model_config.num_encoder_layers' must be an integer >= 1, got 0"):
        _run(tmp_path / "art", folder)
    assert not (tmp_path / "art" / "prune").exists()


def test_corrupt_checkpoint_is_refused(tmp_path, tiny_folder):
    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_folder, folder)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(PipelineError, match="corrupt model weights"):
        _run(tmp_path / "art", folder)
    assert not (tmp_path / "art" / "prune").exists()


@pytest.mark.slow
def test_cli_bad_ratio_is_one_line_exit_2(tmp_path):
    from conftest import run_cli

    proc = run_cli("stage=prune", "prune.ratio=1.5", f"artifacts.dir={tmp_path}", timeout=120)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == ["error: prune.ratio must be in [0, 1), got 1.5"]
    assert not list(tmp_path.glob("prune*"))


@pytest.mark.slow
def test_sweep_collector_picks_the_most_heads_within_tolerance(tmp_path, tiny_folder):
    """benchmarks/prune_sweep.py over real stage outputs: table, curve, and the best point by the rule."""
    import subprocess
    import sys

    from conftest import REPO

    runs = {}
    for n in (1, 2):
        _, manifest = _run(tmp_path, tiny_folder, f"prune.num_heads={n}", "prune.compare_random=false",
                           "prune.criterion=ablation", "prune.finetune_steps=0", f"prune.name=prune-n{n}")
        runs[n] = manifest["metrics"]
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "prune_sweep.py"), str(tmp_path),
                           "--tolerance", "1.0"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = (tmp_path / "prune-sweep" / "report.md").read_text()
    assert (tmp_path / "prune-sweep" / "sweep.png").stat().st_size > 0
    assert "`prune-n2`: 2 heads removed" in report  # everything is within a tolerance of 1.0: the most heads win
    assert report.count("| ablation |") == 2
    strict = subprocess.run([sys.executable, str(REPO / "benchmarks" / "prune_sweep.py"), str(tmp_path),
                             "--tolerance", "-1.0"], capture_output=True, text=True, timeout=300)
    assert strict.returncode == 0 and "No run kept exact match within" in strict.stdout
    assert not list(tmp_path.glob(".tmp-prune-sweep-*"))


@pytest.mark.slow
def test_multirun_sweep_through_joblib_writes_one_folder_per_job(tmp_path, tiny_folder, corpus_root):
    """``python -m pipeline -m`` with two values: the joblib launcher runs both jobs, each in its own folder."""
    from conftest import run_cli

    root = tmp_path / "art"
    shutil.copytree(corpus_root / "corpus", root / "corpus")
    proc = run_cli("-m", "stage=prune", f"artifacts.dir={root}", f"prune.model={tiny_folder}", "model.threads=1",
                   *FAST, "prune.compare_random=false", "prune.finetune_steps=0", "prune.num_heads=1,2",
                   "prune.eval_splits=[eval]", timeout=600)  # the launcher is under test, not the splits
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the launcher that ran the sweep, from the config Hydra saved for it (not its log wording)
    saved = list((root / ".hydra" / "multirun").glob("*/multirun.yaml"))
    assert len(saved) == 1 and "hydra_plugins.hydra_joblib_launcher" in saved[0].read_text()
    jobs = [p for p in root.glob("prune-*") if (p / "model").is_dir()]
    # the overrides are long: each folder name is a readable prefix + a hash of all of them
    assert len(jobs) == 2 and all(len(p.name) < 110 for p in jobs), sorted(p.name for p in root.iterdir())
    removed = sorted(json.loads((p / "manifest.json").read_text())["metrics"]["heads_removed"] for p in jobs)
    assert removed == [1, 2]
    assert not (root / "prune").exists()


def test_holds_needs_both_tolerances_on_a_split():
    cfg = prune.PruneConfig()  # 1 point exact match, 5 % relative CER
    original = {"n": 10, "exact_match": 0.55, "cer": 0.20}

    def holds(exact_match, cer):
        return measure.holds({"n": 10, "exact_match": exact_match, "cer": cer}, original, cfg.em_tolerance,
                             cfg.cer_tolerance)["holds"]

    assert holds(0.545, 0.209)
    assert not holds(0.535, 0.19)   # exact match
    assert not holds(0.56, 0.211)   # CER


@pytest.mark.slow
def test_only_the_criteria_asked_for_are_computed_and_a_registered_one_can_be_chosen(tmp_path, tiny_folder):
    from pipeline.pruning import scores as head_scores

    calls = []

    def last_layer_first(inp):
        calls.append(len(inp.attns))
        return [[float(h - 10 * l) for h in range(head_scores.num_heads(a))] for l, a in enumerate(inp.attns)]

    head_scores.register(head_scores.Criterion("last_layer_first", last_layer_first))
    try:
        _, manifest = _run(tmp_path / "a", tiny_folder, "prune.num_heads=1", "prune.criterion=last_layer_first", "prune.normalize=global",
                           "prune.compare_random=false", "prune.finetune_steps=0", "prune.recovery=false")
        m = manifest["metrics"]
        assert calls and m["removed"] == {str(len(m["encoder_heads"]) - 1): [0]}  # the lowest score: last layer
        assert m["spearman_vs_ablation"] == {}
        assert not list((tmp_path / "a" / "cache").glob("prune-head-scores-*"))  # nothing that reads images ran
        _, compared = _run(tmp_path / "b", tiny_folder, "prune.num_heads=1", "prune.criterion=l2_qkv",
                           "prune.compare_random=false", "prune.finetune_steps=0", "prune.recovery=false",
                           "prune.compare_criteria=[l2_qkvo]")
        assert set(compared["metrics"]["spearman_vs_ablation"]) == {"l2_qkv", "l2_qkvo"}
        assert "Spearman vs single-head ablation" in (tmp_path / "b" / "prune" / "report.md").read_text()
    finally:
        head_scores.CRITERIA.pop("last_layer_first", None)


def test_the_teacher_cache_gives_the_teachers_own_outputs_for_any_batch_it_is_asked(tmp_path):
    """Cached once an image, the teacher's encoder output and logits are what it computes for the
    batch in hand (rows kept at their own length; the padded tail is zero and masked by the loss)."""
    import torch

    from pipeline.pruning.recover import TeacherCache
    from pipeline.pruning.scores import id_batch
    from tiny_model import build_tiny

    teacher = build_tiny()
    teacher.model.eval()
    images = torch.rand(5, 1, 32, 64)
    targets = [[teacher.bos_id, 5, 6, teacher.eos_id], [teacher.bos_id, 7, teacher.eos_id],
               [teacher.bos_id, 8, 9, 10, 11, teacher.eos_id], [teacher.bos_id, 5, teacher.eos_id],
               [teacher.bos_id, 6, 6, teacher.eos_id]]
    cache = TeacherCache(teacher)
    for idx in ([0, 1, 2], [2, 3, 4], [4, 0]):  # the second and third batches reuse rows of the earlier ones
        inp, tgt = id_batch(teacher, [targets[i] for i in idx])
        lengths = tgt.ne(teacher.pad_id).sum(1).tolist()
        mem, logits = cache.batch(idx, images, inp, lengths)
        with torch.no_grad():
            want_mem = teacher.encode(images[idx])
            want = teacher.decode_logits(inp, want_mem).float()
        assert torch.allclose(mem, want_mem, atol=1e-5)
        for r, n in enumerate(lengths):
            assert torch.allclose(logits[r, :n], want[r, :n], atol=1e-4)
            assert not logits[r, n:].any()
    assert sorted(cache.rows) == [0, 1, 2, 3, 4]
