"""The runner on a small real subset: ``stage=infer`` reads rendered formulas with the exported
package alone, batched or not; bad input is one clear error; the package's Triton repository served
by a real tritonserver reads as ``stage=infer`` does. (The benchmark: test_benchmark.py.)"""
from __future__ import annotations

import os

import numpy as np
import pytest
from omegaconf import OmegaConf

from pipeline.data.render import render_formula
from pipeline.errors import PipelineError
from pipeline.metrics import normalize
from conftest import make_ctx, run_cli
from export_session import FORMULAS, MAX_LENGTH, ort_package  # one export per session

pytestmark = pytest.mark.slow  # the package is the real model exported


@pytest.fixture(scope="module")
def pkg():
    return ort_package()


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    for i, latex in enumerate(FORMULAS):
        render_formula(latex).save(folder / f"f{i}.png")
    (folder / "notes.txt").write_text("not an image")
    return folder


def test_infer_cli_reads_rendered_formulas_with_the_package_alone(pkg, image_dir, tmp_path):
    out = tmp_path / "predictions.tsv"
    proc = run_cli("stage=infer", f"infer.package={pkg}", f"infer.image={image_dir}", f"infer.output={out}", "progress=false")
    assert proc.returncode == 0, proc.stderr
    lines = out.read_text(encoding="utf-8").splitlines()
    assert [ln.split("\t")[0] for ln in lines] == ["f0.png", "f1.png"]
    for line, truth in zip(lines, FORMULAS):
        assert normalize(line.split("\t", 1)[1]) == normalize(truth), line
    assert lines[0] in proc.stdout
    assert "speculative, " in proc.stdout + proc.stderr  # the package has a drafter: image by image
    plain = tmp_path / "plain.tsv"
    proc = run_cli("stage=infer", f"infer.package={pkg}", f"infer.image={image_dir}", f"infer.output={plain}",
                   "infer.speculative=false", "progress=false")
    assert proc.returncode == 0, proc.stderr
    assert "greedy, batch 8" in proc.stdout + proc.stderr
    assert plain.read_text(encoding="utf-8") == out.read_text(encoding="utf-8")


def test_runner_batched_equals_single_and_torch(pkg, image_dir, real_adapter):
    from PIL import Image

    from pipeline.export.runtime import OnnxPackage

    package = OnnxPackage(pkg, threads=1)
    images = [Image.open(p) for p in sorted(image_dir.glob("*.png"))]
    batched = package.read_images(images, batch_size=2)
    single = [package.read_images([im], batch_size=1).texts[0] for im in images]
    assert batched.texts == single
    # the runner's own preprocessing and tokenizer equal the adapter's
    arr = np.stack([package.preprocess(im) for im in images])
    torch_in = np.stack([real_adapter.preprocess(im).numpy() for im in images])
    np.testing.assert_array_equal(arr, torch_in)
    assert batched.texts == [real_adapter.decode_text(ids) for ids in batched.token_ids]
    assert batched.hit_cap == [False, False] and max(batched.steps) < MAX_LENGTH


def test_infer_bad_input_is_one_clear_error(pkg, image_dir, tmp_path):
    from pipeline.stages import infer

    def run(package, image):
        ctx = make_ctx(tmp_path, [f"infer.package={package}", f"infer.image={image}"])
        return infer.run(OmegaConf.to_object(ctx.cfg.infer), ctx)

    with pytest.raises(PipelineError, match="not an exported package"):
        run(tmp_path, image_dir)
    with pytest.raises(PipelineError, match="no such file or folder"):
        run(pkg, tmp_path / "missing.png")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PipelineError, match="no image"):
        run(pkg, empty)
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not a png")
    with pytest.raises(PipelineError, match="no readable image"):
        run(pkg, bad)
    # an incomplete package names the missing graph
    import shutil

    broken = tmp_path / "broken-pkg"
    shutil.copytree(pkg, broken)
    (broken / "decoder_step.onnx").unlink()
    with pytest.raises(PipelineError, match="decoder_step.onnx missing"):
        run(broken, image_dir)


# ---- the package's Triton repository on a real tritonserver (docs/triton.md) ------------------------
SERVED = [r"x_1 + x_2", r"e^{i\pi}+1=0", r"\frac{a}{b}", r"\sqrt{x}", r"a^2+b^2=c^2", r"\alpha\beta",
          r"\sum_i x_i", r"y=mx+c"]  # 8 images sent at once


@pytest.fixture(scope="module")
def side_python():
    from triton_env import side_python as find

    python = find()
    if python is None:
        reason = "no Triton side environment (.venv-triton): run `make triton` to serve a package on tritonserver"
        if os.environ.get("CI") == "true":  # CI makes it (.ci/run): a missing one is a broken CI, not a skip
            pytest.fail(reason)
        pytest.skip(reason)
    return python


def test_a_real_tritonserver_serves_the_package_batching_requests_and_refusing_a_non_image(
        pkg, side_python, tmp_path):
    import shutil

    from pipeline.data.render import render_formula
    from pipeline.export import triton
    from pipeline.export.triton_model import IMAGE_ERROR
    from pipeline.stages import infer
    from triton_env import TritonServer, metric, query

    images = tmp_path / "images"
    images.mkdir()
    for i, latex in enumerate(SERVED):
        render_formula(latex).save(images / f"f{i}.png")
    package = tmp_path / "package"  # a copy: the server's Python leaves nothing in the test's package
    shutil.copytree(pkg, package)
    ctx = make_ctx(tmp_path / "artifacts", [f"infer.package={package}", f"infer.image={images}"])
    want = infer.run(OmegaConf.to_object(ctx.cfg.infer), ctx)["predictions"]
    not_image = tmp_path / "notes.png"
    not_image.write_bytes(b"not an image at all")

    server = TritonServer(side_python, package / triton.REPOSITORY, tmp_path / "server")
    try:
        server.wait_ready()
        got = query(side_python, server.url, package, [*sorted(images.glob("*.png")), not_image])
        metrics = server.metrics()
    finally:
        server.stop()
    log = server.log_tail()
    assert {name: got[name].get("latex") for name in want} == want, log
    assert "error" in got[not_image.name] and IMAGE_ERROR in got[not_image.name]["error"], got
    executions = metric(metrics, "nv_inference_exec_count", triton.MODEL)
    requests = metric(metrics, "nv_inference_count", triton.MODEL)
    assert requests >= len(SERVED)
    assert executions < len(SERVED), f"{executions} executions for {requests} requests: no batching"
