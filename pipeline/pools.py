"""The one way this project starts worker processes (corpus building, calibration rendering)."""
from __future__ import annotations

import multiprocessing
from multiprocessing.pool import Pool

from pipeline import interrupts


def process_pool(workers: int) -> Pool:
    """A pool of ``workers`` processes started by a fork server (spawn where there is none).

    Not plain fork: the parent has ONNX Runtime / torch / OpenMP threads by the time it renders,
    and a child forked while one of them holds a lock waits on it forever (seen: a test run hung
    on two workers in futex_wait). The fork server is a fresh interpreter, so its children start
    clean. Workers only parse and render (no torch in them). They do not inherit the parent's
    signal handler: Ctrl-C is the parent's to handle, and the pool's terminate() (SIGTERM) ends a
    worker silently instead of printing a ``KeyboardInterrupt`` traceback per worker."""
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    return ctx.Pool(workers, initializer=interrupts.worker_init)
