"""stage=evaluate on small real subsets, through the CLI as a user runs it."""
from __future__ import annotations

import json

import pytest

from conftest import make_ctx, run_cli
from pipeline.data.render import render_formula

pytestmark = pytest.mark.slow


def test_evaluate_reports_eval_and_shift_splits_side_by_side(corpus_root):
    args = ("stage=evaluate", f"artifacts.dir={corpus_root}", "eval.limit=3", "eval.name=evaluate-test",
            "model.max_length=100", "eval.latency_samples=1", "progress=false")
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    out = corpus_root / "evaluate-test"
    m = json.loads((out / "eval.json").read_text())
    assert set(m["splits"]) == {"eval", "shift"}
    for split, s in m["splits"].items():
        for key in ("n", "exact_match", "image_exact_match", "cer", "bleu", "encoder_ms_per_image",
                    "decoder_ms_per_image"):
            assert key in s
        assert s["n"] == 3 and 0 <= s["exact_match"] <= s["image_exact_match"] <= 1 and s["cer"] >= 0
    assert m["splits"]["eval"]["cer"] != m["splits"]["shift"]["cer"]   # two different sets of formulas were read
    assert m["n"] == 3 and m["exact_match"] == m["splits"]["eval"]["exact_match"]  # eval split stays on top
    assert "shift split" in m["splits"]["shift"]["source"] and "latency_batch1" in m
    report = (out / "report.md").read_text()
    assert "| metric | split 'eval' | split 'shift' |" in report
    assert all(s["layout_run_cap"] == 8 for s in m["splits"].values())  # the default cap, said in the report
    assert "| layout-run cap (README, Decoding) | 8 | 8 |" in report and "layout-run cap 8" in proc.stdout
    assert (out / "exact_match_by_length.png").is_file()
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    shift_ids = {f.id for f in make_ctx(corpus_root).split("shift")[:3]}
    assert len(rows) == 6 and all(r["steps"] >= 1 for r in rows)
    assert {r["id"] for r in rows if r["split"] == "shift"} == shift_ids
    # the figures are the predictions' own: recomputed from predictions.jsonl with pipeline.metrics
    from pipeline.metrics import bleu4, corpus_cer, exact_match
    truths = {f.id: f.latex for split in ("eval", "shift") for f in make_ctx(corpus_root).split(split)[:3]}
    for split, s in m["splits"].items():
        mine = [r for r in rows if r["split"] == split]
        assert all(r["truth"] == truths[r["id"]] for r in mine)
        preds, gold = [r["pred"] for r in mine], [r["truth"] for r in mine]
        assert s["exact_match"] == pytest.approx(sum(exact_match(p, t) for p, t in zip(preds, gold)) / 3)
        assert s["cer"] == pytest.approx(corpus_cer(preds, gold)) and s["bleu"] == pytest.approx(bleu4(preds, gold))
        assert s["image_exact_match"] == pytest.approx(sum(r["image_exact"] for r in mine) / 3)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["metrics"]["splits"]["shift"]["n"] == 3 and "eval.json" in manifest["outputs"]
    assert {"split:eval", "split:shift", "model"} <= set(manifest["inputs"])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[evaluate] ")]
    assert any(ln.startswith("[evaluate] eval: n=3") for ln in lines)
    assert any(ln.startswith("[evaluate] shift: n=3") for ln in lines)
    again = run_cli(*args)
    assert "reused" in again.stdout and "[evaluate] shift: n=3" in again.stdout

    one = run_cli(*args[:-1], "eval.split=shift", "eval.limit=2", "eval.name=evaluate-shift", "eval.latency_samples=0")
    assert one.returncode == 0, one.stderr
    m1 = json.loads((corpus_root / "evaluate-shift" / "eval.json").read_text())
    assert m1["n"] == 2 and "splits" not in m1 and "shift split" in m1["source"]
    assert "| metric | value |" in (corpus_root / "evaluate-shift" / "report.md").read_text()


