"""Config errors: one clear line on stderr, exit code 2, no artifact."""
from __future__ import annotations

import pytest

from conftest import compose_cfg, make_ctx, run_cli


@pytest.mark.parametrize("override, needle", [
    ("eval.bogus=1", "Key 'bogus' not in 'EvalConfig'"),
    ("eval.limit=abc", "could not be converted to Integer"),
    ("stage=bogus", "Could not find 'stage/bogus'"),
    ("target=nope", "Could not find 'target/nope'"),
    ("model.max_length=many", "model.max_length"),
    ("export.drafter=magic", "export.drafter=magic: Invalid value 'magic', expected one of [none, ngram, bpe, student]"),
])
@pytest.mark.slow
def test_config_errors_are_one_line_and_exit_2(tmp_path, override, needle):
    proc = run_cli(override, f"artifacts.dir={tmp_path / 'a'}")
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: config:") and needle in lines[0]
    assert not (tmp_path / "a").exists()


@pytest.mark.slow
def test_defaults_compose_and_stage_group_selects_stage():
    from omegaconf import OmegaConf

    from pipeline.config import DataConfig, ModelConfig
    from pipeline.stages import STAGES

    cfg = compose_cfg(["stage=prune", "target=metax"])
    assert cfg.stage == "prune"
    assert cfg.target.name == "metax" and cfg.target.max_opset == 17
    for name, spec in STAGES.items():  # each stage's group selects it, and its section is its dataclass's defaults
        cfg = compose_cfg([f"stage={name}"])
        assert cfg.stage == name
        assert OmegaConf.to_object(cfg[spec.config_key]) == spec.config_cls()
    assert OmegaConf.to_object(cfg.model) == ModelConfig() and OmegaConf.to_object(cfg.data) == DataConfig()
    # stage=all searches the quantize plan on train formulas (preset=thorough: the whole split), never on an eval split
    chain = compose_cfg(["stage=all"]).quantize
    assert chain.search_split == "train" and chain.search_split not in chain.eval_splits
    assert compose_cfg(["stage=all", "preset=thorough"]).quantize.search_images >= 1779
    # the speculative check (export.drafter=ngram) reads the first 64 of each split; thorough and the stage: all
    assert compose_cfg(["stage=all"]).benchmark.speculative_limit == 32
    assert compose_cfg(["stage=all", "preset=thorough"]).benchmark.speculative_limit is None
    assert compose_cfg(["stage=benchmark"]).benchmark.speculative_limit is None
    # ... after a quantization-aware finetune of the encoder (off in the stage alone)
    assert chain.qat_steps > 0 and compose_cfg(["stage=quantize"]).quantize.qat_steps == 0
    # ... on the pruned model reading only the tokens its policy keeps, a floor of 384, trained on finer
    # buckets, skipped (one line) for a model that cannot; its keys unpooled (all off in the stage alone)
    pruning = compose_cfg(["stage=all"]).prune
    assert pruning.tokens.enabled and pruning.tokens.skip_unsupported and list(pruning.key_pool_layers) == []
    assert list(pruning.tokens.buckets) == [384, 1024] and list(pruning.tokens.train_buckets) == [128, 256, 384, 1024]
    alone = compose_cfg(["stage=prune"]).prune
    assert not alone.tokens.enabled and not alone.tokens.skip_unsupported and alone.key_pool_layers == []
    typed = OmegaConf.to_object(compose_cfg(["eval.limit=7"]))  # an override arrives typed, in its section
    assert typed.eval.limit == 7 and typed.eval.model == "original"


@pytest.mark.parametrize("in_chain", [False, True])
def test_stage_all_runs_distill_only_when_it_is_in_the_chain(monkeypatch, tmp_path, in_chain):
    from dataclasses import replace

    from pipeline import stages
    from pipeline.__main__ import run_stages

    ran = []
    for name, spec in list(stages.STAGES.items()):
        monkeypatch.setitem(stages.STAGES, name, replace(spec, run=lambda cfg, ctx, n=name: ran.append(n)))
    run_stages(compose_cfg(["stage=all", f"artifacts.dir={tmp_path}", f"distill.in_chain={in_chain}",
                            f"eval.in_chain={in_chain}"]))
    want = [n for n in stages.ORDER if in_chain or n not in ("distill", "evaluate")]
    assert ran == want and ("distill" in ran) == in_chain


