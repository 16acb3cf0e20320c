"""Cached encode time and Zipf replay hit rate of a trained formula tokenizer (prints numbers only).

    python -m pipeline stage=tokenizer artifacts.dir=artifacts        # trains artifacts/tokenizer/
    python benchmarks/tokenizer_cache.py artifacts                    # replays the corpus eval split

The workload: ``--requests`` formulas drawn from the eval formulas with P(rank k) ~ 1/k^s over a
seeded random ranking, each in one of 4 spellings (as is, ``$..$``, ``\\[..\\]``, doubled spaces),
through the serving ``CachedEncoder`` (LRU keyed by the normalized formula) and, for contrast, the
same cache keyed by the raw string. Timings are wall clock per request, best of ``--repeats`` runs
(the CPU is shared); uncached encode times are given beside them. Targets from issue 4: cached
encode <= 0.05 ms per formula, hit rate >= 95 %.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenizers import Tokenizer  # noqa: E402

from pipeline.tokenization.compare import replay, zipf_workload  # noqa: E402


def eval_formulas(args) -> tuple[list[str], str]:
    if args.formulas:
        lines = [ln.strip() for ln in Path(args.formulas).read_text(encoding="utf-8").splitlines()]
        return [ln for ln in lines if ln], f"file {args.formulas}"
    corpus = args.artifacts / "corpus" / "formulas.jsonl"
    if not corpus.is_file():
        sys.exit(f"error: no corpus at {corpus}; run a stage first or pass --formulas FILE")
    rows = [json.loads(ln) for ln in corpus.read_text(encoding="utf-8").splitlines() if ln.strip()]
    return [r["latex"] for r in rows if r["split"] == args.split], f"corpus split '{args.split}'"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", type=Path, nargs="?", default=Path("artifacts"))
    ap.add_argument("--tokenizer", type=Path, help="tokenizer.json (default: ARTIFACTS/tokenizer/tokenizer.json)")
    ap.add_argument("--formulas", help="one formula per line instead of the corpus split")
    ap.add_argument("--split", default="eval")
    ap.add_argument("--requests", type=int, default=50000)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--capacity", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    path = args.tokenizer or args.artifacts / "tokenizer" / "tokenizer.json"
    if not path.is_file():
        sys.exit(f"error: no tokenizer at {path}; run: python -m pipeline stage=tokenizer artifacts.dir={args.artifacts}")
    tok = Tokenizer.from_file(str(path))
    formulas, source = eval_formulas(args)
    workload = zipf_workload(formulas, args.requests, args.zipf, args.seed)
    print(f"tokenizer {path} ({tok.get_vocab_size()} entries); {len(formulas)} formulas from {source}")
    print(f"workload: {args.requests} requests, zipf s={args.zipf}, seed {args.seed}, "
          f"{len(set(workload))} distinct request strings; cache capacity {args.capacity}; best of {args.repeats}")
    for key in ("normalized", "raw"):
        runs = [replay(tok, workload, args.capacity, key=key) for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["ms_per_request"])
        print(f"cache key {key:10s}: hit rate {best['hit_rate']:.2%} ({best['hits']} hits, {best['misses']} misses, "
              f"{best['evictions']} evictions); {best['ms_per_request']:.4f} ms/request, "
              f"{min(r['ms_per_hit'] for r in runs):.4f} ms/hit")
    uniq = sorted(set(formulas))
    single = min(_seconds(lambda: [tok.encode(x) for x in uniq]) for _ in range(args.repeats))
    batched = min(_seconds(lambda: tok.encode_batch(uniq)) for _ in range(args.repeats))
    print(f"uncached encode: {1000 * single / len(uniq):.4f} ms/formula single, "
          f"{1000 * batched / len(uniq):.4f} ms/formula batched ({len(uniq)} formulas)")


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
