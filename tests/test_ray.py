"""The Ray engines on the tiny random model's package (tests/tiny_model.py) and one local Ray cluster
for the module (2 CPUs, no dashboard, a small object store): ``infer.engine=ray`` reads a folder with
a broken file in it as ``stage=infer`` does and gives the broken file its error row; ``serve.engine=ray``
(a real server process joining the module's cluster at ``serve.address``) answers as ``stage=infer``,
refuses hostile bodies with the builtin engine's 4xx and drains on SIGTERM, exit 0; an address where
no Ray answers is one line and exit 2; an engine that does not exist is refused at compose time.
Nothing here is timed: a batch window is made long, never raced."""
from __future__ import annotations

import http.client
import importlib.util
import io
import json
import signal
import threading
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from PIL import Image

from conftest import REPO, compose_cfg, make_ctx, run_cli
from serve_client import multipart, side_by_side

# the load test's server process helper (stage=serve on a free port, its banner, SIGTERM)
spec = importlib.util.spec_from_file_location("serve_load", REPO / "benchmarks" / "serve_load.py")
serve_load = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serve_load)

# Ray's own modules warn of pydantic and Ray Data deprecations on import; ours still would show
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.*")

FORMULAS = ["x^2", "a+b", r"\frac{a}{b}"]
EXPORT = ["model.max_length=16", "export.parity_images=1", "export.parity_limit=2", "export.min_identical=0",
          "export.drafter=none"]  # no drafter: no corpus to build


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The tiny model exported (in-process), and a folder of its rendered formulas plus a broken file."""
    from tiny_model import build_tiny

    from pipeline.data.render import render_formula
    from pipeline.stages import export

    root = tmp_path_factory.mktemp("ray")
    build_tiny().save(root / "tiny")
    (root / "formulas.txt").write_text("\n".join(FORMULAS) + "\n", encoding="utf-8")
    images = root / "images"
    images.mkdir()
    for i, latex in enumerate(FORMULAS):
        render_formula(latex).save(images / f"f{i}.png")
    (images / "broken.png").write_bytes(b"not a png at all")
    ctx = make_ctx(root / "art", ["stage=export", *EXPORT, f"export.model={root / 'tiny'}",
                                  f"export.formulas={root / 'formulas.txt'}"])
    export.run(OmegaConf.to_object(ctx.cfg.export), ctx)
    return root


@pytest.fixture(scope="module")
def pkg(work) -> Path:
    return work / "art" / "export-ort_cpu"


@pytest.fixture(scope="module")
def ray_address():
    """One local Ray for the module: this process is its driver; the stages' processes join it."""
    from pipeline import cluster

    # ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 MB) on 127.0.0.1 alone
    cluster.start_local(num_cpus=2, object_store_bytes=100 * 1024 * 1024)
    import ray

    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def infer_answers(work, pkg) -> dict[str, str]:
    """stage=infer's readings (the builtin engine, in-process) of the folder's images."""
    from pipeline.stages import infer

    ctx = make_ctx(work / "infer-art", [f"infer.package={pkg}", f"infer.image={work / 'images'}"])
    return infer.run(OmegaConf.to_object(ctx.cfg.infer), ctx)["predictions"]


