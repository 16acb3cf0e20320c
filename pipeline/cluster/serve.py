"""``serve.engine=ray``: an exported package behind Ray Serve, the builtin server's HTTP contract.

One deployment, :class:`FormulaReader`: each replica holds one :class:`OnnxPackage` (its own ONNX
Runtime sessions, ``threads`` intra-op threads = the replica's ``num_cpus``) and answers
``POST /predict``, ``GET /health`` and ``GET /metrics`` itself, through the builtin server's guards
(:func:`pipeline.serving.app.request_image`: content type 415, size 413, slow body 408, not an image,
truncated, bomb or an empty form 400). Images are batched by ``@serve.batch`` (``max_batch``,
``max_wait_ms``) and read the way the builtin scheduler reads a batch (:func:`read_batch`), so the
answers are ``stage=infer``'s. ``serve.max_queue`` is Serve's ``max_queued_requests`` (503 beyond it).

:func:`build` is the application builder a Ray Serve config file names (``import_path:
pipeline.cluster.serve:build``, with :func:`app_args`' dict as ``args``): ``serve deploy`` and a
KubeRay ``RayService`` run the deployment the stage runs (docs/serve.md).
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import numpy as np
from ray import serve
from starlette.requests import Request
from starlette.responses import Response

from pipeline.export.runtime import OnnxPackage, preprocess_image
from pipeline.serving.app import (PATHS, HttpError, Limits, check_declared_length, check_route, predict_answer,
                                  read_limited, request_image)
from pipeline.serving.metrics import ServeMetrics
from pipeline.serving.scheduler import Reading, read_batch

log = logging.getLogger(__name__)

APP_NAME = "formula"
IMPORT_PATH = "pipeline.cluster.serve:build"


@serve.deployment(name="FormulaReader")
class FormulaReader:
    """A replica: one package's sessions, the HTTP guards, and a ``@serve.batch`` of images."""

    def __init__(self, package: str, threads: int = 1, speculative: bool = True, max_length: Optional[int] = None,
                 max_batch: int = 8, max_wait_ms: float = 10.0, max_bytes: int = 4_000_000,
                 read_timeout_s: float = 10.0):
        self.package = OnnxPackage(package, threads=threads, speculative=speculative)
        self.max_length = int(max_length or self.package.max_length)
        self.limits = Limits(max_bytes, read_timeout_s)
        self.metrics = ServeMetrics(max_batch)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="reader")  # ORT releases the GIL; the loop stays free
        self.read.set_max_batch_size(max_batch)
        self.read.set_batch_wait_timeout_s(max_wait_ms / 1000)
        spec = self.package.preprocess_spec
        self.prepare = lambda image: preprocess_image(image, spec)
        self.info = {"package": package, "target": self.package.meta["target"], "max_batch": max_batch,
                     "speculative": self.package.speculative, "threads": threads, "engine": "ray"}

    async def __call__(self, request: Request) -> Response:
        path, method = request.url.path, request.method
        try:
            check_route(path, method)
            if path == "/health":
                return self._answer(path, 200, json.dumps({"status": "ok", **self.info}).encode())
            if path == "/metrics":
                return self._answer(path, 200, self.metrics.render(), self.metrics.content_type)
            return await self._predict(request)
        except HttpError as exc:
            self.metrics.errors.labels(exc.reason).inc()
            return self._answer(path, exc.status, json.dumps({"error": str(exc)}).encode(), close=True)

    async def _predict(self, request: Request) -> Response:
        started = time.perf_counter()

        async def body() -> bytes:
            check_declared_length(request.headers.get("content-length"), self.limits)
            return await read_limited(request.stream(), self.limits)

        image = await request_image(request.headers.get("content-type", ""), body, self.prepare)
        self.metrics.in_flight.inc()
        try:
            reading = await self.read(image)
        except Exception as exc:
            log.error(f"[serve] a reading failed: {type(exc).__name__}: {exc}")
            raise HttpError(500, "internal", f"the reading failed: {type(exc).__name__}") from None
        finally:
            self.metrics.in_flight.dec()
        return self._answer("/predict", 200, predict_answer(self.metrics, reading, started))

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01)  # set from the arguments in __init__
    async def read(self, images: list[np.ndarray]) -> list[Reading]:
        return await asyncio.get_running_loop().run_in_executor(self.pool, self._read_batch, images)

    def _read_batch(self, images: list[np.ndarray]) -> list[Reading]:
        # as the builtin scheduler: a package with a drafter reads every batch speculatively where its
        # target says so (a CPU's), else only a lone image
        speculative = self.package.speculative and (len(images) == 1 or self.package.speculative_batches)
        self.metrics.batch_size.observe(len(images))
        if speculative:
            self.metrics.speculative.inc()
        result = read_batch(self.package, np.stack(images), self.max_length, speculative)
        return [Reading(text, len(images), speculative, bool(capped))
                for text, capped in zip(result.texts, result.hit_cap)]

    def _answer(self, path: str, status: int, body: bytes, ctype: str = "application/json",
                close: bool = False) -> Response:
        self.metrics.requests.labels(path if path in PATHS else "other", str(status)).inc()
        return Response(body, status_code=status, media_type=ctype, headers={"connection": "close"} if close else None)


