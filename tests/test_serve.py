"""stage serve on the real exported package: a real server process, real requests. The answers equal
stage=infer's, batched or alone; hostile requests get their 4xx and the server goes on; the bounded
queue answers 503; SIGTERM drains (accepted requests answered, new ones refused, exit 0); the load
test script runs. Batching is made deterministic by long ``serve.max_wait_ms`` windows, never by timing."""
from __future__ import annotations

import http.client
import importlib.util
import io
import json
import select
import socket
import threading
import time

import numpy as np
import pytest
from omegaconf import OmegaConf
from PIL import Image

from pipeline.data.render import render_formula
from pipeline.errors import ConfigError
from conftest import REPO, make_ctx, run_cli
from serve_client import multipart, side_by_side
from export_session import FORMULAS, artifacts_root, ort_package  # one export per session

pytestmark = pytest.mark.slow  # the package is the real model exported

spec = importlib.util.spec_from_file_location("serve_load", REPO / "benchmarks" / "serve_load.py")
serve_load = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serve_load)


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def pkg():
    return ort_package()


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return [png(render_formula(latex)) for latex in FORMULAS]


@pytest.fixture(scope="module")
def infer_answers(pkg, images, tmp_path_factory) -> list[str]:
    """stage=infer's readings of the same images (in-process: the stage's own run)."""
    from pipeline.stages import infer

    folder = tmp_path_factory.mktemp("serve-images")
    for i, data in enumerate(images):
        (folder / f"{i}.png").write_bytes(data)
    ctx = make_ctx(folder / "artifacts", [f"infer.package={pkg}", f"infer.image={folder}"])
    predictions = infer.run(OmegaConf.to_object(ctx.cfg.infer), ctx)["predictions"]
    return [predictions[f"{i}.png"] for i in range(len(images))]


# every batch waits 4 s for a fourth image that never fits: a queue of at most 3 (the 4th is refused)
WINDOW = ["serve.workers=2", "serve.max_batch=4", "serve.max_wait_ms=4000", "serve.max_queue=3",
          "serve.max_bytes=200000", "serve.read_timeout_s=1", "serve.header_timeout_s=1"]


@pytest.fixture(scope="module")
def server(pkg, tmp_path_factory):
    s = serve_load.Server(str(pkg), WINDOW, tmp_path_factory.mktemp("serve-artifacts"))
    yield s
    assert s.stop() == 0, s.err[-5:]


