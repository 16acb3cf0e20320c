"""Stage benchmark on the tiny model and a package exported from it: the variants it resolves, a
missing package as one error line, the summary files and their links, the serving test's stats.
(Ratios are reported, never asserted; the real model runs only under the slow marker.)"""
from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from conftest import make_ctx, run_cli
from tiny_model import FORMULAS, build_tiny, fake_ctx
from pipeline.benchmarking import summary
from pipeline.errors import PipelineError

SMALL = ["model.max_length=8", "benchmark.samples=2", "benchmark.memory_images=2", "benchmark.clients=2",
         "benchmark.requests=2", "benchmark.full_prefix_limit=3", "benchmark.torch_limit=6", "benchmark.timing_images=4"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Artifacts root: the tiny model, 10 formulas, its ORT package as export-ort_cpu (and a copy as
    the float-original default), so both default packages exist."""
    from pipeline.stages import export

    root = tmp_path_factory.mktemp("bench")
    build_tiny().save(root / "tiny-model")
    (root / "formulas.txt").write_text("\n".join(FORMULAS[:10]) + "\n")
    ctx = fake_ctx(root, [f"export.model={root / 'tiny-model'}", "export.quantized=none",
                          f"export.formulas={root / 'formulas.txt'}", "model.max_length=8", "export.parity_images=1",
                          "export.parity_limit=2", "export.min_identical=0", "export.drafter=ngram"])
    export.run(OmegaConf.to_object(ctx.cfg.export), ctx)
    shutil.copytree(root / "export-ort_cpu", root / "other-package")
    return root


def _run(root: Path, *overrides: str) -> dict:
    from pipeline.stages import benchmark

    ctx = fake_ctx(root, [f"benchmark.model={root / 'tiny-model'}", f"benchmark.formulas={root / 'formulas.txt'}",
                          *SMALL, *overrides])
    return benchmark.run(OmegaConf.to_object(ctx.cfg.benchmark), ctx)


@pytest.fixture(scope="module")
def benched(root) -> dict:
    return _run(root, f"+benchmark.packages.mine={root / 'other-package'}")


def test_variants_resolved_defaults_skipped_and_requested(tmp_path):
    from pipeline.benchmarking.variants import resolve_packages

    (tmp_path / "export-ort_cpu").mkdir()
    (tmp_path / "export-ort_cpu" / "package.json").write_text("{}")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "package.json").write_text("{}")
    defaults = {"deployable": "export-ort_cpu", "float-original": "export-ort_cpu-float-original"}
    found, notes = resolve_packages({"mine": str(tmp_path / "elsewhere")}, defaults, tmp_path)
    assert found == {"deployable": tmp_path / "export-ort_cpu", "mine": tmp_path / "elsewhere"}
    assert len(notes) == 1 and "export-ort_cpu-float-original" in notes[0] and "skipped" in notes[0]
    # a comparison row stage=all leaves out says which setting makes it
    _, notes = resolve_packages({}, {"int8-original": "export-ort_cpu-int8-original"}, tmp_path,
                                {"int8-original": "quantize.original=true"})
    assert "quantize.original=true" in notes[0] and "comparison" in notes[0]
    # a label the user names replaces the default of that label
    found, _ = resolve_packages({"deployable": str(tmp_path / "elsewhere")}, defaults, tmp_path)
    assert found == {"deployable": tmp_path / "elsewhere"}


@pytest.mark.slow
def test_run_measures_every_variant_on_the_same_images(root, benched):
    m = benched["metrics"]
    labels = [v["label"] for v in m["variants"]]
    # each package has a drafter (export's default): it also runs as "(greedy)", plain greedy at batch 1
    assert labels == ["torch tiny-model", "torch tiny-model + KV cache", "deployable", "mine", "deployable (greedy)",
                      "mine (greedy)"]
    kinds = {v["label"]: v["kind"] for v in m["variants"]}
    assert kinds["deployable"] == kinds["mine"] == "package"
    by = {v["label"]: v for v in m["variants"]}
    assert by["torch tiny-model"]["accuracy_n"] == by["torch tiny-model"]["compared_n"] == 3   # full_prefix_limit
    assert by["torch tiny-model + KV cache"]["accuracy_n"] == 6                                  # torch_limit
    assert by["deployable"]["accuracy_n"] == m["n_formulas"] == 10
    assert by["deployable"]["compared_n"] == 6          # compared with the reference where both read
    assert by["deployable"]["location"] == str(root / "export-ort_cpu")
    for v in m["variants"]:  # where the decoding time went: steps and milliseconds per formula
        assert 1 <= v["steps_per_formula"] <= m["max_length"] - 1
        assert v["decoder_ms_per_formula"] > 0 and v["encoder_ms_per_formula"] > 0
    for v in m["variants"]:
        assert v["latency"]["n"] == 2 and v["latency"]["p50_ms"] <= v["latency"]["p95_ms"] <= v["latency"]["max_ms"]
        assert 0 < v["latency"]["encoder_p50_ms"] < v["latency"]["max_ms"]  # the encoder's share of the same reads
        assert v["images_per_s"] > 0 and v["size_mb"] > 0 and v["peak_mb"] >= v["base_mb"] > 0
        assert 0.0 <= v["identical_tokens"] <= 1.0
    # the ratios are to the shipped (first) variant, computed from the reported numbers
    shipped = m["variants"][0]
    assert shipped["ratios"]["speedup_p50"] == 1.0
    d = by["deployable"]
    assert d["ratios"]["speedup_p50"] == pytest.approx(shipped["latency"]["p50_ms"] / d["latency"]["p50_ms"])
    assert d["ratios"]["size"] == pytest.approx(d["size_mb"] / shipped["size_mb"])
    assert d["ratios"]["exact_match_points_vs_reference"] == 0.0  # same tokens, same formulas
    # the KV-cached torch decoder is the reference: identical to itself, and fp32 ORT reads the same tokens
    assert by["torch tiny-model + KV cache"]["identical_tokens"] == 1.0
    assert d["identical_tokens"] == 1.0
    # the two packages read the split side by side (benchmark.workers=2), then were timed alone
    assert by["deployable"]["timed_n"] == by["mine"]["timed_n"] == 4          # timing_images
    assert by["torch tiny-model"]["timed_n"] == 3                             # its own accuracy pass
    assert any("2 at a time" in n for n in m["notes"])
    folder = root / "benchmark"
    for name in ("report.md", "pareto.png", "benchmark.json", "predictions.jsonl", "manifest.json"):
        assert (folder / name).is_file(), name
    assert len((folder / "predictions.jsonl").read_text().splitlines()) == 10
    report = (folder / "report.md").read_text()
    assert "## Serving" in report and "## Where the time went" in report
    d = by["deployable"]["latency"]["encoder_p50_ms"]
    assert "| encoder p50 ms, batch 1 |" in report and f"| {d:.1f} |" in report
    assert set(m["phase_seconds"]) == {"load and render", "accuracy", "timing", "speculative check", "latency",
                                       "serving", "peak memory"}
    # an ort_cpu package reads a batch image by image speculatively (package.json: speculative_batches), so its
    # greedy twin reads the split itself, in greedy steps (the tiny float model: the same tokens); the
    # speculative check reads every formula both ways at batch 1
    assert by["deployable (greedy)"]["exact_match"] == by["deployable"]["exact_match"]
    assert by["deployable (greedy)"]["timed_n"] == 4 and any("image by image speculatively" in n for n in m["notes"])
    spec = m["speculative"]["deployable"]
    assert spec["drafter"] == "ngram" and set(spec["splits"]) == {"formulas"}
    r = spec["splits"]["formulas"]
    assert r["n"] == 10 and r["identical"] == 1.0 and r["identical_verify_greedy"] == 1.0
    assert 1 <= r["calls_per_formula"] <= r["greedy_calls_per_formula"]
    assert "## Speculative decoding" in report and "| deployable | ngram (k=8) | formulas | 10 | 1.000 | 1.000 |" in report
    assert set(json.loads((folder / "predictions.jsonl").read_text().splitlines()[0])) == \
        {"truth", "torch tiny-model", "torch tiny-model + KV cache", "deployable", "mine", "deployable (greedy)",
         "mine (greedy)"}


@pytest.mark.slow
def test_packages_read_side_by_side_read_what_they_read_alone(root, benched):
    """workers=2 (threads sharing the machine) and workers=1 (one variant after another) give the
    same greedy tokens for every package; only the timing figures' source differs."""
    alone = _run(root, "benchmark.workers=1", "benchmark.name=benchmark-alone", "benchmark.summary=false",
                 f"+benchmark.packages.mine={root / 'other-package'}")["metrics"]
    side = benched["metrics"]
    lines = lambda name: (root / name / "predictions.jsonl").read_text()  # noqa: E731
    assert lines("benchmark-alone") == lines("benchmark")
    for a, b in zip(alone["variants"], side["variants"]):
        assert (a["label"], a["exact_match"], a["cer"], a["steps_per_formula"]) == \
               (b["label"], b["exact_match"], b["cer"], b["steps_per_formula"])
    assert {v["timed_n"] for v in alone["variants"] if v["kind"] == "package"} == {10}
    assert not any("at a time" in n for n in alone["notes"])


@pytest.mark.slow
def test_summary_files_hold_the_table_and_links_to_every_report(root, benched):
    md = (root / "summary.md").read_text()
    payload = json.loads((root / "summary.json").read_text())
    stages = {s["folder"]: s for s in payload["stages"]}
    assert {"benchmark", "export-ort_cpu", "other-package"} <= set(stages)
    assert stages["export-ort_cpu"]["report"] == "export-ort_cpu/report.md"
    for s in payload["stages"]:
        assert f"]({s['report']})" in md
        assert (root / s["report"]).is_file(), s["report"]
    assert "| deployable |" in md and "![Pareto](benchmark/pareto.png)" in md
    assert str(root / "export-ort_cpu") in md                          # where the package is
    assert [p["label"] for p in payload["packages"]] == ["deployable", "mine"]
    assert payload["serving"]["label"] == "deployable"
    assert not list(root.glob(".tmp-*"))


@pytest.mark.slow
def test_unchanged_rerun_reuses_and_rewrites_the_summary(root, benched):
    (root / "summary.md").unlink()
    again = _run(root, f"+benchmark.packages.mine={root / 'other-package'}")
    assert again["key"] == benched["key"] and again["seconds"] == benched["seconds"]
    assert (root / "summary.md").is_file()


@pytest.mark.slow
def test_identical_tokens_only_between_variants_of_one_vocabulary(root, tmp_path):
    """A package whose decoder speaks another vocabulary (distill's BPE) shows "–" for identical
    tokens, not 0.000: its ids index other strings than the reference's. Packages that decode with
    another layout-run cap than the rest are named in the notes."""
    bpe = tmp_path / "bpe-package"
    shutil.copytree(root / "other-package", bpe)
    meta = json.loads((bpe / "package.json").read_text())
    meta["tokenizer"] = {**meta.get("tokenizer", {}), "kind": "bpe"}
    meta["layout_run_cap"] = 0  # as if exported before the cap: the notes say the caps differ
    (bpe / "package.json").write_text(json.dumps(meta))
    m = _run(root, f"+benchmark.packages.bpe={bpe}", "benchmark.default_packages=false",
             "benchmark.name=bench-vocab", "benchmark.memory=false")["metrics"]
    by = {v["label"]: v for v in m["variants"]}
    assert by["bpe"]["identical_tokens"] is None
    assert by["torch tiny-model + KV cache"]["identical_tokens"] == 1.0
    assert any("identical tokens: – for bpe" in n for n in m["notes"])
    assert any("different layout-run caps" in n and "bpe 0" in n and "+ KV cache 8" in n for n in m["notes"])
    assert not any("layout-run caps" in n for n in _run(root, "benchmark.name=bench-caps", "benchmark.memory=false")["metrics"]["notes"])  # all the same: no note
    row = next(r for r in summary.table_rows(m["variants"]) if r[0] == "bpe")
    assert row[summary.HEADER.index("identical tokens")] == "–"


@pytest.mark.slow
def test_without_greedy_rows_the_speculative_check_is_said_to_be_off(root):
    """The check reads a package with a drafter against its plain greedy twin: without the twins'
    rows there is none, and the notes say so rather than leave the section out unexplained."""
    m = _run(root, "benchmark.greedy_rows=false", "benchmark.default_packages=false", "benchmark.memory=false",
             f"+benchmark.packages.mine={root / 'other-package'}", "benchmark.name=bench-no-twins")["metrics"]
    assert m["speculative"] == {} and not any(v["label"].endswith("(greedy)") for v in m["variants"])
    assert any(n.startswith("benchmark.greedy_rows=false: no speculative check of mine") for n in m["notes"])


@pytest.mark.slow
def test_missing_package_named_is_one_error_line(root, tmp_path):
    with pytest.raises(PipelineError, match=r"benchmark.packages: no exported package .* at nope="):
        _run(root, f"+benchmark.packages.nope={tmp_path / 'no-such-package'}", "benchmark.name=bench-missing")
    assert not (root / "bench-missing").exists()
    proc = run_cli("stage=benchmark", f"artifacts.dir={tmp_path}", f"+benchmark.packages.nope={tmp_path / 'x'}",
                   timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: benchmark.packages: no exported package"), proc.stderr


@pytest.mark.slow
def test_serving_returns_its_stats_from_concurrent_clients(root):
    from pipeline.benchmarking import measure
    from pipeline.benchmarking.variants import package_variant

    variant = package_variant("deployable", root / "export-ort_cpu", threads=1)
    threads, lock = set(), threading.Lock()

    def decode(images, max_length, batch_size):
        with lock:
            threads.add(threading.get_ident())
        assert images.shape[0] == batch_size == 1
        return variant.decode(images, max_length, batch_size)

    images = np.random.default_rng(0).random((3, 1, 32, 64)).astype(np.float32)
    stats = measure.serve(decode, images, max_length=8, clients=3, requests=4)
    assert stats["clients"] == 3 and stats["requests_per_client"] == 4 and stats["n"] == 12
    assert 0 < stats["p50_ms"] <= stats["p95_ms"] <= stats["max_ms"]
    assert stats["mean_ms"] > 0 and stats["requests_per_s"] > 0
    assert len(threads) > 1  # requests really came from several client threads
    with pytest.raises(PipelineError, match="clients >= 1"):
        measure.serve(decode, images, 8, clients=0)


def test_pareto_front():
    from pipeline.benchmarking.summary import pareto_front

    assert pareto_front([(1, 0.5), (10, 0.5), (5, 0.6), (2, 0.4)]) == [1, 2]


@pytest.mark.slow
def test_real_model_against_its_exported_package():
    """The shipped model vs its ORT package on 2 formulas (export_session's package)."""
    from export_session import MAX_LENGTH, artifacts_root, ort_package
    from pipeline.stages import benchmark

    pkg = ort_package()
    root = artifacts_root()
    ctx = make_ctx(root, [f"+benchmark.packages.exported={pkg}", "benchmark.default_packages=false",
                          f"benchmark.formulas={root / 'formulas.txt'}", "benchmark.samples=1", "benchmark.warmup=0",
                          "benchmark.full_prefix_limit=2", "benchmark.memory=false", "benchmark.clients=2",
                          "benchmark.requests=1", "benchmark.name=benchmark-real", f"model.max_length={MAX_LENGTH}"])
    m = benchmark.run(OmegaConf.to_object(ctx.cfg.benchmark), ctx)["metrics"]
    by = {v["label"]: v for v in m["variants"]}
    assert set(by) == {"torch original", "torch original + KV cache", "exported", "exported (greedy)"}
    # the real model's package decodes speculatively token for token as it decodes greedily
    assert m["speculative"]["exported"]["splits"]["formulas"]["identical"] == 1.0
    assert m["speculative"]["exported"]["splits"]["formulas"]["identical_verify_greedy"] == 1.0
    for v in by.values():  # the shipped model reads both formulas right, and so does every variant
        assert v["exact_match"] == 1.0 and v["identical_tokens"] == 1.0 and v["accuracy_n"] == 2
    assert m["serving"]["n"] == 2 and by["exported"]["peak_mb"] is None
    assert (root / "summary.md").is_file()


def test_evaluate_stage_reading_of_the_shipped_model_is_noted_for_the_same_cap(tmp_path):
    from pipeline.stages.benchmark import _evaluate_note

    (tmp_path / "evaluate").mkdir()
    manifest = {"key": "k1", "config": {"model": "original", "max_length": 160},
                "metrics": {"source": "corpus split 'eval'", "n": 574, "kv_cache": True, "exact_match": 0.549,
                            "cer": 0.268}}
    (tmp_path / "evaluate" / "manifest.json").write_text(json.dumps(manifest))
    ctx = make_ctx(tmp_path)
    key, line = _evaluate_note(ctx, "original", 160)
    assert key == "k1" and "n=574" in line and "exact match 0.549" in line and "KV-cached" in line
    assert _evaluate_note(ctx, "original", 64) is None          # another cap: not comparable
    assert _evaluate_note(ctx, "prune", 160) is None            # another model


def test_a_pattern_collects_a_sweeps_packages_and_one_that_matches_nothing_is_an_error(tmp_path):
    from pipeline.benchmarking.variants import resolve_packages
    from pipeline.errors import PipelineError

    for name in ("export-ort_cpu-prune.num_heads=4", "export-ort_cpu-prune.num_heads=8", "export-ort_cpu-other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "package.json").write_text("{}")
    (tmp_path / "export-ort_cpu-prune.num_heads=9").mkdir()  # no package.json: not a package
    found, _ = resolve_packages({"sweep": "export-ort_cpu-prune.num_heads=*"}, {}, tmp_path)
    assert found == {f"sweep export-ort_cpu-prune.num_heads={h}": tmp_path / f"export-ort_cpu-prune.num_heads={h}"
                     for h in (4, 8)}
    with pytest.raises(PipelineError, match="matches no exported package"):
        resolve_packages({"sweep": "export-ort_cpu-none-*"}, {}, tmp_path)


@pytest.mark.slow
def test_the_packages_also_read_the_shift_split(root):
    """Without a formulas file the benchmark reads the corpus split and, for the packages, each of
    benchmark.extra_splits: their exact match and CER become the table's last columns."""
    from pipeline.benchmarking import summary
    from tiny_model import tiny_shift

    from pipeline.stages import benchmark

    ctx = fake_ctx(root, [f"benchmark.model={root / 'tiny-model'}", *SMALL, "benchmark.name=benchmark-splits",
                          "benchmark.summary=false", "benchmark.memory=false", "benchmark.eval_limit=6"])
    m = benchmark.run(OmegaConf.to_object(ctx.cfg.benchmark), ctx)["metrics"]
    assert m["extra_splits"] == ["shift"]
    by = {v["label"]: v for v in m["variants"]}
    assert by["deployable"]["splits"]["shift"]["n"] == min(6, len(tiny_shift()))
    assert 0.0 <= by["deployable"]["splits"]["shift"]["exact_match"] <= 1.0
    assert by["torch tiny-model"]["splits"] == {}
    header = summary.table(m["variants"]).splitlines()[0]
    assert header.endswith("| exact match (shift) | CER (shift) |")
    # the shift readings are kept formula by formula (paired comparisons), and they are what was scored
    from pipeline.metrics import normalize

    rows = [json.loads(line) for line in (root / "benchmark-splits" / "predictions-shift.jsonl").read_text().splitlines()]
    assert len(rows) == by["deployable"]["splits"]["shift"]["n"] and "torch tiny-model" not in rows[0]
    exact = np.mean([normalize(r["deployable"]) == normalize(r["truth"]) for r in rows])
    assert exact == pytest.approx(by["deployable"]["splits"]["shift"]["exact_match"])


@pytest.mark.slow
def test_extra_split_equal_to_the_main_one_is_one_error(root):
    from pipeline.stages import benchmark

    ctx = fake_ctx(root, [f"benchmark.model={root / 'tiny-model'}", "benchmark.extra_splits=[eval]"])
    with pytest.raises(PipelineError, match="extra_splits"):
        benchmark.run(OmegaConf.to_object(ctx.cfg.benchmark), ctx)


@pytest.mark.slow
def test_a_reading_split_over_two_session_sets_equals_one(root):
    """quantize's greedy readings cut the images into runs of whole batches, one per session set,
    read side by side: the same tokens as one session set reading them all."""
    from pipeline.adapters.base import load_adapter
    from pipeline.data.render import render_formula
    from pipeline.export.runtime import OnnxPackage
    from pipeline.quantization.measure import read

    adapter = load_adapter("latex_ocr_junia", str(root / "tiny-model"))
    images = np.stack([adapter.preprocess(render_formula(f)).numpy() for f in FORMULAS[:10]]).astype(np.float32)
    one = read(OnnxPackage(root / "export-ort_cpu", threads=1), None, images, FORMULAS[:10], 8, 4)
    two = read([OnnxPackage(root / "export-ort_cpu", threads=1) for _ in range(2)], None, images, FORMULAS[:10], 8, 4)
    assert two.token_ids == one.token_ids and two.exact == one.exact and len(two.token_ids) == 10


@pytest.mark.slow
def test_a_reading_over_two_session_sets_stops_after_the_batch_in_hand_on_a_signal(root, monkeypatch):
    """Ctrl-C / SIGTERM reach the main thread only: the reading threads check after each batch, so
    an interrupted search stops within a batch instead of finishing its half of the split."""
    import signal

    from pipeline import interrupts
    from pipeline.adapters.base import load_adapter
    from pipeline.data.render import render_formula
    from pipeline.errors import Interrupted
    from pipeline.export.runtime import OnnxPackage
    from pipeline.quantization.measure import read

    adapter = load_adapter("latex_ocr_junia", str(root / "tiny-model"))
    images = np.stack([adapter.preprocess(render_formula(f)).numpy() for f in FORMULAS[:16]]).astype(np.float32)
    encoded = []
    real_encode = OnnxPackage.encode
    monkeypatch.setattr(OnnxPackage, "encode", lambda self, batch: encoded.append(len(batch)) or real_encode(self, batch))
    interrupts.reset()
    interrupts._received.append(signal.SIGTERM)  # what the handler records before it raises in the main thread
    try:
        with pytest.raises(Interrupted, match="while reading a quantized variant"):
            read([OnnxPackage(root / "export-ort_cpu", threads=1) for _ in range(2)], None, images, FORMULAS[:16], 8, 2)
    finally:
        interrupts.reset()
    # at most one batch in hand per thread, not the four each had to read (the second thread's run may
    # not have started when the first stopped: Executor.map then cancels it, and it reads nothing)
    assert encoded in ([2], [2, 2])


@pytest.mark.slow
def test_speculative_settings_script_runs_the_real_loop_on_a_package(root, tmp_path):
    """benchmarks/speculative.py on the tiny package: drafters built from its train readings, judged on
    calib (calls through the real loop), the best of each kind checked on eval; calls never exceed greedy's."""
    import subprocess
    import sys

    from conftest import REPO

    rows = [{"latex": f, "split": split} for split in ("train", "calib", "eval") for f in FORMULAS[:6]]
    (tmp_path / "formulas.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "table.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "speculative.py"), str(root / "export-ort_cpu"),
                           str(tmp_path / "formulas.jsonl"), "--train", "6", "--calib", "4", "--orders", "1", "3",
                           "--min-counts", "1", "--draft-lens", "1", "4", "--check", "eval", "--max-length", "8",
                           "--student-bound", "--time", "3", "--out", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = json.loads(out.read_text())
    assert table["first_ms"] > 0 and table["step_ms"] > 0
    # the real loops timed on 3 formulas of calib and of eval: greedy, the best ngram setting, a drafter
    # proposing greedy's reading
    timed = table["timed"]
    assert timed["setting"] == table["rows"][0]["drafter"] and set(timed) == {"setting", "draft_len", "calib", "eval"}
    for split in ("calib", "eval"):
        assert timed[split]["n"] == 3
        greedy = timed[split]["greedy"]
        assert greedy["calls_ratio"] == 1.0 and greedy["calls_per_formula"] > 1
        for how in ("drafter", "perfect"):
            assert 1 <= timed[split][how]["calls_per_formula"] <= greedy["calls_per_formula"]
            assert timed[split][how]["decoder_ms"] > 0
    assert {(r["drafter"], r["draft_len"]) for r in table["rows"]} == \
        {(f"ngram order {o} min 1", k) for o in (1, 3) for k in (1, 4)}
    assert [r["est_decoder_ms"] for r in table["rows"]] == sorted(r["est_decoder_ms"] for r in table["rows"])
    for r in table["rows"] + table["checks"]:
        assert 1 <= r["calls_per_formula"] <= r["greedy_calls"] and r["accepted_per_verify"] >= 0
    best, *bounds = table["checks"]
    assert (best["split"], best["n"]) == ("eval", 6) and best["drafter"].startswith("ngram")
    # a perfect student's guide (the reading itself, with and without what the BPE strips), on calib and eval
    assert [(b["drafter"].split(" (")[0], b["split"]) for b in bounds] == [
        ("student bound", "calib"), ("student bound", "eval"), ("student bound, wrapper kept", "calib"),
        ("student bound, wrapper kept", "eval")]
    kept = bounds[3]  # the guide is what the package writes: every draft passes, never more calls than the table's
    assert kept["draft_len"] == best["draft_len"] and kept["calls_per_formula"] <= best["calls_per_formula"]
    # more readings to draft from: the varied grammar's (judged on calib), the calib split's (checked on eval);
    # the readings kept in a cache the next run reads instead of the package
    cache = tmp_path / "readings.json"
    more = [sys.executable, str(REPO / "benchmarks" / "speculative.py"), str(root / "export-ort_cpu"),
            str(tmp_path / "formulas.jsonl"), "--train", "6", "--calib", "4", "--orders", "3", "--min-counts", "1",
            "--draft-lens", "4", "--check", "eval", "--max-length", "8", "--varied", "0", "3", "--ship-calib",
            "--cache", str(cache), "--out", str(out)]
    proc = subprocess.run(more, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = json.loads(out.read_text())
    assert {r["drafter"] for r in table["rows"]} == {"ngram order 3 min 1", "ngram order 3 min 1 +varied 3"}
    best, shipped = table["checks"]
    assert shipped["drafter"] == f"{best['drafter']} +calib" and shipped["split"] == "eval"
    kept = json.loads(cache.read_text())
    (readings,) = kept.values()
    assert sum(k.startswith("varied\t") for k in readings) == 3 and sum(k.startswith("calib\t") for k in readings) == 4
    eos = json.loads((root / "export-ort_cpu" / "package.json").read_text())["eos_id"]
    cache.write_text(json.dumps({key: {k: ([eos] if k.startswith("eval\t") else v) for k, v in readings.items()}
                                 for key in kept}))  # eval read as EOS alone: the next run must take that
    again = subprocess.run(more, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert {r["greedy_calls"] for r in json.loads(out.read_text())["checks"]} == {1.0}
    bad = subprocess.run([sys.executable, str(REPO / "benchmarks" / "speculative.py"), str(root / "export-ort_cpu"),
                          str(tmp_path / "formulas.jsonl"), "--check", "shift"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "no formulas of split(s) shift" in bad.stderr


@pytest.mark.slow
def test_decoder_call_script_profiles_a_step_and_times_both_loops(root, tmp_path):
    """benchmarks/decoder_call.py on the tiny package: the profiler's per-op kernel time, node counts,
    and the session.run and IOBinding loops computing the same steps."""
    import subprocess
    import sys

    from conftest import REPO

    out = tmp_path / "call.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "decoder_call.py"), str(root / "export-ort_cpu"),
                           "--past", "3", "--steps", "4", "--repeats", "2", "--calls", "5", "--verify-widths", "1", "3",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text())["packages"][str(root / "export-ort_cpu")]
    assert got["same_logits"] is True
    assert 0 < got["nodes_optimized"] <= got["nodes"]
    assert "MultiHeadAttention" in got["by_op"] and 0 < got["kernels"] <= got["model_run"]
    assert got["step_ms"] > 0 and got["step_ms_iobinding"] > 0
    # decoder_verify profiled at each width asked: the same ops, more kernel time for more tokens
    assert set(got["verify"]) == {"1", "3"} and "MultiHeadAttention" in got["verify"]["3"]["by_op"]
    assert "decoder_verify, kernel us a call by width" in proc.stdout
    bad = subprocess.run([sys.executable, str(REPO / "benchmarks" / "decoder_call.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "not an exported package" in bad.stderr.splitlines()[-1]


@pytest.mark.slow
def test_decoder_widths_script_times_verify_widths_and_step_batches(root, tmp_path):
    """benchmarks/decoder_widths.py on the tiny model (CPU): a verify-shaped call per width at batch 1 and a
    step-shaped call per batch, each against width 1 / the smallest batch; bad settings are one error line."""
    import subprocess
    import sys

    from conftest import REPO

    script = [sys.executable, str(REPO / "benchmarks" / "decoder_widths.py"), "--model", str(root / "tiny-model")]
    out = tmp_path / "widths.json"
    proc = subprocess.run([*script, "--max-width", "3", "--batches", "2", "1", "--past", "5", "--repeat", "3",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text())
    assert (got["device"], got["dtype"], got["past"]) == ("cpu", "float32", 5)
    assert list(got["width_ms"]) == ["1", "2", "3"] and list(got["batch_ms"]) == ["1", "2"]
    assert got["width_ratio"]["1"] == 1.0 and got["batch_ratio"]["1"] == 1.0
    assert all(ms > 0 for ms in [*got["width_ms"].values(), *got["batch_ms"].values()])
    assert "width (batch 1): 1:" in proc.stdout and "batch (1 token): 1:" in proc.stdout
    for args, said in ((["--past", "63"], "exceed the decoder's 64 positions"),
                       (["--model", str(tmp_path / "none")], str(tmp_path / "none")),
                       (["--device", "cuda:7"], "no CUDA device")):
        bad = subprocess.run([*script, *args], capture_output=True, text=True, timeout=300)
        assert bad.returncode == 2 and said in bad.stderr.splitlines()[-1], bad.stderr[-2000:]


def test_float_original_is_also_read_as_users_ran_it_before_denormals_were_flushed(root):
    """model.flush_denormals (on): float-original twice, with the deployable's session options and with
    ONNX Runtime's plain ones, so a ratio never mixes what compression did with what a flag did; the note
    says whether the two read the same tokens."""
    m = _run(root, f"+benchmark.packages.float-original={root / 'other-package'}", "benchmark.default_packages=false",
             "benchmark.greedy_rows=false", "benchmark.memory=false", "benchmark.extra_splits=[]",
             "benchmark.summary=false", "benchmark.name=plain")["metrics"]
    by = {v["label"]: v for v in m["variants"]}
    assert set(by) == {"torch tiny-model", "torch tiny-model + KV cache", "float-original",
                       "float-original (plain ORT)"}
    assert by["float-original (plain ORT)"]["location"] == by["float-original"]["location"]
    note = next(n for n in m["notes"] if n.startswith("denormals flushed"))
    assert "read 10 of 10 formulas token for token alike" in note
    off = _run(root, f"+benchmark.packages.float-original={root / 'other-package'}", "benchmark.default_packages=false",
               "benchmark.greedy_rows=false", "benchmark.memory=false", "benchmark.extra_splits=[]",
               "benchmark.summary=false", "benchmark.name=plain-off", "model.flush_denormals=false",
               "benchmark.samples=1", "benchmark.torch_limit=1", "benchmark.full_prefix_limit=1")["metrics"]
    assert "float-original (plain ORT)" not in {v["label"] for v in off["variants"]}  # nothing to compare with


def test_the_readme_table_is_generated_from_a_summary_and_names_the_machine(tmp_path):
    """README's results table comes from a run's summary.json (benchmarks/readme_table.py prints or checks
    it), its ratios against the plain float original, the machine named."""
    import subprocess
    import sys

    def row(label, em, p50, ips, kept=None):
        return {"label": label, "exact_match": em, "cer": 0.2, "accuracy_n": 574, "latency": {"p50_ms": p50},
                "images_per_s": ips, "size_mb": 10.0, "tokens_kept": kept,
                "splits": {"shift": {"exact_match": em - 0.05, "cer": 0.25, "n": 382}}}

    payload = {"threads": 1, "machine": {"cpu": "Some CPU", "cores": 2, "platform": "Linux"},
               "variants": [row("torch m", 0.5, 2000, 0.5), row("float-original (plain ORT)", 0.556, 200, 4.0),
                            row("float-original", 0.556, 100, 8.0),
                            row("deployable", 0.587, 50, 16.0, {"mean": 210.4, "p95": 384, "share": 0.2, "n": 574})]}
    table = summary.readme_table(payload)
    assert "on Some CPU, 2 cores (Linux)" in table and "Eval split (574 formulas), shift split (382" in table
    lines = [l for l in table.splitlines() if l.startswith("| `")]
    assert [l.split(" | ")[0] for l in lines] == ["| `float-original (plain ORT)`", "| `float-original`", "| `deployable`"]
    assert "50 (4.00x)" in lines[2] and "16.00 (4.00x)" in lines[2] and "210 / 384" in lines[2]
    assert lines[0].rstrip(" |").endswith("all")
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(payload))
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "readme_table.py"
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n" + table + "\n")
    assert subprocess.run([sys.executable, str(script), str(path), "--check", str(readme)]).returncode == 0
    readme.write_text("# x\n\nan old table\n")
    done = subprocess.run([sys.executable, str(script), str(path), "--check", str(readme)], capture_output=True, text=True)
    assert done.returncode == 1 and "does not hold the table" in done.stderr
