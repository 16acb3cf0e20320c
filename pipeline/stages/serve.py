"""Stage serve: an exported package behind an HTTP endpoint, requests batched across workers.

``python -m pipeline stage=serve serve.package=<folder or export stage name>`` serves
``POST /predict`` (an image as the body, or a multipart form's file) -> ``{"latex", "ms", ...}``,
``GET /health`` and ``GET /metrics`` (Prometheus) on ``serve.host:serve.port`` until SIGTERM or
Ctrl-C, then drains and exits 0. ``serve.engine=ray`` serves the same contract from a Ray Serve
deployment (pipeline/cluster/serve.py) on a local cluster or the one at ``serve.address``. Usage and
measurements: docs/serve.md.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from pipeline import files
from pipeline.cluster import Engine, cores
from pipeline.context import StageContext, check_max_length
from pipeline.errors import ConfigError, check_range
from pipeline.export.runtime import OnnxPackage, preprocess_image

log = logging.getLogger(__name__)

NAME = "serve"
CONFIG_KEY = "serve"


@dataclass
class ServeConfig:
    package: Optional[str] = None      # exported package folder, or an export stage's name under the root
    engine: Engine = Engine.builtin    # builtin: this process's server and worker threads | ray: Ray Serve
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
    # engine=ray: replicas of the deployment, each one set of sessions with serve.threads CPUs (0 = 1 thread)
    address: Optional[str] = None      # an existing Ray cluster (auto, host:6379, ray://host:10001); null = a local one
    replicas: int = 0                  # fixed replicas; 0 = one per core / serve.threads (a local cluster's cores)
    min_replicas: int = 1              # autoscaling, when max_replicas > 0: between these on the load
    max_replicas: int = 0
    target_ongoing_requests: float = 0  # autoscaling's target per replica; 0 = serve.max_batch
    write_config: Optional[str] = None  # write a `serve deploy` config (YAML) of the deployment here and exit
    metrics_port: int = 0              # a local cluster's Prometheus endpoint (Ray's and Serve's metrics); 0 = none

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
        check_range("serve.replicas", self.replicas, 0, why="0 = one per core / serve.threads")
        check_range("serve.min_replicas", self.min_replicas, 0)
        check_range("serve.max_replicas", self.max_replicas, 0, why="0 = no autoscaling: serve.replicas")
        if self.max_replicas and self.min_replicas > self.max_replicas:
            raise ConfigError(f"serve.min_replicas={self.min_replicas} is over serve.max_replicas={self.max_replicas}")
        check_range("serve.metrics_port", self.metrics_port, 0, 65535, why="0 = none")
        check_range("serve.target_ongoing_requests", self.target_ongoing_requests, 0, why="0 = serve.max_batch")
        if self.engine is Engine.builtin and (self.address or self.write_config or self.metrics_port):
            raise ConfigError("serve.address, serve.write_config and serve.metrics_port are for serve.engine=ray")


Config = ServeConfig


def run(cfg: ServeConfig, ctx: StageContext) -> dict:
    if cfg.engine is Engine.ray:
        return run_ray(cfg, ctx)
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
    max_length = int(cfg.max_length or first.max_length)
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


def run_ray(cfg: ServeConfig, ctx: StageContext) -> dict:
    """serve.engine=ray: the package as a Ray Serve deployment (pipeline/cluster/serve.py)."""
    from pipeline import cluster

    folder = files.find_package(cfg.package, ctx.artifacts_dir, "serve.package")
    if cfg.write_config:
        files.check_output_file(cfg.write_config, "serve.write_config")
    if cfg.address:  # an unreachable cluster is refused before the package is loaded
        cluster.check_reachable(cfg.address, "serve.address")
    package = OnnxPackage(folder, threads=1, speculative=cfg.speculative)  # the package checked before Ray starts
    if cfg.max_length is not None:
        check_max_length(cfg.max_length, package.max_positions, f"package {folder}", "serve.max_length")
    threads = cfg.threads or 1
    replicas = cfg.replicas or max(1, cores() // threads)
    args_of = dict(package=str(folder.resolve()), threads=threads, speculative=cfg.speculative,
                   max_length=cfg.max_length, max_batch=cfg.max_batch, max_wait_ms=cfg.max_wait_ms,
                   max_bytes=cfg.max_bytes, read_timeout_s=cfg.read_timeout_s, max_queue=cfg.max_queue,
                   replicas=replicas, min_replicas=cfg.min_replicas, max_replicas=cfg.max_replicas,
                   target_ongoing_requests=cfg.target_ongoing_requests, drain_timeout_s=cfg.drain_timeout_s)
    if cfg.write_config:
        import yaml

        from pipeline.cluster.serve import app_args, config_file

        text = yaml.safe_dump(config_file(app_args(**args_of), cfg.host, cfg.port or 8000), sort_keys=False)
        files.write_text_atomic(cfg.write_config, text)
        print(f"wrote {cfg.write_config}: serve deploy {cfg.write_config} (or a RayService's serveConfigV2)")
        return {"config": cfg.write_config, "package": str(folder)}
    connected = cluster.connect(cfg.address, "serve.address", cores(), ctx.progress, cfg.metrics_port)
    try:
        cluster.check_cpus(threads, "serve.threads")
        from pipeline.cluster.serve import app_args, serve_until_signal

        port = cfg.port or cluster.free_port(cfg.host)
        scaling = (f"{cfg.min_replicas}-{cfg.max_replicas} replicas (autoscaling)" if cfg.max_replicas
                   else f"{replicas} replica(s)")

        def announce(host: str, bound: int) -> None:
            metrics = f"; Ray's metrics: http://{cluster.LOCALHOST}:{cfg.metrics_port}" if cfg.metrics_port else ""
            print(f"serving http://{host}:{bound} (POST /predict, GET /health, GET /metrics): {folder}, Ray Serve, "
                  f"{scaling} x {threads} thread(s), batches up to {cfg.max_batch}{metrics}", flush=True)

        serve_until_signal(app_args(**args_of), cfg.host, port, announce)
    finally:
        cluster.disconnect(connected)
    log.info("[serve] drained and stopped (Ray Serve)")
    return {"package": str(folder), "engine": "ray"}
