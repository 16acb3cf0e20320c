"""The HTTP side of stage serve: a plain ASGI app (``POST /predict``, ``GET /health``,
``GET /metrics``) and the uvicorn server it runs on, which drains on SIGTERM.

Every hostile request is answered with a 4xx and one JSON line, and nothing it does reaches a
worker: a wrong content type (415) and a declared body over ``max_bytes`` (413) are refused before
the body is read; a body that grows past ``max_bytes`` (413) or does not arrive within
``read_timeout_s`` (a slow client, 408) is refused while it is read; what is not a decodable image,
a truncated one, or a decompression bomb (400) is refused by :func:`pipeline.files.decode_image`,
the guard every stage reads images through, in a thread of its own. A client that does not finish
its request line and headers within ``header_timeout_s`` (a slowloris) is answered 408 before any
of this, by the server's protocol (:mod:`.protocol`).
"""
from __future__ import annotations

import asyncio
import io
import json
import logging
import signal
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Optional

import numpy as np
from PIL import Image

from pipeline import files
from pipeline.errors import ImageError, InputError
from pipeline.serving.metrics import ServeMetrics
from pipeline.serving.scheduler import Draining, QueueFull, Scheduler

log = logging.getLogger(__name__)
# python-multipart logs every malformed form it is sent; a hostile request is answered 400, not logged
logging.getLogger("python_multipart").setLevel(logging.CRITICAL)

PATHS = ("/predict", "/health", "/metrics")
# what POST /predict takes: the image file itself, or a form with it as a file field
RAW_TYPES = ("application/octet-stream",)
MULTIPART = "multipart/form-data"


class HttpError(Exception):
    def __init__(self, status: int, reason: str, message: str):
        super().__init__(message)
        self.status, self.reason = status, reason


@dataclass
class Limits:
    max_bytes: int = 4_000_000     # largest body read
    read_timeout_s: float = 10.0   # the whole body must arrive within this
    header_timeout_s: float = 10.0  # the request line and headers must arrive within this


def check_route(path: str, method: str) -> None:
    """404 for a path the server has not, 405 for the wrong method on one it has."""
    if path not in PATHS:
        raise HttpError(404, "not_found", f"no {path}; POST /predict, GET /health, GET /metrics")
    want = "POST" if path == "/predict" else "GET"
    if method != want:
        raise HttpError(405, "method", f"{method} {path}: use {want}")


def check_content_type(ctype: str) -> None:
    if not (ctype.startswith("image/") or ctype in RAW_TYPES or ctype == MULTIPART):
        raise HttpError(415, "content_type", f"content type {ctype or '(none)'!r}: send the image file itself "
                        f"(image/*, application/octet-stream) or a {MULTIPART} form with it as a file")


def image_from_form(body: bytes, header: bytes | str) -> bytes:
    """The first file field (else the first field) of a ``multipart/form-data`` body (python-multipart)."""
    from python_multipart import parse_form
    from python_multipart.exceptions import FormParserError

    fields, uploads = [], []
    header = header.encode("latin-1") if isinstance(header, str) else header
    try:
        parse_form({"Content-Type": header, "Content-Length": str(len(body)).encode()}, io.BytesIO(body),
                   fields.append, uploads.append)
    except FormParserError as exc:  # no boundary, a malformed part (its ValueError subclasses too)
        raise HttpError(400, "multipart", f"a multipart/form-data body that cannot be parsed: {exc}") from None
    if uploads:
        upload = uploads[0].file_object
        upload.seek(0)
        data = upload.read()
    elif fields:
        data = fields[0].value or b""
    else:
        raise HttpError(400, "multipart", "a multipart/form-data body with no field; send the image as a file field")
    if not data:
        raise HttpError(400, "multipart", "the form's file field is empty")
    return data


