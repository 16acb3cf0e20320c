"""Load test of stage serve: a real server process on localhost, concurrent clients, eval formulas.

The load test proper is now ``benchmarks/serve_locust.py`` (locust, both engines); this hand-written
client stays for SIGTERM under load (``--drain``) and as the server helper the tests use (:class:`Server`).

Renders the first ``--formulas`` formulas of the eval split (the corpus artifact's formulas.jsonl)
to PNG, reads them once with ``stage=infer`` (the reference answers), then for each server setting
(batched: the stage's defaults or the given overrides; ``--baseline``: one worker, ``max_batch=1``)
starts ``python -m pipeline stage=serve`` on a free port and runs 1, 4 and 16 concurrent clients
(``--clients``), each sending ``--requests`` requests one after another over a kept-alive
connection. Reports p50 / p95 / p99 latency, requests/s, errors and answers that differ from
stage=infer's, and the batched / baseline requests/s ratio at each client count. Last, with
``--drain``, SIGTERM under load: the batched server is signalled while 16 clients keep sending
(a new connection a request); every request it accepted must be answered and it must exit 0.

    python benchmarks/serve_load.py artifacts/export-ort_cpu artifacts/corpus/formulas.jsonl \
        --formulas 64 --clients 1 4 16 --requests 16 --drain --out artifacts/serve_load.json

Serving and infer both read plain greedy (``serve.speculative=false``, ``infer.speculative=false``)
unless ``--speculative``: a package's speculative readings can differ from its greedy ones where
its verify graph's numbers differ from its step graph's (docs/serve.md).
"""
from __future__ import annotations

import argparse
import http.client
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

READY = "serving http://"


def eval_images(corpus: Path, n: int, split: str = "eval") -> tuple[list[str], list[bytes]]:
    """The first ``n`` renderable formulas of ``split``, as PNG bytes."""
    from pipeline.data.render import RenderError, render_formula

    formulas, images = [], []
    for line in corpus.read_text(encoding="utf-8").splitlines():
        if len(images) == n:
            break
        row = json.loads(line) if line.strip() else {}
        if row.get("split") != split:
            continue
        try:
            image = render_formula(row["latex"])
        except RenderError:
            continue
        buf = io.BytesIO()
        image.save(buf, "PNG")
        formulas.append(row["latex"])
        images.append(buf.getvalue())
    if not images:
        raise SystemExit(f"no renderable {split} formula in {corpus}")
    return formulas, images


