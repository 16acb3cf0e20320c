"""Stage serve: an exported package behind an HTTP endpoint, requests batched across workers.

``python -m pipeline stage=serve serve.package=<folder or export stage name>`` serves
``POST /predict`` (an image as the body, or a multipart form's file) -> ``{"latex", "ms", ...}``,
``GET /health`` and ``GET /metrics`` (Prometheus) on ``serve.host:serve.port`` until SIGTERM or
Ctrl-C, then drains and exits 0. Usage and measurements: docs/serve.md.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

from pipeline import files
from pipeline.context import StageContext, check_max_length
from pipeline.errors import ConfigError, check_range
from pipeline.export.runtime import OnnxPackage, preprocess_image

log = logging.getLogger(__name__)

NAME = "serve"
CONFIG_KEY = "serve"


@dataclass
class ServeConfig:
    package: Optional[str] = None      # exported package folder, or an export stage's name under the root
    host: str = "127.0.0.1"            # the address to listen on (0.0.0.0: every interface)
    port: int = 8000                   # 0: a free port, printed when the server is up
    workers: int = 0                   # worker threads, each with its own ONNX Runtime sessions; 0 = one per core
    threads: int = 0                   # ONNX Runtime intra-op threads a worker; 0 = cores / workers
    max_batch: int = 8                 # images a worker decodes in one batch
    max_wait_ms: float = 10.0          # how long the oldest waiting image may wait for a fuller batch
    max_queue: int = 64                # images waiting at most; a request beyond answers 503
    group_by_length: bool = True       # a batch joins the oldest image with the nearest in ink width
    speculative: bool = True           # a package with a drafter reads speculatively: every batch where its target
                                       # says so (package.json: speculative_batches, ort_cpu), else a lone batch of one
    max_length: Optional[int] = None   # decode cap incl. BOS; null = the package's
    max_bytes: int = 4_000_000         # largest request body (413 above)
    read_timeout_s: float = 10.0       # a body must arrive within this (408: a slow client)
    header_timeout_s: float = 10.0     # the request line and headers must arrive within this (408: a slowloris)
    drain_timeout_s: float = 60.0      # on SIGTERM, how long accepted requests are waited for

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("serve.host is empty; give an address, e.g. 127.0.0.1")
        check_range("serve.port", self.port, 0, 65535, why="0 = a free port")
        check_range("serve.workers", self.workers, 0, why="0 = one per core")
        check_range("serve.threads", self.threads, 0, why="0 = cores / workers")
        check_range("serve.max_batch", self.max_batch, 1)
        check_range("serve.max_wait_ms", self.max_wait_ms, 0, 60_000)
        check_range("serve.max_queue", self.max_queue, 1)
        if self.max_length is not None:
            check_range("serve.max_length", self.max_length, 2, why="BOS plus at least one token")
        check_range("serve.max_bytes", self.max_bytes, 1024, why="an image file is more than 1 kB")
        check_range("serve.read_timeout_s", self.read_timeout_s, 0.1)
        check_range("serve.header_timeout_s", self.header_timeout_s, 0.1)
        check_range("serve.drain_timeout_s", self.drain_timeout_s, 0)


Config = ServeConfig


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run(cfg: ServeConfig, ctx: StageContext) -> dict:
    from pipeline.serving.app import Limits, ServeApp, run_server
    from pipeline.serving.metrics import ServeMetrics
    from pipeline.serving.scheduler import Scheduler

    folder = files.find_package(cfg.package, ctx.artifacts_dir, "serve.package")
    workers = cfg.workers or cores()
    threads = cfg.threads or max(1, cores() // workers)
    packages = [OnnxPackage(folder, threads=threads, speculative=cfg.speculative) for _ in range(workers)]
    first = packages[0]
    if cfg.max_length is not None:
        check_max_length(cfg.max_length, first.max_positions, f"package {folder}", "serve.max_length")
    max_length = int(cfg.max_length or first.meta["max_length"])
    metrics = ServeMetrics(cfg.max_batch)
    scheduler = Scheduler(packages, max_length, cfg.max_batch, cfg.max_wait_ms / 1000, cfg.max_queue,
                          cfg.group_by_length, metrics)
    spec = first.preprocess_spec
    info = {"package": str(folder), "target": first.meta["target"], "max_batch": cfg.max_batch,
            "speculative": first.speculative, "speculative_batches": first.speculative_batches}
    limits = Limits(cfg.max_bytes, cfg.read_timeout_s, cfg.header_timeout_s)
    app = ServeApp(scheduler, lambda image: preprocess_image(image, spec), limits, metrics, info)

    def announce(host: str, port: int) -> None:
        how = ("speculative" if first.speculative_batches else "speculative when alone") if first.speculative \
            else "greedy"
        print(f"serving http://{host}:{port} (POST /predict, GET /health, GET /metrics): {folder}, "
              f"{workers} worker(s) x {threads} thread(s), batches up to {cfg.max_batch} ({how})", flush=True)

    run_server(app, cfg.host, cfg.port, cfg.drain_timeout_s, announce)
    log.info(f"[serve] drained and stopped: {scheduler.answered} image(s) read")
    return {"answered": scheduler.answered, "package": str(folder)}