def test_stage_all_leaves_evaluate_to_the_benchmark_by_default(monkeypatch, tmp_path):
    from dataclasses import replace

    from pipeline import stages
    from pipeline.__main__ import run_stages

    ran = []
    for name, spec in list(stages.STAGES.items()):
        monkeypatch.setitem(stages.STAGES, name, replace(spec, run=lambda cfg, ctx, n=name: ran.append(n)))
    run_stages(compose_cfg(["stage=all", f"artifacts.dir={tmp_path}"]))
    # the chain's order, each stage reading the previous one's artifacts, the benchmark last
    assert ran == ["prune", "tokenizer", "calibrate", "quantize", "export", "benchmark"]
    ran.clear()
    run_stages(compose_cfg(["stage=evaluate", f"artifacts.dir={tmp_path}"]))  # alone it runs as before
    assert ran == ["evaluate"]


@pytest.mark.slow
def test_bad_input_in_a_stage_is_one_line(tmp_path):
    proc = run_cli("stage=evaluate", f"eval.formulas={tmp_path / 'missing.txt'}", f"artifacts.dir={tmp_path / 'a'}",
                   "progress=false")
    assert proc.returncode == 2
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert err == [f"error: eval.formulas: no such file {tmp_path / 'missing.txt'}"]
    assert not (tmp_path / "a" / "evaluate").exists()


def test_multirun_jobs_go_through_the_joblib_launcher():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from conftest import REPO
    from pipeline.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
            cfg = compose(config_name="config", return_hydra_config=True, overrides=["hydra.launcher.n_jobs=3"])
    finally:
        GlobalHydra.instance().clear()
    assert cfg.hydra.launcher._target_ == "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
    assert cfg.hydra.launcher.n_jobs == 3


@pytest.mark.parametrize("setting, tty, expected", [
    (None, True, True), (None, False, False), (True, False, True), (False, True, False)])
def test_progress_bars_only_on_a_terminal_unless_set(monkeypatch, setting, tty, expected):
    import io
    import sys

    from pipeline.context import StageContext

    class Stream(io.StringIO):
        def isatty(self):
            return tty

    monkeypatch.setattr(sys, "stderr", Stream())
    overrides = [] if setting is None else [f"progress={str(setting).lower()}"]
    assert compose_cfg(overrides).progress is setting
    assert StageContext(compose_cfg(overrides)).progress is expected


@pytest.mark.slow
def test_a_non_editable_install_finds_its_conf(tmp_path):
    """conf/ ships as pipeline/conf: the installed package composes its config away from the checkout."""
    import os
    import shutil
    import subprocess
    import sys

    from conftest import REPO

    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv*", "artifacts", "__pycache__", "*.json"))
    shutil.copy(REPO / "pyproject.toml", src / "pyproject.toml")
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(src)], check=True, capture_output=True, timeout=300)
    assert (target / "pipeline" / "conf" / "config.yaml").is_file()
    assert (target / "pipeline" / "conf" / "hydra" / "job_logging" / "pipeline.yaml").is_file()
    assert (target / "pipeline" / "distillation" / "train.py").is_file()
    proc = subprocess.run([sys.executable, "-m", "pipeline", "stage=evaluate", "model.batch_size=0",
                           f"artifacts.dir={tmp_path / 'a'}"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(target)}, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: config: model.batch_size=0: must be >= 1"


@pytest.mark.slow
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA: model.device=cuda is valid")
def test_model_device_cuda_without_cuda_is_one_error_line_and_auto_is_the_cpu(tmp_path):
    import torch

    from pipeline.device import placed

    for setting, says in (("cuda", "model.device=cuda: torch "), ("cuda:1", "model.device=cuda:1: torch "),
                          ("tpu", "model.device='tpu': must be auto, cpu, cuda or cuda:N")):
        proc = run_cli("stage=all", f"model.device={setting}", f"artifacts.dir={tmp_path / 'a'}")
        assert proc.returncode == 2 and proc.stderr.strip().startswith(f"error: config: {says}"), proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "a" / "prune").exists()
    assert make_ctx(tmp_path).device == torch.device("cpu")  # auto, with no CUDA: the CPU
    model = torch.nn.Linear(2, 2)
    holder = type("A", (), {"model": model})()
    with placed(torch.device("cpu"), holder):
        assert model.weight.device.type == "cpu"