def test_evaluate_split_errors_are_one_line(corpus_root):
    for override, words in (("eval.splits=[]", "eval.splits is empty"), ("eval.split=nosuch", "Invalid value 'nosuch', expected one of [train, calib, eval, shift]"),
                            ("eval.splits=[eval,eval]", "names a split twice")):
        proc = run_cli("stage=evaluate", f"artifacts.dir={corpus_root}", override, "progress=false")
        assert proc.returncode == 2 and words in proc.stderr.strip().splitlines()[-1], proc.stderr


def test_evaluate_formulas_file_and_image_folder(tmp_path):
    formulas = [r"\frac{a}{b}", r"x^{2}+y", r"\alpha+\beta"]
    (tmp_path / "f.txt").write_text("\n".join(formulas) + "\n\n")
    proc = run_cli("stage=evaluate", f"eval.formulas={tmp_path / 'f.txt'}", f"artifacts.dir={tmp_path / 'a'}",
                   "model.max_length=70", "eval.latency_samples=0", "progress=false")
    assert proc.returncode == 0, proc.stderr
    m = json.loads((tmp_path / "a" / "evaluate" / "eval.json").read_text())
    assert m["n"] == 3 and m["exact_match"] >= 2 / 3

    images = tmp_path / "imgs"
    images.mkdir()
    lines = []
    for i, f in enumerate(formulas):
        render_formula(f).save(images / f"{i}.png")
        lines.append(f"{i}.png\t{f}")
    (images / "broken.png").write_bytes(b"not an image")
    lines.append("broken.png\tx")
    (images / "labels.tsv").write_text("\n".join(lines) + "\n")
    proc = run_cli("stage=evaluate", f"eval.images={images}", f"artifacts.dir={tmp_path / 'b'}",
                   "model.max_length=70", "eval.latency_samples=0", "progress=false")
    assert proc.returncode == 0, proc.stderr
    assert "skipped 1 unreadable image(s): broken.png" in proc.stderr  # a warning: stderr
    m2 = json.loads((tmp_path / "b" / "evaluate" / "eval.json").read_text())
    assert m2["n"] == 3 and m2["exact_match"] == m["exact_match"]


def test_sigterm_during_a_stage_is_one_line_exit_2_and_leaves_no_temp_output(tmp_path):
    """A scheduler's kill unwinds like Ctrl-C: the temporary output folder is removed."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import REPO

    formulas = [r"\frac{a}{b}", r"x^{2}+y", r"\alpha+\beta"] * 20
    (tmp_path / "f.txt").write_text("\n".join(formulas) + "\n")
    art = tmp_path / "a"
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "stage=evaluate", f"eval.formulas={tmp_path / 'f.txt'}",
                             f"artifacts.dir={art}", "model.max_length=160", "model.batch_size=1", "progress=false"],
                            cwd=REPO, env={**os.environ, "MPLBACKEND": "Agg"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not list(art.glob(".tmp-evaluate-*")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, "the stage ended before it could be stopped"
    time.sleep(1.0)  # inside the work now
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert [ln for ln in err.splitlines() if ln.startswith("error:")] == \
        ["error: interrupted (SIGTERM); previous artifacts left as they were"]
    assert not list(art.glob(".tmp-*")) and not (art / "evaluate").exists()


def test_reuse_is_decided_before_the_model_is_loaded(tmp_path, monkeypatch):
    from omegaconf import OmegaConf
    from tiny_model import build_tiny

    from pipeline.context import StageContext
    from pipeline.stages import evaluate

    build_tiny().save(tmp_path / "tiny")
    (tmp_path / "f.txt").write_text("x^2\na+b\n")
    ctx = make_ctx(tmp_path / "a", [f"eval.model={tmp_path / 'tiny'}", f"eval.formulas={tmp_path / 'f.txt'}",
                                    "model.max_length=8", "eval.latency_samples=0", "eval.image_match=false"])
    cfg = OmegaConf.to_object(ctx.cfg.eval)
    first = evaluate.run(cfg, ctx)

    def no_model(*args, **kwargs):
        raise AssertionError("an unchanged evaluate loaded the model")

    monkeypatch.setattr(StageContext, "load_model", no_model)
    assert evaluate.run(cfg, ctx) == first
    (tmp_path / "f.txt").write_text("x^2\n")  # a changed input is a rerun, which needs the model
    with pytest.raises(AssertionError, match="loaded the model"):
        evaluate.run(cfg, ctx)
