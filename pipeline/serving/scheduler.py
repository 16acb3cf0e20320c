"""Dynamic batching between requests and the ONNX Runtime sessions.

Requests put one preprocessed image each into a bounded queue (full: :class:`QueueFull`, which the
app answers with 503). Each worker is a thread with an :class:`OnnxPackage` of its own (its own
sessions; ONNX Runtime releases the GIL while it computes). A worker takes the oldest image and
waits up to ``max_wait_s`` after that image arrived for more, up to ``max_batch``; with more waiting
than fit, the oldest is joined by the ones nearest to it in ink width (a stand-in for reading
length: rows of a greedy batch run until the longest one ends). A package with a drafter whose batches
decode speculatively (``package.json: speculative_batches``, a CPU target's) reads every batch so, image
by image; another package with a drafter reads a batch of one taken while nothing else waits
speculatively, every other batch in plain greedy steps.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from pipeline.export.runtime import OnnxPackage
from pipeline.serving.metrics import ServeMetrics

log = logging.getLogger(__name__)

# a preprocessed canvas pixel below this is ink (black formula on white, scaled to [0, 1])
INK_LEVEL = 0.5


class QueueFull(Exception):
    """The bounded queue holds ``max_queue`` images: the request is refused, not parked."""


class Draining(Exception):
    """The server is draining (SIGTERM): requests in flight are read, new ones refused."""


@dataclass
class Reading:
    latex: str
    batch: int          # images decoded together with this one (itself included)
    speculative: bool   # read speculatively (a package with a drafter: its batches, or a lone batch of one)
    hit_cap: bool       # stopped by max_length, not EOS


@dataclass
class Job:
    image: np.ndarray   # [C, H, W] float32, the package's preprocessing
    width: int          # ink columns: the length key batches are grouped by
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.monotonic)


def ink_width(image: np.ndarray) -> int:
    """Columns of the preprocessed canvas holding ink: wider formulas read into more tokens."""
    return int(np.count_nonzero((image < INK_LEVEL).any(axis=tuple(range(image.ndim - 1)))))


def take_batch(queue: list[Job], max_batch: int, group_by_length: bool) -> list[Job]:
    """Remove and return the next batch: the oldest job always (no job waits forever), then, when more
    wait than fit, the ``max_batch - 1`` others nearest it in ink width (ties: the older)."""
    if len(queue) <= max_batch or not group_by_length:
        batch = queue[:max_batch]
        del queue[:max_batch]
        return batch
    first = queue[0]
    chosen = sorted(range(1, len(queue)), key=lambda i: (abs(queue[i].width - first.width), i))[:max_batch - 1]
    keep = set(chosen) | {0}
    batch = [first] + [queue[i] for i in sorted(chosen)]
    queue[:] = [job for i, job in enumerate(queue) if i not in keep]
    return batch


def read_batch(package: OnnxPackage, images: np.ndarray, max_length: int, speculative: bool):
    """One batch through ``package`` (a worker's own): speculatively only when asked and possible."""
    return package.generate(images, max_length, batch_size=len(images), speculative=speculative)


class Scheduler:
    def __init__(self, packages: list[OnnxPackage], max_length: int, max_batch: int = 8, max_wait_s: float = 0.01,
                 max_queue: int = 64, group_by_length: bool = True, metrics: Optional[ServeMetrics] = None):
        self.max_length = max_length
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.group_by_length = group_by_length
        self.metrics = metrics
        self._queue: list[Job] = []
        self._cond = threading.Condition()
        self._draining = False
        self._closed = False
        self._threads = [threading.Thread(target=self._work, args=(p,), name=f"serve-worker-{i}", daemon=True)
                         for i, p in enumerate(packages)]
        self.answered = 0
        for t in self._threads:
            t.start()

    @property
    def workers(self) -> int:
        return len(self._threads)

    def queue_length(self) -> int:
        with self._cond:
            return len(self._queue)

    def submit(self, image: np.ndarray) -> Future:
        """Queue one preprocessed image; its :class:`Reading` arrives in the returned future."""
        job = Job(image, ink_width(image))
        with self._cond:
            if self._draining:
                raise Draining("the server is draining (SIGTERM); no new requests")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"the queue holds serve.max_queue={self.max_queue} images; try again")
            self._queue.append(job)
            self._set_queue_gauge()
            self._cond.notify()
        return job.future

    def drain(self) -> None:
        """Refuse new images; the queued ones are still read, without waiting for fuller batches."""
        with self._cond:
            self._draining = True
            self._cond.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """Drain, read what is queued, and stop the workers."""
        with self._cond:
            self._draining = self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout)

    def _set_queue_gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_length.set(len(self._queue))

    def _next_batch(self) -> Optional[tuple[list[Job], bool]]:
        """Block until a batch is due; None when closed and empty. Also whether the queue is left empty."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if not self._queue:
                return None
            deadline = self._queue[0].enqueued + self.max_wait_s
            while self._queue and len(self._queue) < self.max_batch and not self._draining:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if not self._queue:  # another worker took them while this one waited
                return [], False
            batch = take_batch(self._queue, self.max_batch, self.group_by_length)
            self._set_queue_gauge()
            return batch, not self._queue

    def _work(self, package: OnnxPackage) -> None:
        while True:
            due = self._next_batch()
            if due is None:
                return
            batch, alone = due
            if batch:
                # a package whose batches decode speculatively (a CPU target) reads every batch so; else
                # only a batch of one taken while nothing else waits
                lone = alone and len(batch) == 1
                self._read(package, batch, speculative=package.speculative and (lone or package.speculative_batches))

    def _read(self, package: OnnxPackage, batch: list[Job], speculative: bool) -> None:
        started = time.monotonic()
        if self.metrics is not None:
            self.metrics.batch_size.observe(len(batch))
            if speculative:
                self.metrics.speculative.inc()
            for job in batch:
                self.metrics.queue_wait.observe(started - job.enqueued)
        try:
            result = read_batch(package, np.stack([job.image for job in batch]), self.max_length, speculative)
        except Exception as exc:  # the requests get the error; the worker goes on
            log.error(f"[serve] a batch of {len(batch)} failed: {type(exc).__name__}: {exc}")
            for job in batch:
                job.future.set_exception(exc)
            return
        for job, text, capped in zip(batch, result.texts, result.hit_cap):
            job.future.set_result(Reading(text, len(batch), speculative, bool(capped)))
        with self._cond:
            self.answered += len(batch)