def test_ray_data_reads_the_folder_as_stage_infer_and_a_broken_file_gets_its_error_row(
        work, pkg, ray_address, infer_answers, tmp_path, capsys):
    from pipeline.cluster.data import write_rows
    from pipeline.errors import ConfigError
    from pipeline.stages import infer

    out = tmp_path / "readings.jsonl"
    ctx = make_ctx(tmp_path / "art", [f"infer.package={pkg}", f"infer.image={work / 'images'}", "infer.engine=ray",
                                      "infer.actors=2", "infer.threads=1", f"infer.output={out}"])
    result = infer.run(OmegaConf.to_object(ctx.cfg.infer), ctx)
    assert result["predictions"] == infer_answers and sorted(infer_answers) == ["f0.png", "f1.png", "f2.png"]
    assert list(result["errors"]) == ["broken.png"] and "cannot decode" in result["errors"]["broken.png"]
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [Path(r["path"]).name for r in rows] == ["broken.png", "f0.png", "f1.png", "f2.png"]
    assert rows[0]["latex"] is None and "cannot decode" in rows[0]["error"]
    assert [r["latex"] for r in rows[1:]] == [infer_answers[f"f{i}.png"] for i in range(3)]
    assert all(r["error"] is None for r in rows[1:])
    assert "3 image(s) read, 1 error(s)" in capsys.readouterr().out
    # an actor wider than the cluster would wait for ever: refused in one line
    ctx = make_ctx(tmp_path / "art", [f"infer.package={pkg}", f"infer.image={work / 'images'}", "infer.engine=ray",
                                      "infer.threads=3"])
    with pytest.raises(ConfigError, match="infer.threads=3: .* the Ray cluster has 2"):
        infer.run(OmegaConf.to_object(ctx.cfg.infer), ctx)
    # Parquet, the same rows (the writer alone: no second pass over the folder)
    import pyarrow.parquet as pq

    write_rows(rows, tmp_path / "readings.parquet")
    assert pq.read_table(tmp_path / "readings.parquet").to_pylist() == rows


def request(server, method: str, path: str, body: bytes | None = None, ctype: str | None = None):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": ctype} if ctype else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def predict(server, data: bytes, ctype: str = "image/png") -> tuple[int, dict]:
    status, body = request(server, "POST", "/predict", data, ctype)
    return status, json.loads(body)


def in_flight(server) -> float:
    text = request(server, "GET", "/metrics")[1].decode()
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith("formula_serve_in_flight ")))


