"""Choose speculative decoding's drafter settings on train / calib data, for one package.

The package reads train formulas (the drafters are built from those readings, as stage export
builds them) and calib formulas (where the settings are judged) with plain greedy. Its
``decoder_verify`` graph is timed for every width T (the last written token + T - 1 drafts) at batch
1, one thread. Then each drafter (ngram per order and min count, bpe when a tokenizer file is given)
and draft length k is run through the real speculative loop (``pipeline/decoding.py``) against the
calib readings themselves (the decoder replaced by the known reading: exact for calls and widths),
and its decoder milliseconds per formula estimated from the timed widths and the timed ``decoder_first`` call
(plain greedy's: that call and a timed step a token). Prints the table, best
first. With ``--check eval shift`` (and the shift split's file among the formulas files) the best
setting of each drafter kind on calib is then run on those splits too (exact calls, estimated
milliseconds): a check of the choice, never an input to it (the benchmark stage measures the
package's own drafter there).

``--student-bound`` adds what a perfect student drafter (``export.drafter=student``) could do with the
best ngram setting: its guide is the reading itself, display wrapper stripped as the student's BPE
strips it ("student bound"), or whole ("student bound, wrapper kept"). The package's calls and
milliseconds it prints leave out the student's own reading (a decoder of the same size, a few BPE steps
and its first call a formula): a student pays only where that costs less than the milliseconds the
bound saves against the ngram drafter.

    python benchmarks/speculative.py artifacts/export-ort_cpu artifacts/corpus/formulas.jsonl \
        artifacts/corpus-shift/formulas.jsonl --train 256 --calib 256 --orders 4 6 8 12 \
        --min-counts 1 2 3 --draft-lens 2 4 6 8 --bpe artifacts/tokenizer/tokenizer.json --check eval shift
    python benchmarks/speculative.py ... --train 1779 --orders 12 --min-counts 2 --self-lookups 3 \
        --min-confidences 0.7 --tails 0 1 2 --draft-lens 8     (the tail; on a GPU package: its provider's widths)
    python benchmarks/speculative.py ... --train 1779 --calib 597 --varied 0 1000 3000 --ship-calib \
        --cache /tmp/readings.json     (more readings to draft from: the varied grammar's, the calib split's)

``--time N`` times the real loops on N formulas of calib and of each checked split (the package's sessions,
batch 1): plain greedy, the best ngram setting, and a perfect drafter that proposes the package's own greedy
reading: the most any drafter can save on this machine, measured.

``--varied N``: tables built from the train readings plus the package's readings of N formulas of the varied
grammar (``pipeline/data/templates.py``), judged on calib like any setting; ``--ship-calib``: the checks also
run the best ngram setting built from the train and calib readings (calib cannot judge that one). The
readings are the package's plain greedy ones, one single-thread session a core side by side (``--cache``
keeps them for the next run).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline import drafting  # noqa: E402
from pipeline.decoding import SpeculativeStats, speculative_greedy  # noqa: E402
from pipeline.export.drafter import bpe_pieces, read, token_texts  # noqa: E402
from pipeline.export.runtime import OnnxPackage  # noqa: E402


def widths_cost(package: OnnxPackage, max_width: int, past_len: int = 40, repeat: int = 100) -> dict[int, float]:
    """Milliseconds of one ``decoder_verify`` call per width T, at batch 1 after ``past_len`` tokens."""
    memory = package.encode(np.ones((1, *package.meta["input_shape"]), np.float32))
    _, past, cross = package.first(np.asarray([[package.bos] + [package.eos] * (past_len - 1)]), memory)
    out = {}
    for width in range(1, max_width + 1):
        ids = np.full((1, width), package.eos, dtype=np.int64)
        package.verify(ids, past, cross)
        t0 = time.perf_counter()
        for _ in range(repeat):
            package.verify(ids, past, cross)
        out[width] = 1000 * (time.perf_counter() - t0) / repeat
    return out


def calls_cost(package: OnnxPackage, past_len: int = 40, repeat: int = 100) -> tuple[float, float]:
    """Milliseconds of one ``decoder_first`` call (BOS: the cross-attention K/V of the image's memory are
    computed there, several steps' worth) and of one ``decoder_step`` call after ``past_len`` tokens, batch 1."""
    memory = package.encode(np.ones((1, *package.meta["input_shape"]), np.float32))
    bos = np.full((1, 1), package.bos, dtype=np.int64)
    _, past, cross = package.first(np.asarray([[package.bos] + [package.eos] * (past_len - 1)]), memory)
    ids = np.full((1, 1), package.eos, dtype=np.int64)
    out = []
    for call in (lambda: package.first(bos, memory), lambda: package.step(ids, past, cross)):
        call()
        t0 = time.perf_counter()
        for _ in range(repeat):
            call()
        out.append(1000 * (time.perf_counter() - t0) / repeat)
    return out[0], out[1]


def simulate(propose, reading: list[int], bos: int, eos: int, draft_len: int, max_length: int,
             vocab: int, min_drafts: int = 0) -> list[int]:
    """The widths of the verify calls speculative decoding makes for ``reading`` (the decoder's
    greedy tokens), through the real loop with a decoder that writes the reading (``min_drafts``: the
    package's free drafts, :attr:`OnnxPackage.free_drafts`)."""
    widths: list[int] = []

    def logits_at(position: int) -> np.ndarray:
        row = np.zeros(vocab, np.float32)
        row[reading[position] if position < len(reading) else eos] = 1.0
        return row

    def first(ids):
        return logits_at(0)[None], [np.zeros((1, 1, 1, 1), np.float32)], []

    def verify(ids, past, cross):
        start = past[0].shape[2]  # tokens fed so far (BOS first): the next written token's position
        widths.append(ids.shape[1])
        rows = [logits_at(start + j) for j in range(ids.shape[1])]
        return np.stack(rows)[None], [np.zeros((1, 1, start + ids.shape[1], 1), np.float32)]

    got = speculative_greedy(first, verify, propose, bos, eos, [], max_length, draft_len, min_drafts=min_drafts)
    assert got == reading[:len(got)], "the loop must write the reading"
    return widths


def timed(package: OnnxPackage, images: np.ndarray, drafter, draft_len: int, max_length: int,
          repeats: int = 3) -> dict:
    """Decoder milliseconds a formula (the first call included, the encoder not) through the package's real
    loops, timed: plain greedy on the step graph, speculative with ``drafter`` and speculative with a perfect
    drafter (it proposes the package's own greedy reading of the image: what no drafter can beat), in
    rotating order ``repeats`` times over ``images`` (batch 1, the package's threads). Also the calls a formula."""
    guard = package.layout_guard(package._vocab()) if package.layout_run_cap else None
    memories = [package.encode(images[i:i + 1]) for i in range(images.shape[0])]
    readings = [package.greedy_from_memory(m, max_length)[0] for m in memories]
    shown: list[list[int]] = [[]]

    def perfect(ids, k, at_least=0):
        return shown[0][len(ids) - 1:len(ids) - 1 + k]

    def decode(how: str, memory: np.ndarray, reading: list[int], stats: SpeculativeStats) -> None:
        if how == "greedy":  # a call a token written
            stats.calls += len(package.greedy_from_memory(memory, max_length)[0])
            return
        shown[0] = reading
        propose = perfect if how == "perfect" else drafter.propose
        speculative_greedy(lambda ids: package.first(ids, memory), package.verify, propose, package.bos, package.eos,
                           package.banned, max_length, draft_len, guard, stats, package.free_drafts)

    hows = ("greedy", "drafter", "perfect")
    ms = {h: [] for h in hows}
    calls = {}
    for rep in range(repeats):
        for how in hows[rep % 3:] + hows[:rep % 3]:
            stats = SpeculativeStats()
            t0 = time.perf_counter()
            for memory, reading in zip(memories, readings):
                decode(how, memory, reading, stats)
            ms[how].append(1000 * (time.perf_counter() - t0) / len(memories))
            calls[how] = stats.calls / len(memories)
    out = {"n": len(memories), "repeats": repeats}
    for how in hows:
        mean = float(np.mean(ms[how]))
        out[how] = {"decoder_ms": mean, "ms_ratio": float(np.mean(ms["greedy"])) / mean,
                    "calls_per_formula": calls[how], "calls_ratio": calls["greedy"] / calls[how]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("package", type=Path)
    ap.add_argument("formulas", type=Path, nargs="+",
                    help="the corpus artifact's formulas.jsonl (train and calib splits; the shift split's file too "
                         "for --check shift)")
    ap.add_argument("--train", type=int, default=256)
    ap.add_argument("--calib", type=int, default=256)
    ap.add_argument("--orders", type=int, nargs="+", default=[4, 6, 8, 12])
    ap.add_argument("--min-counts", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--self-lookups", type=int, nargs="+", default=[0],
                    help="the ngram drafter's self_lookup settings (0: off; n: the reading's own contexts of n+ tokens)")
    ap.add_argument("--min-confidences", type=float, nargs="+", default=[0.0],
                    help="the ngram drafter's min_confidence settings (0: drafts of k tokens whenever it can)")
    ap.add_argument("--tails", type=int, nargs="+", default=[0],
                    help="the ngram drafter's tail settings (guesses after the confident drafts)")
    ap.add_argument("--draft-lens", type=int, nargs="+", default=[2, 4, 6, 8])
    ap.add_argument("--check", nargs="*", default=[], help="splits the best setting of each kind is checked on")
    ap.add_argument("--check-limit", type=int, default=None, help="formulas per checked split (default: all)")
    ap.add_argument("--bpe", type=Path, default=None, help="stage tokenizer's tokenizer.json: also the bpe drafter")
    ap.add_argument("--student-bound", action="store_true",
                    help="also a perfect student's guide (the reading itself) with the best ngram setting")
    ap.add_argument("--varied", type=int, nargs="+", default=[0],
                    help="tables built from the train readings plus the package's readings of this many formulas of "
                         "the varied grammar (pipeline/data/templates.py; 0: train alone)")
    ap.add_argument("--ship-calib", action="store_true",
                    help="the checks also run the best ngram setting built from the train and calib readings")
    ap.add_argument("--cache", type=Path, default=None,
                    help="a JSON file the readings are kept in (by split and formula), reused by the next run")
    ap.add_argument("--time", type=int, default=0, metavar="N",
                    help="also time the real loops on N formulas of calib and of each --check split: plain greedy, "
                         "the best ngram setting and a perfect drafter (the package's own reading: the most any "
                         "drafter can save on this machine)")
    ap.add_argument("--max-length", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="the table as JSON")
    args = ap.parse_args(argv)

    from pipeline.data.render import render_inputs

    package = OnnxPackage(args.package, threads=1, speculative=False)
    max_length = int(args.max_length or package.max_length)
    if max(args.draft_lens) > package.verify_width - 1:
        ap.error(f"--draft-lens: at most {package.verify_width - 1} (the verify graph's width - 1)")
    rows = [json.loads(line) for path in args.formulas
            for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    splits = {name: [r["latex"] for r in rows if r["split"] == name][:n]
              for name, n in (("train", args.train), ("calib", args.calib),
                              *((c, args.check_limit) for c in args.check))}
    empty = [name for name, formulas in splits.items() if not formulas]
    if empty:
        ap.error(f"no formulas of split(s) {', '.join(empty)} in {' '.join(map(str, args.formulas))}")
    if max(args.varied) > 0:
        from pipeline.data.templates import varied_formulas

        splits["varied"] = varied_formulas(max(args.varied), seed=0)
    cache = json.loads(args.cache.read_text()) if args.cache and args.cache.is_file() else {}
    known = cache.setdefault(f"{args.package.resolve()} cap {max_length} batch 1", {})
    readings = {}
    for name, formulas in splits.items():
        todo = [f for f in formulas if f"{name}\t{f}" not in known]
        if todo:  # the package's plain greedy readings image by image (as export's drafter reads them), one
            # single-thread session a core side by side
            items = render_inputs([(f, f) for f in todo], package.preprocess, desc=f"render {name}")
            images = np.stack([np.asarray(x[2]) for x in items]).astype(np.float32)
            known.update({f"{name}\t{f}": None for f in todo})  # not rendered: no reading
            for (f, _, _), ids in zip(items, read(args.package, images, max_length, 1, os.cpu_count() or 1)):
                known[f"{name}\t{f}"] = ids
        readings[name] = [known[f"{name}\t{f}"] for f in formulas if known[f"{name}\t{f}"] is not None]
        print(f"[speculative] {name}: {len(readings[name])} readings, {np.mean([len(r) for r in readings[name]]):.1f} tokens "
              f"a formula", flush=True)
    if args.cache:
        args.cache.write_text(json.dumps(cache))
    first_ms, step_ms = calls_cost(package)
    cost = widths_cost(package, max(args.draft_lens) + 1)
    print("[speculative] verify ms by width: " + ", ".join(f"{w}: {c:.2f}" for w, c in cost.items()), flush=True)
    vocab = package._vocab()
    drafters = {}
    settings = {}  # drafter name -> (order, min count, self lookup, confidence, tail, varied)
    for v in args.varied:
        built = readings["train"] + readings.get("varied", [])[:v]
        for o in args.orders:
            for m in args.min_counts:
                counted = drafting.NgramDrafter.build(built, package.bos, o, m)  # counted once per order, min
                for s in (s for s in args.self_lookups if s <= o):
                    for c in args.min_confidences:
                        for t in args.tails:
                            name = (f"ngram order {o} min {m}" + (f" self {s}" if s else "")
                                    + (f" conf {c:g}" if c else "") + (f" tail {t}" if t else "")
                                    + (f" +varied {v}" if v else ""))
                            drafters[name] = drafting.NgramDrafter(o, counted.table, s, counted.shares, c, t)
                            settings[name] = (o, m, s, c, t, v)
    if args.bpe is not None:
        drafters["bpe"] = drafting.BpeDrafter.build(bpe_pieces(args.bpe), token_texts(package))
    def greedy_ms(calls: float) -> float:  # plain greedy: decoder_first, then a step a token
        return first_ms + (calls - 1) * step_ms

    def judge(drafter, k: int, split: str, guide=None) -> dict:
        greedy_calls = float(np.mean([len(r) for r in readings[split]]))
        widths = []
        for r in readings[split]:
            if guide is not None:  # a student drafter: its guide for this reading
                drafter.follow(guide(r))
            widths.append(simulate(drafter.propose, r, package.bos, package.eos, k, max_length, vocab,
                                   package.free_drafts))
        calls = float(np.mean([1 + len(w) for w in widths]))
        ms = float(np.mean([first_ms + sum(cost[x] for x in w) for w in widths]))
        drafted = sum(x - 1 for w in widths for x in w)
        verifies = sum(len(w) for w in widths)
        tokens = sum(len(r) for r in readings[split])
        return {"calls_per_formula": calls, "calls_ratio": greedy_calls / calls,
                "accepted_per_verify": (tokens - len(widths) - verifies) / max(1, verifies),
                "drafted_per_verify": drafted / max(1, verifies), "est_decoder_ms": ms,
                "est_ms_ratio": greedy_ms(greedy_calls) / ms, "greedy_calls": greedy_calls}

    greedy_calls = float(np.mean([len(r) for r in readings["calib"]]))
    table = [{"drafter": name, "draft_len": k, **judge(drafter, k, "calib")}
             for name, drafter in drafters.items() for k in args.draft_lens]
    table.sort(key=lambda r: r["est_decoder_ms"])
    print(f"\ncalib, {len(readings['calib'])} formulas: greedy {greedy_calls:.1f} calls, est. "
          f"{greedy_ms(greedy_calls):.1f} decoder ms a formula (first call {first_ms:.2f} ms, step {step_ms:.2f} ms)")
    print(f"{'drafter':36s} {'k':>3s} {'calls':>7s} {'ratio':>6s} {'est ms':>7s} {'ratio':>6s}")
    for r in table:
        print(f"{r['drafter']:36s} {r['draft_len']:3d} {r['calls_per_formula']:7.1f} {r['calls_ratio']:5.2f}x "
              f"{r['est_decoder_ms']:7.1f} {r['est_ms_ratio']:5.2f}x")
    checks = []
    for kind in sorted({r["drafter"].split()[0] for r in table}):
        best = next(r for r in table if r["drafter"].split()[0] == kind)  # the table is sorted: best first
        for split in args.check:
            checks.append({"drafter": best["drafter"], "draft_len": best["draft_len"], "split": split,
                           "n": len(readings[split]), **judge(drafters[best["drafter"]], best["draft_len"], split)})
    if args.ship_calib and args.check:  # the best ngram setting as a package would ship it: train and calib read
        best = next(r for r in table if r["drafter"] in settings)
        o, m, s, c, t, v = settings[best["drafter"]]
        built = readings["train"] + readings["calib"] + readings.get("varied", [])[:v]
        shipped = drafting.NgramDrafter.build(built, package.bos, o, m, s, c, t)
        for split in args.check:
            checks.append({"drafter": f"{best['drafter']} +calib", "draft_len": best["draft_len"], "split": split,
                           "n": len(readings[split]), **judge(shipped, best["draft_len"], split)})
    if args.student_bound:
        from pipeline.tokenization.atoms import normalize_formula

        best = next(r for r in table if r["drafter"].startswith("ngram"))
        texts = token_texts(package)
        spelled = {t: i for i, t in enumerate(texts) if t}

        def stripped(reading):
            return [spelled[c] for c in normalize_formula(package.tokenizer.decode(reading)) if c in spelled]

        ngram = drafters[best["drafter"]]
        student = drafting.StudentDrafter.from_ngram(ngram, {}, min(2, ngram.order))  # export.student_min_match
        for label, guide in (("student bound", stripped), ("student bound, wrapper kept", lambda r: list(r))):
            for split in ["calib", *args.check]:
                checks.append({"drafter": f"{label} ({best['drafter']})", "draft_len": best["draft_len"],
                               "split": split, "n": len(readings[split]),
                               **judge(student, best["draft_len"], split, guide)})
    timing = None
    if args.time:  # on calib, then on each checked split
        best = next(r for r in table if r["drafter"] in settings)
        timing = {"setting": best["drafter"], "draft_len": best["draft_len"]}
        print(f"\ntimed, {args.time} formulas a split, 3 rounds in rotating order (decoder ms a formula, the first "
              f"call included; {best['drafter']}, k {best['draft_len']}):")
        for split in ["calib", *args.check]:
            items = render_inputs([(f, f) for f in splits[split][:args.time]], package.preprocess,
                                  desc=f"render {split}")
            images = np.stack([np.asarray(x[2]) for x in items]).astype(np.float32)
            timing[split] = timed(package, images, drafters[best["drafter"]], best["draft_len"], max_length)
            for how, label in (("greedy", "plain greedy"), ("drafter", "ngram"), ("perfect", "perfect drafter")):
                r = timing[split][how]
                print(f"{split:6s} n {timing[split]['n']:4d} {label:16s} calls {r['calls_per_formula']:6.1f} "
                      f"({r['calls_ratio']:4.2f}x)  ms {r['decoder_ms']:6.1f} ({r['ms_ratio']:4.2f}x)")
    if checks:
        print(f"\nthe best setting of each kind on calib, checked (calls exact, ms estimated from the timed calls):")
        print(f"{'drafter':36s} {'k':>3s} {'split':>6s} {'n':>5s} {'greedy':>7s} {'calls':>7s} {'ratio':>6s} "
              f"{'acc/call':>8s} {'est ms':>7s} {'ratio':>6s}")
        for r in checks:
            print(f"{r['drafter']:36s} {r['draft_len']:3d} {r['split']:>6s} {r['n']:5d} {r['greedy_calls']:7.1f} "
                  f"{r['calls_per_formula']:7.1f} {r['calls_ratio']:5.2f}x {r['accepted_per_verify']:8.2f} "
                  f"{r['est_decoder_ms']:7.1f} {r['est_ms_ratio']:5.2f}x")
    if args.out:
        args.out.write_text(json.dumps({"first_ms": first_ms, "step_ms": step_ms, "verify_ms": cost,
                                        "greedy_calls": greedy_calls,
                                        "rows": table, "checks": checks, "timed": timing}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