def check_declared_length(declared: bytes | str | None, limits: Limits) -> None:
    """A declared body over ``limits.max_bytes`` is refused before it is read (413)."""
    if isinstance(declared, bytes):
        declared = declared.decode("latin-1")
    if declared is not None and declared.strip().isdigit() and int(declared) > limits.max_bytes:
        raise HttpError(413, "too_large", f"body of {int(declared):,} bytes is over serve.max_bytes={limits.max_bytes:,}")


async def read_limited(chunks: AsyncIterator[bytes], limits: Limits) -> bytes:
    """A body from its chunks, at most ``limits.max_bytes``, all of it within ``limits.read_timeout_s``
    (the guard of both engines: this server's ASGI messages, or a Starlette request's stream under Ray)."""

    async def gather() -> bytes:
        body = bytearray()
        async for chunk in chunks:
            body += chunk
            if len(body) > limits.max_bytes:
                raise HttpError(413, "too_large", f"body over serve.max_bytes={limits.max_bytes:,} bytes")
        return bytes(body)

    try:
        return await asyncio.wait_for(gather(), limits.read_timeout_s)
    except asyncio.TimeoutError:
        raise HttpError(408, "slow_client", f"the body did not arrive within serve.read_timeout_s="
                        f"{limits.read_timeout_s:g} s") from None


async def read_body(receive, headers: dict[bytes, bytes], limits: Limits) -> bytes:
    """The request body of an ASGI request, at most ``limits.max_bytes``, within ``limits.read_timeout_s``."""
    check_declared_length(headers.get(b"content-length"), limits)

    async def chunks() -> AsyncIterator[bytes]:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise HttpError(400, "disconnect", "the client went away before the body ended")
            yield message.get("body", b"")
            if not message.get("more_body", False):
                return

    return await read_limited(chunks(), limits)


async def request_image(ctype_header: bytes | str, read: Callable[[], Awaitable[bytes]],
                        prepare: Callable[[Image.Image], np.ndarray]) -> np.ndarray:
    """A ``POST /predict`` request's image as the package's input array, through every guard in turn:
    the content type (415), the body (``read``: within the limits, 413 / 408), a form's file field,
    an empty body (400), and :func:`pipeline.files.decode_image` (400), off the event loop. Both engines."""
    header = ctype_header.decode("latin-1") if isinstance(ctype_header, bytes) else ctype_header
    ctype = header.split(";")[0].strip().lower()
    check_content_type(ctype)
    body = await read()
    if ctype == MULTIPART:
        body = image_from_form(body, header)
    if not body:
        raise HttpError(400, "empty", "empty body; send an image")

    def decode() -> np.ndarray:
        return prepare(files.decode_image(io.BytesIO(body), "request body"))

    try:  # decoding a large image takes milliseconds: off the event loop
        return await asyncio.get_running_loop().run_in_executor(None, decode)
    except ImageError as exc:
        raise HttpError(400, "bad_image", str(exc)) from None


def predict_answer(metrics, reading, started: float) -> bytes:
    """``POST /predict``'s answer to a reading that began at ``started`` (``time.perf_counter``), its
    latency observed: one body for every engine."""
    seconds = time.perf_counter() - started
    metrics.latency.observe(seconds)
    return json.dumps({"latex": reading.latex, "ms": round(1000 * seconds, 2), "batch": reading.batch,
                       "speculative": reading.speculative, "hit_cap": reading.hit_cap}).encode()


