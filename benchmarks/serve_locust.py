"""Load test of stage serve with locust: both engines, 1, 4, 16 and 64 concurrent users.

Renders the first ``--formulas`` eval formulas (the corpus artifact's formulas.jsonl), reads them once
with ``stage=infer`` (the reference answers), then for each engine (``--engines``: builtin, ray) starts
``python -m pipeline stage=serve serve.engine=<engine>`` on a free port and runs locust (as a library,
headless, one local runner, ``FastHttpUser``) with each number of users (``--users``) for ``--seconds``
after they are all spawned; every user posts images one after another (no think time), round robin.
Reports p50 / p95 / p99 latency (locust's rounded percentiles), requests/s, failures and answers that
differ from stage=infer's (counted as failures too), as a Markdown table.

    pip install -c constraints.txt 'locust==2.47.0'     # or: pip install -e '.[load]'
    python benchmarks/serve_locust.py artifacts/export-ort_cpu artifacts/corpus/formulas.jsonl \\
        --users 1 4 16 64 --seconds 30 --out artifacts/serve_locust.json

Locust is optional (not a dependency of the pipeline). The SIGTERM-under-load check stays in
``benchmarks/serve_load.py --drain``.
"""
from __future__ import annotations

from gevent import monkey  # locust's own first step; before anything opens a socket

monkey.patch_all()

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import gevent  # noqa: E402
from locust import FastHttpUser, constant, task  # noqa: E402
from locust.env import Environment  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_load  # noqa: E402  (the reference answers and the server process)


class FormulaUser(FastHttpUser):
    """Posts the rendered formulas round robin; an answer other than stage=infer's is a failure."""
    wait_time = constant(0)
    images: list[bytes] = []
    expected: list[str] = []
    mismatches = 0
    _next = itertools.count()

    @task
    def predict(self) -> None:
        i = next(self._next) % len(self.images)
        with self.client.post("/predict", data=self.images[i], headers={"Content-Type": "image/png"},
                              catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}")
            elif resp.json()["latex"] != self.expected[i]:
                FormulaUser.mismatches += 1
                resp.failure("differs from stage=infer")


def run_users(host: str, users: int, seconds: float) -> dict:
    env = Environment(user_classes=[FormulaUser], host=host)
    runner = env.create_local_runner()
    FormulaUser.mismatches = 0
    runner.start(users, spawn_rate=users)
    while runner.user_count < users:
        gevent.sleep(0.1)
    gevent.sleep(1.0)  # every user has a request in flight
    env.stats.reset_all()
    mismatches0 = FormulaUser.mismatches
    gevent.sleep(seconds)
    total = env.stats.total
    row = {"users": users, "requests": total.num_requests, "failures": total.num_failures,
           "differ": FormulaUser.mismatches - mismatches0, "rps": total.num_requests / seconds,
           "p50_ms": total.get_response_time_percentile(0.5), "p95_ms": total.get_response_time_percentile(0.95),
           "p99_ms": total.get_response_time_percentile(0.99),
           "errors": {str(k): v.occurrences for k, v in env.stats.errors.items()}}
    runner.quit()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("package", help="exported package folder")
    ap.add_argument("corpus", type=Path, help="the corpus artifact's formulas.jsonl (its eval split is read)")
    ap.add_argument("--formulas", type=int, default=64)
    ap.add_argument("--engines", nargs="+", default=["builtin", "ray"], choices=["builtin", "ray"])
    ap.add_argument("--users", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--seconds", type=float, default=30, help="measured seconds per user count")
    ap.add_argument("--serve", nargs="*", default=[], help="serve.* overrides for both engines")
    ap.add_argument("--speculative", action="store_true", help="serve and infer with the package's drafter")
    ap.add_argument("--out", type=Path, default=None, help="the results as JSON")
    args = ap.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="serve-locust-"))
    _, images = serve_load.eval_images(args.corpus, args.formulas)
    spec = str(args.speculative).lower()
    FormulaUser.images = images
    FormulaUser.expected = serve_load.infer_answers(args.package, images, workdir / "images", args.speculative)
    print(f"[serve_locust] {len(images)} eval formulas; stage=infer's answers read (speculative={spec})", flush=True)
    results = []
    for engine in args.engines:
        server = serve_load.Server(args.package, [f"serve.engine={engine}", f"serve.speculative={spec}", *args.serve],
                                   workdir / f"artifacts-{engine}")
        print(f"[serve_locust] {engine}: {server.banner}", flush=True)
        try:
            for users in args.users:
                row = {"engine": engine, **run_users(f"http://{server.host}:{server.port}", users, args.seconds)}
                results.append(row)
                print(f"[serve_locust] {engine} {users:3d} users: {row['requests']} requests, p50 {row['p50_ms']:.0f} "
                      f"p95 {row['p95_ms']:.0f} p99 {row['p99_ms']:.0f} ms, {row['rps']:.2f} req/s, "
                      f"{row['failures']} failures ({row['differ']} differ)", flush=True)
        finally:
            code = server.stop()
        print(f"[serve_locust] {engine}: SIGTERM, exit code {code}", flush=True)
    print("\n| engine | users | requests | p50 ms | p95 ms | p99 ms | requests/s | failures | differ from stage=infer |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['engine']} | {r['users']} | {r['requests']} | {r['p50_ms']:.0f} | {r['p95_ms']:.0f} | "
              f"{r['p99_ms']:.0f} | {r['rps']:.2f} | {r['failures']} | {r['differ']} |")
    if args.out:
        args.out.write_text(json.dumps({"package": args.package, "formulas": len(images), "seconds": args.seconds,
                                        "results": results}, indent=2) + "\n")
    return 1 if any(r["failures"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