# the options that take one of a few values: a wrong one is refused when Hydra composes, naming the allowed ones
@pytest.mark.parametrize("override, allowed", [
    ("export.drafter=magic", "none, ngram, bpe, student"),
    ("export.targets=[ort_cpu,nosuch]", "ort_cpu, tensorrt, metax"),
    ("target.name=tpu", "ort_cpu, tensorrt, metax"),
    ("target.triton_instance_kind=KIND_TPU", "KIND_CPU, KIND_GPU"),
    ("data.kind=bogus", "corpus, image_folder, hf_disk"),
    ("prune.normalize=glob", "layer, global"),
    ("prune.finetune_scope=decoder", "model, encoder"),
    ("prune.finetune_targets=ground", "labels, teacher"),
    ("prune.finetune_precision=fp16", "auto, fp32, bf16"),
    ("quantize.qat_precision=fp16", "auto, fp32, bf16"),
    ("prune.teacher_reader=tensorrt", "onnxruntime, torch"),
    ("quantize.methods=[minmax,histogram]", "minmax, minmax_ema, entropy, percentile, percentile_99.99"),
    ("quantize.method=histogram", "auto, minmax, minmax_ema, entropy, percentile, percentile_99.99"),
    ("quantize.metric=mse", "snr_db, cosine"),
    ("quantize.ort_cpu_activations=int4", "int8, uint8"),
    ("distill.targets=kd", "truth, teacher"),
    ("prune.eval_splits=[eval,shfit]", "train, calib, eval, shift"),
    ("tokenizer.eval_split=evl", "train, calib, eval, shift"),
    ("quantize.search_split=trian", "train, calib, eval, shift"),
    ("benchmark.extra_splits=[shift,nosuch]", "train, calib, eval, shift"),
    ("eval.split=valid", "train, calib, eval, shift"),
    ("serve.engine=spark", "builtin, ray"),
])
def test_a_value_outside_an_options_set_is_refused_at_compose_naming_the_allowed_ones(override, allowed):
    from pipeline.__main__ import _first_line

    with pytest.raises(Exception) as refused:
        compose_cfg([override])
    wrong = override.split("=", 1)[1].strip("[]").split(",")[-1]
    assert f"Invalid value '{wrong}', expected one of [{allowed}]" in _first_line(refused.value)
    assert override in _first_line(refused.value)  # the line names the key


def test_a_typed_option_reads_compares_and_hashes_as_its_string():
    """What an option's type changed is where a wrong value fails: the stage code compares it with its
    string, and the artifact keys hash the same JSON as before the option was typed."""
    import json
    from dataclasses import asdict

    from omegaconf import OmegaConf

    from pipeline.artifacts import sha256_json
    from pipeline.choices import Choice

    cfg = OmegaConf.to_object(compose_cfg(["stage=all", "prune.finetune_precision=bf16"]))
    drafter = cfg.export.drafter
    assert isinstance(drafter, Choice) and drafter == "ngram" and str(drafter) == "ngram" and f"{drafter}" == "ngram"
    assert {drafter: 1}["ngram"] == 1 and cfg.prune.finetune_precision == "bf16"

    def plain(x):
        if isinstance(x, Choice):
            return x.value + ""  # a str, no longer a Choice
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return [plain(v) for v in x] if isinstance(x, list) else x

    for section in (cfg.export, cfg.prune, cfg.quantize, cfg.distill, cfg.target, cfg.data, cfg.eval, cfg.benchmark,
                    cfg.tokenizer):
        typed = asdict(section)
        assert json.dumps(typed, sort_keys=True) == json.dumps(plain(typed), sort_keys=True)
        assert sha256_json(typed) == sha256_json(plain(typed))
        assert type(plain(typed)) is dict and not any(isinstance(v, Choice) for v in plain(typed).values())


def test_auto_training_precision_is_bf16_only_where_the_cpu_computes_it_natively(tmp_path, monkeypatch, caplog):
    """prune.finetune_precision / quantize.qat_precision=auto: bf16 on a CPU whose flags say AVX512-BF16 or AMX,
    fp32 on one that would emulate it (an AVX2 CPU: a bf16 step 7x an fp32 one), said in one line; a set value
    is kept as it is."""
    import logging

    import torch

    import pipeline.device as device

    cpu = torch.device("cpu")
    for flags, native in (("fpu sse2 avx2 fma", False), ("avx512f avx512_bf16 avx512_vnni", True), ("amx_bf16 amx_tile", True)):
        info = tmp_path / "cpuinfo"
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        assert device.native_bf16(cpu, str(info)) is native, flags
    assert device.native_bf16(cpu, str(tmp_path / "missing")) is False  # not Linux: fp32
    ctx = make_ctx(tmp_path)
    for native, chosen in ((False, "fp32"), (True, "bf16")):
        monkeypatch.setattr(device, "native_bf16", lambda d, native=native: native)
        with caplog.at_level(logging.INFO, logger="pipeline.context"):
            caplog.clear()
            assert ctx.training_precision("prune.finetune_precision", "auto") == chosen
        assert caplog.messages == [f"[prune] prune.finetune_precision=auto: {chosen} on cpu"
                                   + ("" if native else " (no native bfloat16 here)")]
        assert ctx.training_precision("quantize.qat_precision", "fp32") == "fp32"
        assert ctx.training_precision("quantize.qat_precision", "bf16") == "bf16"