def infer_answers(package: str, images: list[bytes], folder: Path, speculative: bool) -> list[str]:
    """stage=infer's reading of every image (the reference answers)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, data in enumerate(images):
        (folder / f"{i:05d}.png").write_bytes(data)
    out = folder / "infer.tsv"
    proc = subprocess.run([sys.executable, "-m", "pipeline", "stage=infer", f"infer.package={package}",
                           f"infer.image={folder}", f"infer.output={out}", f"infer.speculative={str(speculative).lower()}",
                           f"artifacts.dir={folder / 'artifacts'}", "progress=false"],
                          cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"stage=infer failed: {proc.stderr.strip().splitlines()[-1:]}")
    rows = dict(line.split("\t", 1) for line in out.read_text(encoding="utf-8").splitlines())
    return [rows[f"{i:05d}.png"] for i in range(len(images))]


class Server:
    """``python -m pipeline stage=serve`` on a free port, until :meth:`stop` (SIGTERM)."""

    def __init__(self, package: str, overrides: list[str], artifacts: Path, timeout: float = 300):
        cmd = [sys.executable, "-m", "pipeline", "stage=serve", f"serve.package={package}", "serve.port=0",
               f"artifacts.dir={artifacts}", "progress=false", *overrides]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.err: list[str] = []
        ready = threading.Event()

        def pump(stream, into, watch):
            for line in stream:
                into.append(line.rstrip("\n"))
                if watch and line.startswith(READY):
                    ready.set()
            ready.set()  # the stream ended: started or failed

        threading.Thread(target=pump, args=(self.proc.stdout, self.lines, True), daemon=True).start()
        threading.Thread(target=pump, args=(self.proc.stderr, self.err, False), daemon=True).start()
        ready.wait(timeout)
        ready_line = next((ln for ln in self.lines if ln.startswith(READY)), None)
        if ready_line is None:
            self.proc.kill()
            raise RuntimeError(f"the server did not start: {' | '.join(self.err[-3:])}")
        self.banner = ready_line
        address = ready_line[len(READY):].split()[0]
        self.host, port = address.rsplit(":", 1)
        self.port = int(port)

    def stop(self, timeout: float = 120) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def post(conn: http.client.HTTPConnection, image: bytes, close: bool = False) -> tuple[int, dict]:
    headers = {"Content-Type": "image/png"}
    if close:
        headers["Connection"] = "close"
    conn.request("POST", "/predict", body=image, headers=headers)
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read() or b"{}")


def load(server: Server, images: list[bytes], expected: list[str], clients: int, requests: int) -> dict:
    """``clients`` threads, ``requests`` requests each over one kept-alive connection."""
    latencies, errors, mismatches = [], [], []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def client(k: int) -> None:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=300)
        start.wait()
        for j in range(requests):
            i = (k * requests + j) % len(images)
            t0 = time.perf_counter()
            try:
                status, body = post(conn, images[i])
            except (OSError, http.client.HTTPException) as exc:
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")
                conn.close()
                conn = http.client.HTTPConnection(server.host, server.port, timeout=300)
                continue
            ms = 1000 * (time.perf_counter() - t0)
            with lock:
                if status != 200:
                    errors.append(f"HTTP {status}: {body.get('error')}")
                    continue
                latencies.append(ms)
                if body["latex"] != expected[i]:
                    mismatches.append(i)
        conn.close()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    lat = np.asarray(latencies or [float("nan")])
    return {"clients": clients, "requests": clients * requests, "answered": len(latencies), "errors": len(errors),
            "error_samples": errors[:5], "mismatches": len(mismatches), "mismatched_images": sorted(set(mismatches)),
            "seconds": seconds, "rps": len(latencies) / seconds, "p50_ms": float(np.percentile(lat, 50)),
            "p95_ms": float(np.percentile(lat, 95)), "p99_ms": float(np.percentile(lat, 99)),
            "mean_ms": float(lat.mean())}


def drain_under_load(server: Server, images: list[bytes], expected: list[str], clients: int = 16,
                     after_s: float = 2.0) -> dict:
    """SIGTERM while ``clients`` clients send (a new connection a request, so a refused connection is
    told apart from an accepted request): accepted requests must all be answered, the exit code 0."""
    outcome = {"answered": 0, "refused_503": 0, "refused_connect": 0, "unanswered": 0, "mismatches": 0}
    samples: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client(k: int) -> None:
        j = 0
        while not stop.is_set():
            i = (k + clients * j) % len(images)
            j += 1
            conn = http.client.HTTPConnection(server.host, server.port, timeout=300)
            try:
                conn.connect()
            except ConnectionRefusedError:
                with lock:
                    outcome["refused_connect"] += 1
                return  # the listener is closed: the server is draining
            try:
                status, body = post(conn, images[i], close=True)
            except (OSError, http.client.HTTPException) as exc:
                with lock:
                    outcome["unanswered"] += 1
                    samples.append(f"{type(exc).__name__}: {exc}")
                return
            finally:
                conn.close()
            with lock:
                if status == 200:
                    outcome["answered"] += 1
                    outcome["mismatches"] += body["latex"] != expected[i]
                elif status == 503:
                    outcome["refused_503"] += 1
                else:
                    outcome["unanswered"] += 1
                    samples.append(f"HTTP {status}: {body.get('error')}")
            if status == 503:
                return

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    time.sleep(after_s)
    code = server.stop()
    stop.set()
    for t in threads:
        t.join(60)
    return {**outcome, "exit_code": code, "samples": samples[:5]}


def run_setting(name: str, package: str, overrides: list[str], images, expected, args, workdir: Path,
                drain: bool) -> dict:
    server = Server(package, overrides, workdir / f"artifacts-{name}")
    print(f"[serve_load] {name}: {server.banner}", flush=True)
    for data in images[:2]:  # warm-up: the first calls of each session allocate
        conn = http.client.HTTPConnection(server.host, server.port, timeout=300)
        post(conn, data)
        conn.close()
    rows = []
    for clients in args.clients:
        row = load(server, images, expected, clients, args.requests)
        rows.append(row)
        print(f"[serve_load] {name} {clients:3d} clients: {row['answered']}/{row['requests']} answered, "
              f"p50 {row['p50_ms']:.0f} p95 {row['p95_ms']:.0f} p99 {row['p99_ms']:.0f} ms, "
              f"{row['rps']:.2f} req/s, {row['errors']} errors, {row['mismatches']} differ from stage=infer", flush=True)
    result = {"setting": name, "overrides": overrides, "banner": server.banner, "rows": rows}
    if drain:
        result["drain"] = drain_under_load(server, images, expected)
        d = result["drain"]
        print(f"[serve_load] {name} SIGTERM under load: {d['answered']} answered, {d['refused_503']} refused 503, "
              f"{d['refused_connect']} refused at connect, {d['unanswered']} unanswered, exit code {d['exit_code']}",
              flush=True)
    else:
        result["exit_code"] = server.stop()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("package", help="exported package folder")
    ap.add_argument("corpus", type=Path, help="the corpus artifact's formulas.jsonl (its eval split is read)")
    ap.add_argument("--formulas", type=int, default=64, help="eval formulas rendered (requests cycle through them)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=16, help="requests each client sends")
    ap.add_argument("--serve", nargs="*", default=[], help="serve.* overrides of the batched setting")
    ap.add_argument("--no-baseline", dest="baseline", action="store_false",
                    help="skip the single-worker max_batch=1 setting")
    ap.add_argument("--drain", action="store_true", help="end with SIGTERM under load (batched setting)")
    ap.add_argument("--speculative", action="store_true", help="serve and infer with the package's drafter")
    ap.add_argument("--out", type=Path, default=None, help="the results as JSON")
    args = ap.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="serve-load-"))
    formulas, images = eval_images(args.corpus, args.formulas)
    spec = str(args.speculative).lower()
    expected = infer_answers(args.package, images, workdir / "images", args.speculative)
    print(f"[serve_load] {len(images)} eval formulas rendered; stage=infer's answers read "
          f"(speculative={spec})", flush=True)
    settings = [("batched", [f"serve.speculative={spec}", *args.serve], args.drain)]
    if args.baseline:
        settings.append(("baseline", [f"serve.speculative={spec}", "serve.workers=1", "serve.max_batch=1"], False))
    results = [run_setting(name, args.package, overrides, images, expected, args, workdir, drain)
               for name, overrides, drain in settings]
    print("\n| setting | clients | requests | p50 ms | p95 ms | p99 ms | req/s | errors | differ from infer |")
    print("|---|---|---|---|---|---|---|---|---|")
    for res in results:
        for r in res["rows"]:
            print(f"| {res['setting']} | {r['clients']} | {r['requests']} | {r['p50_ms']:.0f} | {r['p95_ms']:.0f} | "
                  f"{r['p99_ms']:.0f} | {r['rps']:.2f} | {r['errors']} | {r['mismatches']} |")
    ratios = {}
    if args.baseline:
        base = {r["clients"]: r["rps"] for r in results[1]["rows"]}
        ratios = {c: r["rps"] / base[c] for r in results[0]["rows"] for c in [r["clients"]] if base.get(c)}
        print("\nbatched / baseline requests/s: " + ", ".join(f"{c} clients {x:.2f}x" for c, x in ratios.items()))
    if args.out:
        args.out.write_text(json.dumps({"package": args.package, "formulas": len(images), "results": results,
                                        "ratios": ratios}, indent=2) + "\n")
    failed = any(r["errors"] or r["mismatches"] for res in results for r in res["rows"])
    if args.drain:
        d = results[0]["drain"]
        failed |= bool(d["unanswered"] or d["exit_code"] != 0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
