"""``stage=all`` exactly as ``make run`` runs it (conf/stage/all.yaml: every chain stage and every
setting it turns on), on the tiny model and a small generated corpus, end to end through the benchmark
and ``artifacts/summary.md``. Only sizes are shrunk (steps, images, formulas); a size override may
never turn a chain feature on or off, so a default that breaks the chain fails here, not two hours
into a user's run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import REPO, compose_cfg
from tiny_model import FORMULAS, SHIFT_FORMULAS, build_tiny

# sizes only: how many steps, images, formulas; never which parts run (checked below)
SIZES = [
    "model.max_length=10", "model.batch_size=4",
    "prune.num_heads=2", "prune.eval_limit=2", "prune.score_images=2", "prune.refit_images=4",
    "prune.latency_images=1", "prune.finetune_steps=2", "prune.finetune_images=4", "prune.finetune_varied=2",
    "tokenizer.vocab_size=1024", "tokenizer.curve_sizes=[1000,1024]", "tokenizer.replay_requests=200",
    "tokenizer.timing_repeats=1",
    "calibrate.size=32", "calibrate.workers=1", "calibrate.contact_sheet=4",
    "quantize.calib_images=8", "quantize.search_images=8", "quantize.decoder_search_images=8",
    "quantize.sensitivity_images=2", "quantize.eval_limit=2", "quantize.latency_images=1",
    "quantize.qat_steps=2", "quantize.qat_images=8", "quantize.original_search_images=8",
    "export.parity_limit=2", "export.parity_images=1", "export.baseline_parity_limit=2",
    "export.min_cosine=0", "export.min_snr_db=-100", "export.min_identical=0", "export.draft_images=16",
    "export.min_speculative_identical=0", "export.speculative_tie_margin=100", "benchmark.speculative_limit=4",
    "benchmark.samples=2", "benchmark.memory_images=2", "benchmark.clients=2", "benchmark.requests=2",
    "benchmark.full_prefix_limit=2", "benchmark.torch_limit=4", "benchmark.timing_images=4",
]


def _chain_settings() -> dict:
    """The keys conf/stage/all.yaml sets, flattened (``quantize.qat_steps`` -> 200)."""
    raw = yaml.safe_load((REPO / "conf" / "stage" / "all.yaml").read_text())
    flat = {}
    for section, values in raw.items():
        if isinstance(values, dict):
            flat.update({f"{section}.{k}": v for k, v in values.items()})
    return flat


def test_size_overrides_never_turn_a_chain_setting_on_or_off():
    chain = _chain_settings()
    cfg = compose_cfg(["stage=all", *SIZES])
    for override in SIZES:
        key = override.split("=", 1)[0]
        if key not in chain:
            continue
        value = cfg[key.split(".")[0]][key.split(".")[1]]
        assert isinstance(value, (int, float)) and not isinstance(value, bool), key
        assert bool(value) == bool(chain[key]), f"{override} turns {key} (all.yaml: {chain[key]}) on or off"


def _corpus(monkeypatch):
    """The real corpus code, its builders fed generated formulas (the pinned packages' take minutes)."""
    from pipeline import context
    from pipeline.data.corpus import Formula
    from pipeline.data.templates import varied_formulas
    from pipeline.metrics import normalize

    texts = list(dict.fromkeys(FORMULAS + varied_formulas(200, seed=1, max_chars=24)))
    splits = ["train", "train", "train", "calib", "calib", "eval"]
    corpus = [Formula(f"f{i:04d}", t, normalize(t), splits[i % len(splits)], "tests") for i, t in enumerate(texts)]
    shift = [Formula(f"s{i:03d}", t, normalize(t), "shift", "tests") for i, t in enumerate(SHIFT_FORMULAS)]
    monkeypatch.setattr(context, "build_corpus", lambda *a, **k: corpus)
    monkeypatch.setattr(context, "build_shift_split", lambda *a, **k: shift)


@pytest.mark.slow
def test_stage_all_with_the_default_chain_ends_with_the_deployable_package_and_the_summary(tmp_path, monkeypatch):
    from pipeline.__main__ import run_stages
    from pipeline.context import StageContext

    _corpus(monkeypatch)
    tiny = tmp_path / "tiny-model"
    build_tiny().save(tiny)
    root = tmp_path / "artifacts"
    # the model is the user's choice, not a chain setting: every stage that reads "the original" reads the tiny one
    models = [f"prune.model={tiny}", f"calibrate.model={tiny}", f"benchmark.model={tiny}"]
    cfg = compose_cfg(["stage=all", f"artifacts.dir={root}", "progress=false", *models, *SIZES])
    chain = _chain_settings()
    assert chain["prune.tokens"]["enabled"] and chain["quantize.qat_steps"]  # the chain this test is about
    done = run_stages(cfg, StageContext(cfg))

    assert {"prune", "tokenizer", "calibrate", "quantize", "export", "benchmark"} <= set(done)
    pkg = root / "export-ort_cpu"
    meta = json.loads((pkg / "package.json").read_text())
    assert meta["precision"]["encoder"].startswith("int8 qdq")  # the deployable: the chain's INT8 package
    assert meta["drafter"] == "drafter.json" and chain["export.drafter"] == "ngram"  # it decodes speculatively
    spec = json.loads((pkg / "parity.json").read_text())["speculative"]
    assert spec["identical_verify_greedy"] == 1.0  # the loop writes greedy's tokens on the verify graph, exactly
    for target in chain["export.targets"]:
        assert (root / f"export-{target}" / "manifest.json").is_file(), target
    pruned = json.loads((root / "prune" / "model" / "config.json").read_text())
    assert pruned["token_policy"]["frame_stride"] == 4 and meta["token_policy"] == pruned["token_policy"]
    assert meta["io"]["encoder"]["inputs"] == ["images", "keep"]  # the deployable reads the kept tokens
    summary = (root / "summary.md").read_text()
    assert "deployable" in summary and "float-original" in summary
    for key, folder in (("export.chain_baseline", "export-ort_cpu-float-chain"),
                        ("quantize.original", "export-ort_cpu-int8-original")):
        assert (root / folder).is_dir() == bool(chain.get(key, True)), folder  # comparisons made as set
    for stage in ("corpus", "prune", "tokenizer", "calibrate", "quantize", "export", "benchmark", "total"):
        assert f"| {stage} |" in summary, stage


def test_a_late_failure_in_stage_all_names_the_stage_and_the_setting_that_turns_its_part_off(tmp_path, monkeypatch):
    from dataclasses import replace

    from pipeline import stages
    from pipeline.__main__ import run_stages
    from pipeline.context import StageContext
    from pipeline.errors import PipelineError, optional_part

    ran = []

    def quantize(cfg, ctx):
        with optional_part("quantize.original (a comparison)", "quantize.original=false"):
            raise PipelineError("3 group(s) not in this model's graph")

    for name, spec in stages.STAGES.items():
        monkeypatch.setitem(stages.STAGES, name, replace(spec, run=quantize if name == "quantize" else
                                                         (lambda cfg, ctx, n=name: ran.append(n))))
    cfg = compose_cfg(["stage=all", f"artifacts.dir={tmp_path}", "progress=false"])
    with pytest.raises(PipelineError) as err:
        run_stages(cfg, StageContext(cfg))
    assert str(err.value) == ("stage=all, stage quantize: quantize.original (a comparison): 3 group(s) not in this "
                              "model's graph; quantize.original=false turns it off")
    assert ran == ["prune", "tokenizer", "calibrate"]  # the stages before it ran; none after
