"""The one way this project starts worker processes (corpus building, calibration rendering)."""
from __future__ import annotations

import multiprocessing
from multiprocessing.pool import Pool

from pipeline import interrupts


def process_pool(workers: int) -> Pool:
    """A pool of ``workers`` forked processes (spawn where fork does not exist).

    Workers only parse and render (no torch in them). They do not inherit the parent's signal
    handler: Ctrl-C is the parent's to handle, and the pool's terminate() (SIGTERM) ends a worker
    silently instead of printing a ``KeyboardInterrupt`` traceback per worker."""
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
    return ctx.Pool(workers, initializer=interrupts.worker_init)
