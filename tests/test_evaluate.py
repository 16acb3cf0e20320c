"""stage=evaluate on small real subsets, through the CLI as a user runs it."""
from __future__ import annotations

import json

import pytest

from conftest import run_cli
from pipeline.data.render import render_formula

pytestmark = pytest.mark.slow


def test_evaluate_on_real_eval_split_subset(corpus_root):
    proc = run_cli("stage=evaluate", f"artifacts.dir={corpus_root}", "eval.limit=4", "eval.name=evaluate-test",
                   "model.max_length=100", "eval.latency_samples=1", "progress=false")
    assert proc.returncode == 0, proc.stderr
    out = corpus_root / "evaluate-test"
    m = json.loads((out / "eval.json").read_text())
    for key in ("n", "exact_match", "image_exact_match", "cer", "bleu", "encoder_ms_per_image",
                "decoder_ms_per_image"):
        assert key in m
    assert m["n"] == 4 and 0 <= m["exact_match"] <= m["image_exact_match"] <= 1 and m["cer"] >= 0
    assert (out / "report.md").is_file() and (out / "exact_match_by_length.png").is_file()
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["steps"] >= 1 for r in rows)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["metrics"]["n"] == 4 and "eval.json" in manifest["outputs"]
    again = run_cli("stage=evaluate", f"artifacts.dir={corpus_root}", "eval.limit=4", "eval.name=evaluate-test",
                    "model.max_length=100", "eval.latency_samples=1", "progress=false")
    assert "reused" in again.stdout


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
    assert "skipped 1 unreadable image(s): broken.png" in proc.stdout
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
        ["error: interrupted; previous artifacts left as they were"]
    assert not list(art.glob(".tmp-*")) and not (art / "evaluate").exists()
