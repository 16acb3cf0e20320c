"""The stages' steps below the stage, each called alone (the stage tests run them end to end)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from pipeline.errors import PipelineError


def test_tokenizer_sets_keep_the_formulas_that_normalize_to_something():
    from pipeline.tokenization.measure import normalized

    raw, norm, dropped = normalized(["$x^{2}$", "  ", r"\begin{equation}\end{equation}", r"\frac{a}{b}"], "eval")
    assert raw == ["$x^{2}$", r"\frac{a}{b}"] and norm == ["x^{2}", r"\frac{a}{b}"] and dropped == 2
    with pytest.raises(PipelineError, match="no train formula is left once normalized"):
        normalized(["", "$$"], "train")


def test_tokenizer_targets_follow_the_measured_figures():
    from pipeline.tokenization.measure import CHAR_NAME, OURS_NAME, PLAIN_NAME, targets

    seg = {CHAR_NAME: {"tokens_mean": 30.0}, PLAIN_NAME: {"tokens_mean": 12.0},
           OURS_NAME: {"tokens_mean": 10.0, "commands_split": 0, "round_trip_exact": 1.0}}
    metrics = {"reduction_vs_char": 3.0, "cache": {"normalized": {"ms_per_request": 0.01, "hit_rate": 0.97}}}
    got = targets(metrics, seg, {"chosen_size": 2560}, 2560)
    assert all(got.values()) and not any(k.startswith("shift") for k in got)
    metrics["shift"] = {"reduction_vs_char": 2.0, "tokenizers": {OURS_NAME: {"commands_split": 1}}}
    got = targets(metrics, seg, {"chosen_size": 2048}, 2560)
    assert [k for k, v in got.items() if not v] == ["shift split: tokens >= 2.5x fewer than char-level",
                                                     "shift split: 0 LaTeX commands split",
                                                     "vocab_size is the held-out train choice"]


def test_distill_truth_targets_need_no_teacher_reading():
    from pipeline.distillation.targets import training_texts

    kept = [("a", "x^2"), ("b", r"\frac{a}{b}")]
    assert training_texts(None, "truth", None, "hash", None, kept, 8, 2) == (["x^2", r"\frac{a}{b}"], 0)


def test_distill_metrics_compare_the_student_with_the_char_model():
    from pipeline.distillation.report import stage_metrics

    row = {"exact_match": 0.5, "cer": 0.2, "steps_per_formula": 60.0, "hit_cap_share": 0.0, "decoder_seconds": 3.0}
    char, bpe = {**row, "texts": ["x"]}, {**row, "exact_match": 0.52, "steps_per_formula": 10.0,
                                          "decoder_seconds": 1.0, "texts": ["y"]}
    trained = {"steps": 5, "stopped_by": "steps", "minutes": 1.0, "resumed_at": None, "losses": [2.0, 1.5],
               "curve": []}
    memory = SimpleNamespace(kept=[("f1", "a"), ("templated-0", "b"), ("varied-0", "c")], kept_eval=[("e", "x")],
                             seconds=4.0, train_reused=False)
    m = stage_metrics({"model": "prune"}, trained, char, bpe, memory, 10, time.perf_counter())
    assert (m["train_images"], m["train_from_split"], m["train_varied"]) == (3, 1, 1)
    assert m["steps_ratio"] == pytest.approx(6.0) and m["decoder_time_ratio"] == pytest.approx(3.0)
    assert m["exact_match_points"] == pytest.approx(2.0) and m["final_loss"] == 1.5
    assert "texts" not in m["char"] and "texts" not in m["bpe"] and m["model"] == "prune"


def test_evaluate_report_reads_one_source_or_several():
    from pipeline.evaluation.report import by_split

    one = {"n": 3, "exact_match": 0.5}
    assert by_split(one) == {"": one}
    several = {"n": 3, "splits": {"eval": {"n": 3}, "shift": {"n": 2}}}
    assert list(by_split(several)) == ["eval", "shift"]


def test_no_latency_sample_measures_nothing():
    from pipeline.evaluation import latency_of

    assert latency_of(None, [], 16) == {}


def test_export_tolerances_follow_the_packages_least_precise_graph_and_the_overrides():
    from pipeline.export.steps import TOLERANCES, tolerances

    cfg = SimpleNamespace(min_cosine=None, min_snr_db=30.0, min_identical=None)
    level, tol = tolerances(cfg, {"encoder": "int8 qdq", "decoder_step": "fp32"})
    assert level == "int8" and tol == {**TOLERANCES["int8"], "min_snr_db": 30.0}
    assert tolerances(cfg, {"encoder": "fp16", "decoder_step": "fp32"})[0] == "fp16"
    assert tolerances(cfg, {"encoder": "fp32"})[0] == "fp32"


def test_export_builds_engines_only_for_a_tensorrt_package_that_passed():
    from pipeline.export.steps import engines

    job = SimpleNamespace(target=SimpleNamespace(name="ort_cpu"))
    assert engines(None, job, None, {}, None, []) is None
    job.target.name = "tensorrt"
    assert engines(None, job, None, {}, None, ["greedy tokens: identical on 0.5"]) == {"built": False,
                                                                                       "reason": "parity failed"}


def test_export_knows_a_quantization_aware_encoder_by_its_quantize_manifest(tmp_path):
    import json

    from pipeline.export.steps import finetuned

    encoder = tmp_path / "encoder.qdq.onnx"
    assert not finetuned(None) and not finetuned(encoder)  # no manifest beside it: not known, no
    (tmp_path / "manifest.json").write_text(json.dumps({"metrics": {"qat": {"steps": 0}}}))
    assert not finetuned(encoder)
    (tmp_path / "manifest.json").write_text(json.dumps({"metrics": {"qat": {"steps": 2}}}))
    assert finetuned(encoder)
