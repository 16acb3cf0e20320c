"""Sweeps on the real launcher (issue 12): a two-point Hydra multirun (joblib) over a prune setting,
the export stage swept with the same overrides (each job finds its own pruned model), and one
benchmark that collects the sweep's packages into one table and one Pareto plot."""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import run_cli
from tiny_model import build_tiny


@pytest.mark.slow
def test_two_point_sweep_then_one_benchmark_collects_its_packages(tmp_path, corpus_root):
    root = tmp_path / "art"
    shutil.copytree(corpus_root / "corpus", root / "corpus")
    tiny = tmp_path / "tiny"
    build_tiny().save(tiny)
    (tmp_path / "f.txt").write_text("x^2\na+b\n")
    common = [f"artifacts.dir={root}", "model.threads=1", "model.max_length=8", "model.batch_size=4", "progress=false"]
    sweep = [f"prune.model={tiny}", "prune.num_heads=1,2", "prune.eval_limit=2", "prune.score_images=2",
             "prune.refit_images=4", "prune.compare_random=false", "prune.latency_images=1", "prune.eval_splits=[eval]",
             "prune.finetune_steps=1", "prune.finetune_images=2", "prune.finetune_varied=0"]
    proc = run_cli("-m", "stage=prune", *common, *sweep, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    pruned = sorted(p.name for p in root.glob("prune-*") if (p / "model").is_dir())
    assert len(pruned) == 2 and not (root / "prune").exists()

    # the next stage, swept with the same prune overrides: each job exports its own pruned model
    proc = run_cli("-m", "stage=export", *common, *sweep, "export.quantized=none", f"export.formulas={tmp_path / 'f.txt'}",
                   "export.parity_limit=2", "export.parity_images=1", "export.min_identical=0", "export.min_cosine=0",
                   "export.min_snr_db=-100", "export.drafter=none", timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    packages = sorted(p for p in root.glob("export-ort_cpu-*") if (p / "package.json").is_file())
    assert len(packages) == 2 and not (root / "export-ort_cpu").exists()
    # the swept key leads the (shortened) folder name, so the names say what differs
    assert sorted(p.name[:len("export-ort_cpu-prune.num_heads=1")] for p in packages) == \
        ["export-ort_cpu-prune.num_heads=1", "export-ort_cpu-prune.num_heads=2"]
    took = sorted(json.loads((p / "manifest.json").read_text())["config"]["model_ref"] for p in packages)
    assert took == pruned

    # one benchmark, same images, collects the sweep's points
    proc = run_cli("stage=benchmark", *common, f"benchmark.model={tiny}", f"benchmark.formulas={tmp_path / 'f.txt'}",
                   "benchmark.default_packages=false", "+benchmark.packages.sweep=export-ort_cpu-*",
                   "benchmark.torch_limit=1", "benchmark.full_prefix_limit=1", "benchmark.samples=1",
                   "benchmark.memory=false", "benchmark.clients=1", "benchmark.requests=1", "benchmark.summary=false",
                   timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = json.loads((root / "benchmark" / "benchmark.json").read_text())
    rows = [v for v in m["variants"] if v["kind"] == "package"]
    assert sorted(v["label"] for v in rows) == [f"sweep {p.name}" for p in packages]
    assert sorted(v["model"] for v in rows) == pruned
    assert (root / "benchmark" / "pareto.png").stat().st_size > 0
