"""The server's Prometheus metrics, in a registry of their own (two servers in one process, as in
the tests, never share counters); ``GET /metrics`` renders them in the text format."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# request latency buckets, seconds: a formula reads in ~0.1-1 s on a CPU, longer under load
LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)


class ServeMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, max_batch: int):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("formula_serve_requests", "HTTP requests answered, by path and status code",
                                ["path", "code"], registry=r)
        self.errors = Counter("formula_serve_errors", "Requests refused or failed, by reason", ["reason"], registry=r)
        self.queue_length = Gauge("formula_serve_queue_length", "Images waiting for a worker", registry=r)
        self.in_flight = Gauge("formula_serve_in_flight", "Prediction requests accepted and not yet answered",
                               registry=r)
        self.batch_size = Histogram("formula_serve_batch_size", "Images a worker decoded in one batch",
                                    buckets=tuple(range(1, max_batch + 1)), registry=r)
        self.speculative = Counter("formula_serve_speculative_batches",
                                   "Batches decoded speculatively (a package with a drafter: every batch where its "
                                   "batches decode so, else a batch of one with the queue empty)", registry=r)
        self.latency = Histogram("formula_serve_request_seconds", "POST /predict time, body read to answer",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("formula_serve_queue_wait_seconds", "Time an image waited for its batch",
                                    buckets=LATENCY_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
