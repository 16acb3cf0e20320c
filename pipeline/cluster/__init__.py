"""Scaling out on Ray: the stages' ``engine=ray`` (``serve.engine``, ``infer.engine``).

:mod:`.serve` is a Ray Serve deployment that holds a package's sessions per replica and answers the
builtin server's HTTP contract; :mod:`.data` reads a folder with Ray Data on an actor pool, one set
of sessions an actor. This module joins or starts the cluster, once per stage, and refuses an
address where no Ray answers before any work. Ray is imported only when an engine asks for it.
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Optional

from pipeline.choices import Choice
from pipeline.errors import ConfigError

log = logging.getLogger(__name__)

# a local cluster's shared-memory object store: requests and results are small (an image, a string),
# so a cap keeps Ray's default (30 % of the machine's memory) off a shared machine
LOCAL_OBJECT_STORE_BYTES = 256 * 1024 * 1024
# the only address a local cluster and its server use
LOCALHOST = "127.0.0.1"


class Engine(Choice):
    """What runs a stage's reading: this process (``builtin``) or Ray (``ray``)."""
    builtin = "builtin"
    ray = "ray"


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def free_port(host: str) -> int:
    """A port free on ``host`` now (Serve's proxy takes a port number, not 0)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _host_port(address: str) -> Optional[tuple[str, int]]:
    """``host:port`` of an address (``ray://host:10001``, ``host:6379``); None for ``auto``."""
    rest = address.split("://", 1)[-1]
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def check_reachable(address: str, key: str, timeout_s: float = 3.0) -> None:
    """A TCP connection to the address's port, before Ray is asked (whose own retries take a minute)."""
    where = _host_port(address)
    if address != "auto" and where is None:
        raise ConfigError(f"{key}={address}: not a Ray address; give auto, host:port or ray://host:port "
                          f"(or leave it unset for a local cluster)")
    if where is None:
        return
    try:
        socket.create_connection(where, timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(f"{key}={address}: Ray is not reachable there ({exc.strerror or exc})") from None


def start_local(num_cpus: int, object_store_bytes: int = LOCAL_OBJECT_STORE_BYTES, log_to_driver: bool = False,
                metrics_port: int = 0) -> None:
    """A local Ray cluster on 127.0.0.1 alone: ``num_cpus``, no dashboard, a capped object store (and
    Ray's Prometheus endpoint on ``metrics_port``, where not 0)."""
    # Ray advertises a local node on its routable address even when told 127.0.0.1, unless it is not
    # a cluster node (read when ray is first imported); a local cluster is this machine's alone
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no report home: this machine has no network
    # Serve gives its HTTP proxy 3 x 5 s to come up, then kills and restarts it; on a loaded 2-core machine
    # its first imports took longer (measured: killed three times over, the stage never served)
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
    import ray

    extra = {"_metrics_export_port": metrics_port} if metrics_port else {}
    ray.init(num_cpus=num_cpus, include_dashboard=False, object_store_memory=object_store_bytes,
             _node_ip_address=LOCALHOST, logging_level=logging.WARNING, log_to_driver=log_to_driver, **extra)


def connect(address: Optional[str], key: str, num_cpus: int, progress: Optional[bool] = None,
            metrics_port: int = 0) -> bool:
    """Join the cluster at ``address`` (``auto``, ``host:port``, ``ray://host:port``) or start a local
    one (:func:`start_local`); a Ray already initialised in this process (a test's) is used as it is.
    Returns whether this call connected (then the caller shuts it down)."""
    if not address:
        import ray

        if ray.is_initialized():
            return False
        start_local(num_cpus, log_to_driver=bool(progress), metrics_port=metrics_port)
        return True
    check_reachable(address, key)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return False
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=bool(progress))
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{key}={address}: Ray is not reachable there ({first})") from None
    return True


def check_cpus(per_worker: int, key: str) -> None:
    """A replica or actor that asks for more CPUs than the whole cluster has would never be placed
    (Ray waits for it for ever): refused in one line instead."""
    import ray

    total = ray.cluster_resources().get("CPU", 0)
    if per_worker > total:
        raise ConfigError(f"{key}={per_worker}: each replica / actor takes that many CPUs, and the Ray "
                          f"cluster has {total:g}")


def disconnect(connected: bool) -> None:
    if connected:
        import ray

        ray.shutdown()
