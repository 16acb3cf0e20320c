"""A sweep job finds its own upstream artifacts, and never quietly takes a shared one that was made
without its overrides (issue 12: "a missing upstream artifact gives a clear error or falls back as
documented")."""
from __future__ import annotations

import pytest

from conftest import make_ctx
from pipeline.context import StageContext
from pipeline.errors import PipelineError


def _model(root, name):
    (root / name / "model").mkdir(parents=True)
    (root / name / "model" / "config.json").write_text("{}")


def _artifact(root, name):
    (root / name).mkdir(parents=True)
    (root / name / "manifest.json").write_text("{}")


@pytest.fixture
def job(monkeypatch):
    """The context of a multirun job that overrides ``prune.num_heads=4`` (what Hydra would tell it)."""
    monkeypatch.setattr(StageContext, "job_overrides",
                        lambda self, stage: ["prune.num_heads=4"] if stage in ("prune", "quantize", "export") else [])


def test_outside_a_sweep_the_chain_takes_the_shared_artifacts(tmp_path):
    ctx = make_ctx(tmp_path)
    assert ctx.chain_model("auto") == "original"
    _model(tmp_path, "prune")
    assert ctx.chain_model("auto") == "prune"
    assert ctx.stage_folder("quantize") == tmp_path / "quantize"


def test_a_sweep_job_takes_its_own_pruned_model(tmp_path, job):
    ctx = make_ctx(tmp_path)
    _model(tmp_path, "prune")
    _model(tmp_path, "prune-prune.num_heads=4")
    assert ctx.chain_model("auto") == "prune-prune.num_heads=4"
    assert ctx.chain_model("original") == "original"  # an explicit reference is the user's choice


@pytest.mark.parametrize("shared", [True, False])
def test_a_sweep_job_without_its_own_pruned_model_is_an_error(tmp_path, job, shared):
    """The shared 'prune' (or the original model) was not made with the job's prune.num_heads=4:
    taking it would name the job's folders for a setting they were not made with."""
    if shared:
        _model(tmp_path, "prune")
    with pytest.raises(PipelineError, match=r"overrides prune.num_heads=4 but .*prune-prune.num_heads=4 does not exist"):
        make_ctx(tmp_path).chain_model("auto")


def test_a_sweep_job_finds_its_own_quantize_artifact_and_refuses_the_shared_one(tmp_path, job):
    ctx = make_ctx(tmp_path)
    assert ctx.stage_folder("quantize") == tmp_path / "quantize"  # none at all: the caller's fallback
    _artifact(tmp_path, "quantize")
    with pytest.raises(PipelineError, match="the shared 'quantize' was made without them"):
        ctx.stage_folder("quantize")
    _artifact(tmp_path, "quantize-prune.num_heads=4")
    assert ctx.stage_folder("quantize") == tmp_path / "quantize-prune.num_heads=4"


def test_a_job_that_overrides_no_chain_key_falls_back_to_the_shared_artifacts(tmp_path, monkeypatch):
    """``-m stage=benchmark benchmark.threads=1,2``: its chain is the shared one."""
    monkeypatch.setattr(StageContext, "job_overrides", lambda self, stage: [])
    monkeypatch.setattr(StageContext, "job_tag", lambda self, stage: "0")
    ctx = make_ctx(tmp_path)
    _model(tmp_path, "prune")
    _artifact(tmp_path, "quantize")
    assert ctx.chain_model("auto") == "prune"
    assert ctx.stage_folder("quantize") == tmp_path / "quantize"


def test_the_chain_origin_is_followed_back_through_the_manifests(tmp_path):
    """distill's student of prune's model of the user's model: the baselines' original is the user's."""
    import json

    ctx = make_ctx(tmp_path)
    assert ctx.chain_origin("original") == "original"
    assert ctx.chain_origin("some/folder") == "some/folder"
    _model(tmp_path, "prune")
    (tmp_path / "prune" / "manifest.json").write_text(json.dumps({"config": {"model": "my/model"}}))
    _model(tmp_path, "distill")
    (tmp_path / "distill" / "manifest.json").write_text(json.dumps({"config": {"model_ref": "prune"}}))
    assert ctx.chain_origin("distill") == "my/model"
    (tmp_path / "prune" / "manifest.json").write_text(json.dumps({"config": {}}))
    with pytest.raises(PipelineError, match="does not say which model 'prune' was made from"):
        ctx.chain_origin("distill")
