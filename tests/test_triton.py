"""The packages' Triton Inference Server repository (``triton/``, pipeline/export/triton.py).

Fast: the runtime model.py imports needs no torch; the repository is written byte for byte the same,
parses with Triton's own schema (tritonclient's ``model_config_pb2``) and the export validator names
every way a repository breaks its contract. The real model's package, its repository checked
(test_export_stage.py) and served by a real tritonserver (test_infer.py), shares those modules' export.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf, ValidationError

from pipeline.errors import PipelineError
from pipeline.export import triton
from pipeline.export.validator import check_triton_repository

REPO = Path(__file__).resolve().parent.parent


def test_the_package_runtime_imports_without_torch():
    """What model.py imports in Triton's Python backend (a venv without torch): torch made unimportable."""
    code = ("import sys; sys.modules['torch'] = None; "
            "import pipeline.export.runtime, pipeline.files; "
            "print(sorted(m for m, mod in sys.modules.items() if mod is not None "
            "and m.split('.')[0] in ('torch', 'omegaconf', 'hydra', 'onnx')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert {"pipeline.export.runtime", "pipeline.files", "pipeline.preprocessing", "pipeline.decoding"} <= set(
        triton.runtime_modules())


def _repository(folder: Path, kind: str = "KIND_CPU", settings: triton.TritonConfig | None = None) -> dict:
    """A repository written into ``folder`` as export writes it (the writer reads only package.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "package.json").is_file():
        (folder / "package.json").write_text(json.dumps({"target": "ort_cpu"}) + "\n")
    meta = json.loads((folder / "package.json").read_text())
    meta["triton"] = triton.write_repository(folder, settings or triton.TritonConfig(), kind, "ort_cpu")
    return meta


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kind", ["KIND_CPU", "KIND_GPU"])
def test_the_repository_parses_with_tritons_schema_and_is_written_the_same_twice(tmp_path, kind):
    meta = _repository(tmp_path / "a", kind)
    _repository(tmp_path / "b", kind)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    config_path = tmp_path / "a" / "triton" / triton.MODEL / "config.pbtxt"
    config = triton.parse_config(config_path.read_text(), "config.pbtxt")
    pb = triton.model_config_pb2()
    assert config.backend == "python" and config.max_batch_size == 8
    assert list(config.dynamic_batching.preferred_batch_size) == [4, 8]
    assert config.dynamic_batching.max_queue_delay_microseconds == 5000
    assert [pb.ModelInstanceGroup.Kind.Name(g.kind) for g in config.instance_group] == [kind]
    assert [(t.name, pb.DataType.Name(t.data_type), list(t.dims)) for t in config.input] == [
        (triton.IMAGE_INPUT, "TYPE_STRING", [1])]
    assert [(t.name, pb.DataType.Name(t.data_type), list(t.dims)) for t in config.output] == [
        (triton.LATEX_OUTPUT, "TYPE_STRING", [1])]
    version = tmp_path / "a" / "triton" / triton.MODEL / "1"
    assert (version / "model.py").read_bytes() == triton.TEMPLATE.read_bytes()
    assert (version / "pipeline" / "export" / "runtime.py").is_file()
    assert meta["triton"]["instance_kind"] == kind and meta["triton"]["input"] == triton.IMAGE_INPUT
    assert json.loads((tmp_path / "a" / "package.json").read_text())["triton"] == meta["triton"]
    assert check_triton_repository(tmp_path / "a", meta, kind) == []


def _edit_config(folder: Path, old: str, new: str) -> None:
    path = folder / "triton" / triton.MODEL / "config.pbtxt"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


@pytest.mark.parametrize("break_it, needle", [
    (lambda f: _edit_config(f, f'name: "{triton.IMAGE_INPUT}"', 'name: "PIXELS"'), "input [('PIXELS'"),
    (lambda f: _edit_config(f, "TYPE_STRING  # UTF-8", "TYPE_FP32  # UTF-8"), "output [('LATEX', 'TYPE_FP32'"),
    (lambda f: _edit_config(f, "dims: [ 1 ]\n  }\n]\ndynamic", "dims: [ 2 ]\n  }\n]\ndynamic"), "[2])]"),
    (lambda f: _edit_config(f, "dynamic_batching {\n  preferred_batch_size: [ 4, 8 ]\n  max_queue_delay_microseconds: "
                               "5000\n}\n", ""), "no dynamic_batching"),
    (lambda f: _edit_config(f, "kind: KIND_CPU", "kind: KIND_GPU"), "instance_group kinds ['KIND_GPU']"),
    (lambda f: _edit_config(f, 'backend: "python"', 'backend: "onnxruntime"'), "backend 'onnxruntime'"),
    (lambda f: _edit_config(f, "max_batch_size: 8", "max_batch_size: 16"), "not package.json's 8"),
    (lambda f: _edit_config(f, '"../.."', '".."'), "does not name this package"),
    (lambda f: _edit_config(f, "instance_group [", "instance_groups ["), "not a Triton model config"),
    (lambda f: (f / "triton" / triton.MODEL / "1" / "model.py").unlink(), "model.py is missing"),
    (lambda f: (f / "triton" / triton.MODEL / "1" / "pipeline" / "decoding.py").write_text("# edited\n"),
     "pipeline/decoding.py (the runtime model.py imports) is missing or differs"),
])
def test_the_validator_names_what_breaks_the_repositorys_contract(tmp_path, break_it, needle):
    meta = _repository(tmp_path)
    break_it(tmp_path)
    problems = check_triton_repository(tmp_path, meta, "KIND_CPU")
    assert problems and any(needle in p for p in problems), problems


def test_a_tensorrt_repository_fits_the_engines_profiles_and_bad_settings_fail_before_the_work(tmp_path):
    meta = _repository(tmp_path, "KIND_GPU", triton.TritonConfig(max_batch_size=8))
    assert check_triton_repository(tmp_path, meta, "KIND_GPU", max_batch=16) == []
    assert any("exceeds the graphs' largest batch 4" in p
               for p in check_triton_repository(tmp_path, meta, "KIND_GPU", max_batch=4))
    from conftest import compose_cfg
    from pipeline.stages import export

    for overrides, needle in (
            (["export.triton.max_batch_size=2"], r"preferred_batch_sizes must be in \[1, max_batch_size=2\]"),
            (["export.triton.instances=0"], "instances must be >= 1"),
            (["export.triton.max_queue_delay_us=-1"], "max_queue_delay_us must be >= 0"),
            (["export.targets=[ort_cpu,tensorrt]", "export.triton.max_batch_size=32"],
             "max_batch_size=32 exceeds export.trt_max_batch=16")):
        cfg = OmegaConf.to_object(compose_cfg(["stage=export", *overrides]).export)
        with pytest.raises(PipelineError, match=needle):
            export.validate(cfg)
    with pytest.raises(PipelineError, match="exceeds export.trt_max_batch=4"):
        triton.TritonConfig(max_batch_size=8).check(trt_max_batch=4)
    from pipeline.export.targets import resolve_target, target_config

    assert resolve_target(target_config("tensorrt")).triton_instance_kind == "KIND_GPU"
    assert resolve_target(target_config("ort_cpu")).triton_instance_kind == "KIND_CPU"
    assert resolve_target(target_config("metax")).triton_instance_kind is None
    bad = target_config("ort_cpu")
    with pytest.raises(ValidationError, match=r"Invalid value 'KIND_TPU', expected one of \[KIND_CPU, KIND_GPU\]"):
        bad.triton_instance_kind = "KIND_TPU"  # the YAML's schema refuses it; an untyped config, the target's check
    bad = OmegaConf.create({**OmegaConf.to_container(bad), "triton_instance_kind": "KIND_TPU"})
    with pytest.raises(PipelineError, match="triton_instance_kind must be one of KIND_CPU, KIND_GPU"):
        resolve_target(bad)


def test_a_tensorrt_package_asks_for_tensorrt_then_cuda_then_the_cpu():
    """The runtime's providers (what model.py gets on a GPU host): the package's own with its options,
    CUDA where TensorRT leaves a node or is missing (only the device id handed on), the CPU last."""
    from pipeline.export.runtime import provider_chain

    gpu = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    options = {"device_id": 1, "trt_fp16_enable": True}
    assert provider_chain("TensorrtExecutionProvider", gpu, options) == [
        ("TensorrtExecutionProvider", {"device_id": "1", "trt_fp16_enable": "True"}),
        ("CUDAExecutionProvider", {"device_id": "1"}), "CPUExecutionProvider"]
    assert provider_chain("TensorrtExecutionProvider", gpu[1:], {}) == [("CUDAExecutionProvider", {}),
                                                                       "CPUExecutionProvider"]
    assert provider_chain("TensorrtExecutionProvider", ["CPUExecutionProvider"], options) == ["CPUExecutionProvider"]
    assert provider_chain("CPUExecutionProvider", gpu, {}) == ["CPUExecutionProvider"]
    assert provider_chain("MACAExecutionProvider", gpu, {"device_id": 0}) == ["CPUExecutionProvider"]
