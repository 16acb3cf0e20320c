"""Denormals flushed to zero: per thread, set by the package on the thread that reads, recorded in the
package, the same readings (pipeline/denormals.py)."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from omegaconf import OmegaConf
from tiny_model import FORMULAS, build_tiny, fake_ctx

from pipeline import denormals


def _export(root, *overrides: str):
    """The tiny model's ort_cpu package under ``root`` (export-ort_cpu)."""
    from pipeline.stages import export

    build_tiny().save(root / "tiny-model")
    (root / "formulas.txt").write_text("\n".join(FORMULAS[:4]) + "\n")
    ctx = fake_ctx(root, [f"export.model={root / 'tiny-model'}", "export.quantized=none",
                          f"export.formulas={root / 'formulas.txt'}", "model.max_length=8", "export.parity_images=1",
                          "export.parity_limit=1", "export.min_identical=0", "export.drafter=none", *overrides])
    export.run(OmegaConf.to_object(ctx.cfg.export), ctx)
    return root / "export-ort_cpu"


@pytest.fixture(scope="module")
def ort_pkg(tmp_path_factory):
    return _export(tmp_path_factory.mktemp("denormals"))


@pytest.fixture(autouse=True)
def _restore():
    before = denormals.flushing()
    yield
    torch.set_flush_denormal(before)


def test_the_mode_is_the_threads_and_a_block_gives_it_back():
    torch.set_flush_denormal(False)
    assert not denormals.flushing()
    with denormals.thread_mode(True) as done:
        assert done and denormals.flushing()
        tiny = np.array([1e-40], np.float32)
        assert (tiny * np.float32(1))[0] == 0  # read as zero while flushed
    assert not denormals.flushing()
    seen = []
    worker = threading.Thread(target=lambda: seen.append((denormals.set_thread(True), denormals.flushing())))
    worker.start()
    worker.join()
    assert seen == [(True, True)] and not denormals.flushing()  # another thread's mode is its own


def test_without_torch_a_thread_is_set_both_ways(monkeypatch):
    """Without torch (the runtime, MacaRT's and Triton's environments) the C library sets and clears it."""
    import sys

    torch.set_flush_denormal(False)
    monkeypatch.delitem(sys.modules, "torch")
    seen = []

    def both_ways():
        seen.append((denormals.set_thread(True), denormals.flushing()))
        seen.append((denormals.set_thread(False), denormals.flushing()))

    worker = threading.Thread(target=both_ways)
    worker.start()
    worker.join()
    assert seen == [(True, True), (True, False)]


class _Watched:
    """A session whose calls record whether the calling thread flushed denormals."""

    def __init__(self, session, seen: list):
        self.session, self.seen = session, seen

    def run(self, *args, **kwargs):
        self.seen.append(denormals.flushing())
        return self.session.run(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.session, name)


def test_a_package_records_its_session_config_and_reads_in_its_mode_on_any_thread(ort_pkg):
    from pipeline.data.render import render_formula
    from pipeline.export.runtime import OnnxPackage

    meta = json.loads((ort_pkg / "package.json").read_text())
    assert meta["session_config"] == {"session.set_denormal_as_zero": "1", "session.intra_op.allow_spinning": "0",
                                      "session.x64quantprecision": "1"}
    flushed, plain = OnnxPackage(ort_pkg, threads=1), OnnxPackage(ort_pkg, threads=1, flush_denormals=False)
    for package, entry in ((flushed, "1"), (plain, "0")):
        for graph, session in package.sessions.items():
            assert session.get_session_options().get_session_config_entry(denormals.SESSION_ENTRY) == entry, graph
    images = np.stack([flushed.preprocess(render_formula(f)) for f in (r"\frac{a}{b}", r"x^{2}+y")]).astype(np.float32)
    seen: dict[str, list] = {"flushed": [], "plain": []}
    for name, package in (("flushed", flushed), ("plain", plain)):
        package.sessions["encoder"] = _Watched(package.sessions["encoder"], seen[name])
    torch.set_flush_denormal(False)
    results = {}
    worker = threading.Thread(target=lambda: results.update(flushed=flushed.generate(images, 8, 2)))
    worker.start()  # a thread that never created a session: the package sets it
    worker.join()
    torch.set_flush_denormal(True)
    results["plain"] = plain.generate(images, 8, 2)  # on a flushing thread: the plain package clears it
    assert seen == {"flushed": [True], "plain": [False]}
    assert denormals.flushing()  # and gives the thread its mode back
    assert results["flushed"].token_ids == results["plain"].token_ids


def test_session_entries_go_over_the_packages_own_in_every_session(ort_pkg):
    """benchmarks/int8_precision.py reads one package with ONNX Runtime's U8S8 kernels as they come."""
    from pipeline.export.runtime import PRECISE_INT8, OnnxPackage

    for entries, want in ((None, "1"), ({PRECISE_INT8: "0"}, "0")):
        package = OnnxPackage(ort_pkg, threads=1, session_entries=entries)
        for graph, session in package.sessions.items():
            assert session.get_session_options().get_session_config_entry(PRECISE_INT8) == want, graph
            assert session.get_session_options().get_session_config_entry(denormals.SESSION_ENTRY) == "1", graph


def test_a_graph_onnx_runtime_cannot_load_with_exact_int8_is_read_without_it_and_said(ort_pkg, monkeypatch, caplog):
    """ONNX Runtime's S8-to-U8 rewrite behind session.x64quantprecision fails on some of its own QDQ graphs
    (quantize_static's, on CPUs without VNNI): that graph reads as it would without the entry, with a
    warning; a graph that fails either way is one error line."""
    import onnxruntime as ort

    from pipeline.errors import PipelineError
    from pipeline.export.runtime import PRECISE_INT8, OnnxPackage

    real = ort.InferenceSession

    def session(path, so, providers, refuse="encoder"):
        if refuse in str(path) and so.get_session_config_entry(PRECISE_INT8) == "1":
            raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Attempt to replace the existing tensor\nmore")
        return real(path, so, providers=providers)

    monkeypatch.setattr(ort, "InferenceSession", session)
    with caplog.at_level("WARNING"):
        package = OnnxPackage(ort_pkg, threads=1)
    entries = {g: s.get_session_options().get_session_config_entry(PRECISE_INT8) for g, s in package.sessions.items()}
    assert entries.pop("encoder") == "0" and set(entries.values()) == {"1"}
    assert f"encoder: ONNX Runtime cannot load encoder.onnx with {PRECISE_INT8}=1" in caplog.text

    def broken(path, so, providers):
        raise RuntimeError("[ONNXRuntimeError] : 10 : INVALID_GRAPH : broken\nmore")

    monkeypatch.setattr(ort, "InferenceSession", broken)
    with pytest.raises(PipelineError, match=r"^encoder: ONNX Runtime cannot load encoder.onnx: .*broken$"):
        OnnxPackage(ort_pkg, threads=1)


def test_model_flush_denormals_false_is_recorded_in_the_package(tmp_path):
    meta = json.loads((_export(tmp_path, "model.flush_denormals=false") / "package.json").read_text())
    assert meta["session_config"][denormals.SESSION_ENTRY] == "0"
