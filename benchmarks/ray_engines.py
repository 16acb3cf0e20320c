"""The Ray engines against the builtin ones on a package: the same readings, and how fast.

1. Renders the first ``--formulas`` formulas of ``--split`` (eval) into a folder, reads it with ``stage=infer``
   (``infer.batch_size=8``) and with ``stage=infer infer.engine=ray`` (``--actors`` actors x
   ``--threads`` threads), each as its own command; reports both commands' wall time, the stage's own
   reading time (the ``[infer] ... in X s`` line) and images/s, and the readings that differ.
2. Starts ``stage=serve serve.engine=ray``, posts ``--posted`` of the images at once, checks every
   answer equals stage=infer's, that a non-image is refused with a 4xx, and that SIGTERM exits 0.

    python benchmarks/ray_engines.py artifacts/export-ort_cpu artifacts/corpus/formulas.jsonl --formulas 200
"""
from __future__ import annotations

import argparse
import http.client
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_load  # noqa: E402  (eval images, the server process)

REPO = serve_load.REPO


def infer(package: str, folder: Path, out: Path, extra: list[str]) -> tuple[float, float, str]:
    """One ``stage=infer`` command: its wall seconds, the stage's own reading seconds, its stderr."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pipeline", "stage=infer", f"infer.package={package}",
                           f"infer.image={folder}", f"infer.output={out}", f"artifacts.dir={folder / 'artifacts'}",
                           "progress=false", *extra], cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"stage=infer {extra} failed: {proc.stderr.strip().splitlines()[-3:]}")
    found = re.search(r"\[infer\] \d+ (?:image|path)\(s\) in ([\d.]+) s", proc.stderr + proc.stdout)
    return wall, float(found.group(1)) if found else float("nan"), proc.stdout


def post(host: str, port: int, data: bytes, ctype: str = "image/png") -> tuple[int, dict]:
    conn = http.client.HTTPConnection(host, port, timeout=600)
    try:
        conn.request("POST", "/predict", body=data, headers={"Content-Type": ctype})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("package")
    ap.add_argument("corpus", type=Path)
    ap.add_argument("--formulas", type=int, default=200)
    ap.add_argument("--split", default="eval", help="the corpus split rendered (eval: 574 formulas; train: more)")
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--posted", type=int, default=8, help="images posted at once to serve.engine=ray")
    ap.add_argument("--greedy", action="store_true", help="both engines plain greedy (infer.speculative=false): "
                    "a package with a drafter otherwise reads image by image")
    ap.add_argument("--no-serve", dest="serve", action="store_false", help="only the infer comparison")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="ray-engines-"))
    folder = work / "images"
    folder.mkdir()
    _, images = serve_load.eval_images(args.corpus, args.formulas, args.split)
    for i, data in enumerate(images):
        (folder / f"{i:05d}.png").write_bytes(data)
    n = len(images)
    how = ["infer.batch_size=8", f"infer.speculative={str(not args.greedy).lower()}"]
    builtin = infer(args.package, folder, work / "builtin.tsv", how)
    ray = infer(args.package, folder, work / "ray.jsonl", ["infer.engine=ray", *how, f"infer.actors={args.actors}",
                                                          f"infer.threads={args.threads}"])
    expected = dict(line.split("\t", 1) for line in (work / "builtin.tsv").read_text(encoding="utf-8").splitlines())
    rows = [json.loads(line) for line in (work / "ray.jsonl").read_text(encoding="utf-8").splitlines()]
    differ = sum(expected.get(Path(r["path"]).name) != r["latex"] for r in rows)
    print(f"| engine | images | command s | reading s | images/s (command) | images/s (reading) | differ |")
    print("|---|---|---|---|---|---|---|")
    for name, (wall, reading, _) in (("builtin, batch 8", builtin), (f"ray, {args.actors} actors x {args.threads}", ray)):
        print(f"| {name} | {n} | {wall:.1f} | {reading:.1f} | {n / wall:.2f} | {n / reading:.2f} | "
              f"{differ if name.startswith('ray') else '-'} |")
    print(f"ray / builtin images/s: command {builtin[0] / ray[0]:.2f}x, reading {builtin[1] / ray[1]:.2f}x", flush=True)
    if not args.serve:
        return 0 if differ == 0 else 1

    server = serve_load.Server(args.package, ["serve.engine=ray", f"serve.max_batch={args.posted}",
                                              "serve.max_wait_ms=200"], work / "serve-artifacts")
    try:
        posted = images[:args.posted]
        got = [None] * len(posted)
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, post(server.host, server.port, posted[i])))
                   for i in range(len(posted))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        same = sum(s == 200 and b["latex"] == expected[f"{i:05d}.png"] for i, (s, b) in enumerate(got))
        batches = sorted(b.get("batch") for _, b in got)
        hostile = post(server.host, server.port, b"this is not an image")[0]
    finally:
        code = server.stop()
    print(f"serve.engine=ray: {same} of {len(posted)} posted at once read as stage=infer (batches {batches}); "
          f"a non-image: HTTP {hostile}; SIGTERM: exit code {code}")
    return 0 if differ == 0 and same == len(posted) and 400 <= hostile < 500 and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