class ServeApp:
    """The ASGI app. ``prepare`` turns a decoded image into the package's input array."""

    def __init__(self, scheduler: Scheduler, prepare: Callable, limits: Limits, metrics: ServeMetrics,
                 info: Optional[dict] = None):
        self.scheduler = scheduler
        self.prepare = prepare
        self.limits = limits
        self.metrics = metrics
        self.info = dict(info or {})
        self.draining = False

    def count_slow_headers(self) -> None:
        """A connection the protocol answered 408: its headers did not arrive in time (no path known)."""
        self.metrics.errors.labels("slow_headers").inc()
        self.metrics.requests.labels("other", "408").inc()

    def start_draining(self) -> None:
        self.draining = True
        self.scheduler.drain()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan: nothing to set up (uvicorn runs with lifespan off)
            return
        path, method = scope["path"], scope["method"]
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        try:
            check_route(path, method)
            if path == "/health":
                status = 503 if self.draining else 200
                body = {"status": "draining" if self.draining else "ok", "workers": self.scheduler.workers,
                        "queue": self.scheduler.queue_length(), **self.info}
                await self._send(send, path, status, json.dumps(body).encode(), close=self.draining)
            elif path == "/metrics":
                await self._send(send, path, 200, self.metrics.render(), self.metrics.content_type)
            else:
                await self._predict(receive, send, headers)
        except HttpError as exc:
            self.metrics.errors.labels(exc.reason).inc()
            # a refused body may be unread: close the connection rather than read it
            await self._send(send, path, exc.status, json.dumps({"error": str(exc)}).encode(), close=True)

    async def _predict(self, receive, send, headers: dict[bytes, bytes]) -> None:
        if self.draining:
            raise HttpError(503, "draining", "the server is draining (SIGTERM); no new requests")
        started = time.perf_counter()
        image = await request_image(headers.get(b"content-type", b""),
                                    lambda: read_body(receive, headers, self.limits), self.prepare)
        self.metrics.in_flight.inc()
        try:
            try:
                future = self.scheduler.submit(image)
            except QueueFull as exc:
                raise HttpError(503, "queue_full", str(exc)) from None
            except Draining as exc:
                raise HttpError(503, "draining", str(exc)) from None
            try:
                reading = await asyncio.wrap_future(future)
            except Exception as exc:
                log.error(f"[serve] a reading failed: {type(exc).__name__}: {exc}")
                raise HttpError(500, "internal", f"the reading failed: {type(exc).__name__}") from None
        finally:
            self.metrics.in_flight.dec()
        await self._send(send, "/predict", 200, predict_answer(self.metrics, reading, started))

    async def _send(self, send, path: str, status: int, body: bytes, ctype: str = "application/json",
                    close: bool = False) -> None:
        self.metrics.requests.labels(path if path in PATHS else "other", str(status)).inc()
        headers = [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        if status == 503 and not self.draining:
            headers.append((b"retry-after", b"1"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def run_server(app: ServeApp, host: str, port: int, drain_timeout_s: float,
               announce: Callable[[str, int], None]) -> None:
    """Serve ``app`` until SIGTERM or Ctrl-C, then drain: new connections and requests are refused,
    the accepted ones answered (for up to ``drain_timeout_s``), the workers stopped; returns."""
    import uvicorn

    from pipeline.serving.protocol import header_timeout_protocol

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            # uvicorn re-raises a captured signal after its shutdown (a SIGTERM would then end the
            # stage as interrupted, exit 2); a drain is the stage's normal end, so it is not recorded
            log.warning(f"[serve] {signal.Signals(sig).name}: draining (accepted requests are answered, "
                        f"new ones refused)")
            app.start_draining()
            if self.should_exit:  # a second signal: stop now
                self.force_exit = True
            self.should_exit = True

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started and self.servers:
                bound = self.servers[0].sockets[0].getsockname()
                announce(bound[0], bound[1])

    http = header_timeout_protocol(app.limits.header_timeout_s, app.count_slow_headers)  # uvicorn's h11 one
    config = uvicorn.Config(app, host=host, port=port, lifespan="off", http=http, loop="asyncio",
                            log_config=None, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=drain_timeout_s)
    server = DrainingServer(config)
    try:
        server.run()
    except SystemExit:  # uvicorn exits when it cannot bind; logged above as uvicorn's own line
        pass
    finally:
        app.start_draining()
        app.scheduler.close()
    if not server.started:
        raise InputError(f"serve.host={host} serve.port={port}: the server could not listen there "
                         f"(the port in use, or not an address of this machine)")