@pytest.mark.slow  # a Serve application deployed and drained: the module's slowest
def test_ray_serve_answers_as_stage_infer_refuses_hostile_bodies_and_drains_on_sigterm(
        work, pkg, ray_address, infer_answers, tmp_path):
    images = [(work / "images" / f"f{i}.png").read_bytes() for i in range(3)]
    # one replica whose batches wait 3 s for a fourth image: three requests sent together are one batch
    # stage=serve serve.engine=ray, a process of its own joining the module's cluster
    server = serve_load.Server(str(pkg), ["serve.engine=ray", f"serve.address={ray_address}", "serve.replicas=1",
                                          "serve.max_batch=4", "serve.max_wait_ms=3000", "serve.max_bytes=200000",
                                          "serve.read_timeout_s=1"], tmp_path)
    try:
        form, form_type = multipart(images[2])
        got = side_by_side(predict, [(server, images[0]), (server, images[1]), (server, form, form_type)])
        assert [s for s, _ in got] == [200, 200, 200], got
        assert [b["latex"] for _, b in got] == [infer_answers[f"f{i}.png"] for i in range(3)]
        assert [b["batch"] for _, b in got] == [3, 3, 3]

        bomb = png(Image.new("1", (10_000, 10_000), 1))  # 100 megapixels in a few kB
        cases = {
            "not an image": (b"this is not an image", "image/png", 400, "cannot decode"),
            "truncated": (images[0][: len(images[0]) // 2], "image/png", 400, "cannot decode"),
            "decompression bomb": (bomb, "image/png", 400, "decompression bomb"),
            "over max_bytes": (b"\0" * 300_000, "image/png", 413, "serve.max_bytes"),
            "wrong content type": (images[0], "application/json", 415, "content type"),
            "no content type": (images[0], None, 415, "content type"),
            "empty": (b"", "application/octet-stream", 400, "empty body"),
            "form without a field": (b"--b--\r\n", "multipart/form-data; boundary=b", 400, "multipart"),
        }
        for name, (data, ctype, code, words) in cases.items():
            status, body = request(server, "POST", "/predict", data, ctype)
            assert status == code, (name, status, body)
            assert words in json.loads(body)["error"], (name, body)
        assert request(server, "GET", "/nowhere")[0] == 404 and request(server, "GET", "/predict")[0] == 405
        status, body = request(server, "GET", "/health")
        assert status == 200 and json.loads(body)["status"] == "ok"
        metrics = request(server, "GET", "/metrics")[1].decode()
        assert 'formula_serve_batch_size_bucket{le="3.0"} 1.0' in metrics
        for reason in ("bad_image", "too_large", "content_type", "empty", "multipart"):
            assert f'formula_serve_errors_total{{reason="{reason}"}}' in metrics, reason

        # SIGTERM with three requests waiting in the replica's batch: all three answered, exit 0
        pending = [None] * 3
        threads = [threading.Thread(target=lambda i=i: pending.__setitem__(i, predict(server, images[i])))
                   for i in range(3)]
        for t in threads:
            t.start()
        while in_flight(server) < 3:
            pass
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join()
        assert server.proc.wait(120) == 0, server.err[-5:]
        assert [p[0] for p in pending] == [200, 200, 200]
        assert [p[1]["latex"] for p in pending] == [infer_answers[f"f{i}.png"] for i in range(3)]
        assert any("draining" in line for line in server.err), server.err[-5:]
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_an_unreachable_address_is_one_line_and_an_unknown_engine_is_refused_at_compose(pkg, work, tmp_path):
    proc = run_cli("stage=infer", "infer.engine=ray", f"infer.package={pkg}", f"infer.image={work / 'images'}",
                   "infer.address=127.0.0.1:1", f"artifacts.dir={tmp_path}", "progress=false")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: infer.address=127.0.0.1:1: Ray is not reachable")
    assert not (tmp_path / "infer").exists()
    proc = run_cli("stage=serve", "serve.engine=foo", f"artifacts.dir={tmp_path}")
    assert proc.returncode == 2 and "expected one of [builtin, ray]" in proc.stderr.strip(), proc.stderr
    with pytest.raises(Exception, match="writes .jsonl or .parquet"):
        OmegaConf.to_object(compose_cfg(["infer.engine=ray", "infer.output=x.tsv"]).infer)


def test_write_config_is_a_serve_deploy_config_of_the_same_application(pkg, tmp_path, capsys):
    import yaml
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.deployment import Application
    from ray.serve.schema import ServeDeploySchema

    from pipeline.cluster.serve import build
    from pipeline.stages import serve

    out = tmp_path / "serve.yaml"
    ctx = make_ctx(tmp_path / "art", [f"serve.package={pkg}", "serve.engine=ray", f"serve.write_config={out}",
                                      "serve.host=0.0.0.0", "serve.max_replicas=4", "serve.max_batch=4"])
    serve.run(OmegaConf.to_object(ctx.cfg.serve), ctx)  # writes and returns: no cluster, no server
    assert "serve deploy" in capsys.readouterr().out
    config = yaml.safe_load(out.read_text())
    ServeDeploySchema.model_validate(config)  # what `serve deploy` and a RayService accept
    app = config["applications"][0]
    assert app["import_path"] == "pipeline.cluster.serve:build" and app["route_prefix"] == "/"
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000}
    assert app["args"]["package"] == str(pkg.resolve()) and app["args"]["max_batch"] == 4
    assert isinstance(call_user_app_builder_with_args_if_necessary(build, app["args"]), Application)


def test_a_list_of_paths_is_read_in_its_order_and_a_missing_one_is_reported(work, pkg, infer_answers, tmp_path):
    from pipeline import files
    from pipeline.errors import InputError
    from pipeline.stages import infer

    listing = work / "images" / "some.txt"
    listing.write_text("# two of the three, and one that is not there\nf2.png\n\nmissing.png\n"
                       f"{work / 'images' / 'f0.png'}\n", encoding="utf-8")
    try:
        assert [p.name for p in files.image_list(listing, "infer.image")] == ["f2.png", "missing.png", "f0.png"]
        ctx = make_ctx(tmp_path / "art", [f"infer.package={pkg}", f"infer.image={listing}"])
        result = infer.run(OmegaConf.to_object(ctx.cfg.infer), ctx)
        assert result["predictions"] == {k: infer_answers[k] for k in ("f2.png", "f0.png")}
        (tmp_path / "empty.txt").write_text("# nothing\n", encoding="utf-8")
        with pytest.raises(InputError, match="lists no image path"):
            files.image_list(tmp_path / "empty.txt", "infer.image")
    finally:
        listing.unlink()  # the folder is the other tests' input
