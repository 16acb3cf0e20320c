"""benchmarks/paired_splits.py: the paired numbers it prints, on a hand-computed case."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from conftest import REPO


def _module():
    spec = importlib.util.spec_from_file_location("paired_splits", REPO / "benchmarks" / "paired_splits.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_paired_exact_match_cer_interval_and_the_capped_share():
    compare = _module().compare
    truths = ["ab", "cd", "ef", "gh"]
    a = ["ab", "cd", "ex", "gh"]                  # 3 exact; 1 edit
    b = ["ab", "cx", "ef", "ghyyyyyy"]            # 2 exact; 1 + 6 edits, the last one ran to the cap
    def reading(p, steps):
        from pipeline.quantization.measure import Reading
        return Reading([], p, [x == t for x, t in zip(p, truths)], 0.0, steps)

    r = compare(reading(a, [2, 2, 2, 2]), reading(b, [2, 2, 2, 9]), truths, cap=9, resamples=500)
    assert (r["gained"], r["lost"]) == (1, 2)  # "ef" gained; "cd" and "gh" lost
    assert r["exact_match_change"] == pytest.approx(-0.25)
    assert r["paired_se"] == pytest.approx(np.sqrt((3 / 4 - 0.25 ** 2) / 4))
    assert (r["cer_a"], r["cer_b"]) == (pytest.approx(1 / 8), pytest.approx(7 / 8))
    assert r["cer_relative_change"] == pytest.approx(6.0)
    lo, hi = r["cer_change_ci95"]
    assert lo <= r["cer_relative_change"] <= hi  # the paired bootstrap interval holds the estimate
    assert r["capped_formulas"] == 1 and r["cer_difference_from_capped"] == pytest.approx(6 / 6)
    same = compare(reading(a, [2] * 4), reading(a, [2] * 4), truths, cap=9)
    assert same["paired_se"] == 0 and same["cer_change_ci95"] == [0.0, 0.0] and same["cer_difference_from_capped"] == 0


def test_runs_of_one_recipe_pool_formula_by_formula():
    """--pool: each formula's change averaged over the runs, then its mean and SE over the formulas."""
    from pipeline.quantization.measure import Reading

    def reading(exact):
        return Reading([], [""] * len(exact), exact, 0.0, [])

    ref = reading([True, True, False, False])
    runs = [reading([True, False, True, False]), reading([True, True, True, True])]
    r = _module().pooled(ref, runs)
    per_formula = np.array([0.0, -0.5, 1.0, 0.5])  # formula 2: -1 and 0; formula 3: +1 twice; formula 4: 0 and +1
    assert (r["n"], r["runs"]) == (4, 2)
    assert r["exact_match_change"] == pytest.approx(per_formula.mean())
    assert r["exact_match_b"] == pytest.approx(0.75) and r["exact_match_a"] == pytest.approx(0.5)
    assert r["paired_se"] == pytest.approx(per_formula.std() / 2)
    one = _module().pooled(ref, runs[:1])  # one run: the plain pair's numbers
    assert one["paired_se"] == pytest.approx(runs[0].paired(ref)["loss_se"]) and one["exact_match_change"] == 0


def test_scripts_compose_the_context_the_cli_builds(tmp_path):
    """StageContext.compose (benchmarks/ scripts): the CLI's config for an artifacts folder, no progress bars."""
    from conftest import compose_cfg
    from pipeline.context import StageContext

    ctx = StageContext.compose(tmp_path, ["stage=quantize", "model.max_length=64"])
    want = compose_cfg([f"artifacts.dir={tmp_path}", "progress=false", "stage=quantize", "model.max_length=64"])
    assert ctx.artifacts_dir == tmp_path and ctx.cfg.progress is False and ctx.cfg == want


def test_paired_plot_draws_each_variants_splits_and_refuses_a_spec_without_a_file(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("paired_plot", REPO / "benchmarks" / "paired_plot.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    line = '{{"split": "{s}", "n": 10, "exact_match_change": {c}, "gained": 2, "lost": 1, "paired_se": 0.05}}'
    files = []
    for name, change in (("a", 0.1), ("b", -0.2)):
        f = tmp_path / f"{name}.json"
        f.write_text("noise before\n" + "\n".join(line.format(s=s, c=change) for s in ("eval", "shift")) + "\n")
        files.append(f"{name}={f}")
    out = tmp_path / "plot.png"
    assert mod.main([*files, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "a: eval +10.0 (+2/-1, SE 5.0, n 10); shift +10.0" in printed and "b: eval -20.0" in printed
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert mod.main([str(tmp_path / "a.json"), "--out", str(out)]) == 2