def request(server, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.getheaders(), resp.read()
    finally:
        conn.close()


def predict(server, data: bytes, ctype: str = "image/png") -> tuple[int, dict]:
    status, _, body = request(server, "POST", "/predict", data, {"Content-Type": ctype})
    return status, json.loads(body)


def wait_for_queue(server, n: int) -> None:
    for _ in range(3000):
        if json.loads(request(server, "GET", "/health")[2])["queue"] == n:
            return
        time.sleep(0.01)
    raise AssertionError(f"the queue never held {n}")


def test_batched_answers_equal_stage_infer_raw_and_multipart(server, images, infer_answers):
    form, form_type = multipart(images[1])
    got = side_by_side(predict, [(server, images[0]), (server, images[1]), (server, form, form_type)])
    assert [s for s, _ in got] == [200, 200, 200], got
    assert [b["latex"] for _, b in got] == [infer_answers[0], infer_answers[1], infer_answers[1]]
    assert [b["batch"] for _, b in got] == [3, 3, 3]  # read together: one encoder call for the three
    # an ort_cpu package decodes a batch image by image speculatively (package.json: speculative_batches)
    assert all(b["ms"] > 0 and b["speculative"] for _, b in got)
    status, _, body = request(server, "GET", "/metrics")
    text = body.decode()
    assert status == 200 and 'formula_serve_batch_size_bucket{le="3.0"} 1.0' in text
    assert 'formula_serve_requests_total{code="200",path="/predict"}' in text
    assert "formula_serve_request_seconds_count" in text and "formula_serve_queue_length 0.0" in text


def test_full_queue_answers_503_and_the_queued_are_read(server, images, infer_answers):
    pending = [None] * 3
    threads = [threading.Thread(target=lambda i=i: pending.__setitem__(i, predict(server, images[i % 2])))
               for i in range(3)]
    for t in threads:
        t.start()
    wait_for_queue(server, 3)  # the worker waits for a fourth that cannot come
    status, headers, body = request(server, "POST", "/predict", images[0], {"Content-Type": "image/png"})
    assert status == 503 and "serve.max_queue=3" in json.loads(body)["error"]
    assert dict(headers).get("retry-after") == "1"
    for t in threads:
        t.join()
    assert [p[0] for p in pending] == [200, 200, 200]
    assert [p[1]["latex"] for p in pending] == [infer_answers[i % 2] for i in range(3)]
    assert 'formula_serve_errors_total{reason="queue_full"} 1.0' in request(server, "GET", "/metrics")[2].decode()


def slow_client(server, sent: bytes) -> bytes:
    """Headers promising 5000 bytes, then 100 of them, then nothing."""
    with socket.create_connection((server.host, server.port), timeout=60) as sock:
        sock.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\nContent-Length: 5000\r\n\r\n" + sent)
        return sock.recv(65536)


def chunked_over_limit(server, chunks: int = 24, size: int = 16384) -> bytes:
    """A chunked body with no declared length, sent a chunk at a time until the server answers (it cuts the
    body off once past serve.max_bytes and closes: a client still sending then meets a broken pipe)."""
    with socket.create_connection((server.host, server.port), timeout=60) as sock:
        sock.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range(chunks):
            if select.select([sock], [], [], 0.05)[0]:
                break
            try:
                sock.sendall(b"%x\r\n" % size + b"\0" * size + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
        return sock.recv(65536)


def test_hostile_requests_get_their_4xx_and_the_server_goes_on(server, images):
    whole = images[0]
    bomb = png(Image.new("1", (10_000, 10_000), 1))  # 100 megapixels in a few kB
    cases = {
        "not an image": (b"this is not an image", "image/png", 400, "cannot decode"),
        "truncated": (whole[: len(whole) // 2], "image/png", 400, "cannot decode"),
        "decompression bomb": (bomb, "image/png", 400, "decompression bomb"),
        "over max_bytes": (b"\0" * 300_000, "image/png", 413, "serve.max_bytes"),
        "wrong content type": (whole, "application/json", 415, "content type"),
        "no content type": (whole, "", 415, "content type"),
        "empty": (b"", "application/octet-stream", 400, "empty body"),
        "form without a field": (b"--b--\r\n", "multipart/form-data; boundary=b", 400, "multipart"),
    }
    for name, (data, ctype, code, words) in cases.items():
        status, _, body = request(server, "POST", "/predict", data, {"Content-Type": ctype} if ctype else {})
        assert status == code, (name, status, body)
        assert words in json.loads(body)["error"], (name, body)
    # a body over the limit without a declared length (chunked) is cut off while it is read
    assert chunked_over_limit(server).startswith(b"HTTP/1.1 413")
    assert slow_client(server, b"\x89PNG" + b"\0" * 96).startswith(b"HTTP/1.1 408")
    assert request(server, "GET", "/nowhere")[0] == 404 and request(server, "GET", "/predict")[0] == 405
    status, _, body = request(server, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    metrics = request(server, "GET", "/metrics")[2].decode()
    for reason in ("bad_image", "too_large", "content_type", "slow_client", "empty", "multipart"):
        assert f'formula_serve_errors_total{{reason="{reason}"}}' in metrics, reason


def test_a_client_that_never_finishes_its_headers_gets_408_and_the_server_goes_on(server):
    with socket.create_connection((server.host, server.port), timeout=60) as sock:
        sock.sendall(b"POST /predict HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        answer = b""
        while chunk := sock.recv(65536):  # the server closes the connection after its answer
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert b"connection: close" in head.lower() and "serve.header_timeout_s=1" in json.loads(body)["error"]
    status, _, body = request(server, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    metrics = request(server, "GET", "/metrics")[2].decode()
    assert 'formula_serve_errors_total{reason="slow_headers"}' in metrics
    assert 'formula_serve_requests_total{code="408",path="other"}' in metrics


def test_sigterm_drains_accepted_requests_refuses_new_and_exits_0(pkg, images, infer_answers, tmp_path):
    # one worker that would wait a minute for a fuller batch: only the drain makes it read now
    s = serve_load.Server(str(pkg), ["serve.workers=1", "serve.max_batch=4", "serve.max_wait_ms=60000"], tmp_path)
    pending = [None] * 3
    threads = [threading.Thread(target=lambda i=i: pending.__setitem__(i, predict(s, images[i % 2])))
               for i in range(3)]
    for t in threads:
        t.start()
    wait_for_queue(s, 3)
    s.proc.send_signal(serve_load.signal.SIGTERM)
    try:
        status, body = predict(s, images[0])
        assert status == 503 and "draining" in body["error"]
    except ConnectionRefusedError:  # the listener already closed
        pass
    for t in threads:
        t.join()
    assert s.proc.wait(120) == 0, s.err[-5:]
    assert [p[0] for p in pending] == [200, 200, 200]
    assert [p[1]["latex"] for p in pending] == [infer_answers[i % 2] for i in range(3)]
    assert any("draining" in line for line in s.err), s.err[-5:]


def test_which_batches_read_speculatively_and_grouping_keeps_the_oldest(pkg, images, infer_answers, tmp_path):
    from pipeline.export.runtime import OnnxPackage
    from pipeline.serving.scheduler import Job, Scheduler, take_batch

    package = OnnxPackage(pkg, threads=1)
    assert package.speculative  # the session's package has the ngram drafter
    scheduler = Scheduler([package], max_length=int(package.meta["max_length"]), max_batch=4, max_wait_s=0)
    try:
        array = package.preprocess(Image.open(io.BytesIO(images[1])))
        reading = scheduler.submit(array).result(120)
    finally:
        scheduler.close()
    assert reading.speculative and reading.batch == 1 and reading.latex == infer_answers[1]

    # a package whose batches decode in greedy steps (a GPU target's: no speculative_batches) reads a
    # batch of two so, and a lone image speculatively
    import shutil

    gpu_like = tmp_path / "gpu-like"
    shutil.copytree(pkg, gpu_like)
    meta = json.loads((gpu_like / "package.json").read_text())
    meta["speculative_batches"] = False
    (gpu_like / "package.json").write_text(json.dumps(meta))
    arrays = [package.preprocess(Image.open(io.BytesIO(data))) for data in images[:2]]
    for folder, batched_speculatively in ((pkg, True), (gpu_like, False)):
        scheduler = Scheduler([OnnxPackage(folder, threads=1)], max_length=int(package.meta["max_length"]),
                              max_batch=4, max_wait_s=5)
        try:
            pair = [scheduler.submit(a) for a in arrays]  # the second arrives inside the first's window
            readings = [f.result(120) for f in pair]
        finally:
            scheduler.close()
        assert [r.batch for r in readings] == [2, 2]
        assert [r.speculative for r in readings] == [batched_speculatively] * 2, folder
        assert [r.latex for r in readings] == infer_answers[:2]

    jobs = [Job(np.zeros(1), width) for width in (50, 400, 60, 390, 55, 410)]
    queue = list(jobs)
    assert take_batch(queue, 3, True) == [jobs[0], jobs[2], jobs[4]]  # the oldest, and the nearest in width
    assert queue == [jobs[1], jobs[3], jobs[5]]
    queue = list(jobs)
    assert take_batch(queue, 3, False) == jobs[:3]


def test_bad_config_is_one_line_before_any_work(tmp_path):
    from pipeline.stages import serve

    proc = run_cli("stage=serve", "serve.max_batch=0", f"artifacts.dir={tmp_path}")
    assert proc.returncode == 2 and proc.stderr.strip() == "error: config: serve.max_batch=0: must be >= 1"
    with pytest.raises(ConfigError, match=r"serve.header_timeout_s=0: must be >= 0.1"):
        serve.ServeConfig(header_timeout_s=0)
    ctx = make_ctx(tmp_path)
    with pytest.raises(ConfigError, match="serve.package is not set"):
        serve.run(OmegaConf.to_object(ctx.cfg.serve), ctx)


def test_load_script_smoke(pkg, capsys):
    corpus = artifacts_root() / "corpus" / "formulas.jsonl"
    code = serve_load.main([str(pkg), str(corpus), "--formulas", "2", "--clients", "1", "2", "--requests", "1",
                            "--drain"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "| batched | 2 | 2 |" in out and "| baseline | 2 | 2 |" in out and "0 unanswered, exit code 0" in out