def app_args(package: str, threads: int, speculative: bool, max_length: Optional[int], max_batch: int,
             max_wait_ms: float, max_bytes: int, read_timeout_s: float, max_queue: int, replicas: int,
             min_replicas: int, max_replicas: int, target_ongoing_requests: float, drain_timeout_s: float) -> dict:
    """The application's arguments, JSON values only: what :func:`build` takes and a config file holds."""
    return {k: v for k, v in locals().items()}


def build(args: dict[str, Any]):
    """The Serve application of ``args`` (:func:`app_args`): one :class:`FormulaReader` deployment,
    its replicas (``replicas``, or autoscaling between ``min_replicas`` and ``max_replicas`` on
    ``target_ongoing_requests``), each with ``threads`` CPUs and as many ONNX Runtime threads."""
    a = dict(args)
    scaling: dict[str, Any]
    if a["max_replicas"]:
        scaling = {"autoscaling_config": {"min_replicas": a["min_replicas"], "max_replicas": a["max_replicas"],
                                          "target_ongoing_requests": a["target_ongoing_requests"] or a["max_batch"]}}
    else:
        scaling = {"num_replicas": a["replicas"]}
    deployment = FormulaReader.options(
        # a replica takes a batch's worth and the next one's: Serve's default (5) would cap batches below 8
        max_ongoing_requests=2 * a["max_batch"], max_queued_requests=a["max_queue"],
        ray_actor_options={"num_cpus": a["threads"]}, graceful_shutdown_timeout_s=a["drain_timeout_s"],
        **scaling)
    return deployment.bind(a["package"], a["threads"], a["speculative"], a["max_length"], a["max_batch"],
                           a["max_wait_ms"], a["max_bytes"], a["read_timeout_s"])


def config_file(args: dict[str, Any], host: str, port: int) -> dict:
    """A ``serve deploy``-ready config (a KubeRay ``RayService``'s ``serveConfigV2``) of this application."""
    return {"proxy_location": "EveryNode", "http_options": {"host": host, "port": port},
            "applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": IMPORT_PATH, "args": args}]}


def wait_for_signal() -> int:
    """Block until SIGTERM or SIGINT; the previous handlers are back when it returns (a second signal
    then interrupts the drain)."""
    received: list[int] = []
    done = threading.Event()

    def handler(signum, frame) -> None:
        received.append(signum)
        done.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not done.wait(0.5):
            pass
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    return received[0]


def serve_running() -> bool:
    """Whether Serve already runs on the connected cluster (its controller actor is alive)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        return True
    except ValueError:
        return False


def serve_until_signal(args: dict, host: str, port: int, announce: Callable[[str, int], None]) -> None:
    """Run the application on the connected cluster until SIGTERM or Ctrl-C, then drain: the replicas
    answer what they accepted (for up to ``drain_timeout_s``) and stop. Serve itself is shut down only
    where this stage started it; on a cluster where Serve already ran, only the application goes
    (and Serve's proxy keeps the address and port it was started with)."""
    from pipeline.errors import PipelineError

    owns_serve = not serve_running()
    serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly")
    try:
        serve.run(build(args), name=APP_NAME, route_prefix="/", blocking=False)
    except RuntimeError as exc:  # a replica that cannot start (its package, its resources)
        raise PipelineError(f"serve.engine=ray: the deployment did not start: {exc}") from None
    announce(host, port)
    sig = wait_for_signal()
    log.warning(f"[serve] {signal.Signals(sig).name}: draining (accepted requests are answered, new ones refused)")
    serve.delete(APP_NAME)  # replicas finish their requests (graceful_shutdown_timeout_s) and stop
    if owns_serve:
        serve.shutdown()
