"""The benchmark's own artifacts: ``benchmark.json`` (its metrics), the readings formula by formula
(``predictions.jsonl``, ``predictions-<split>.jsonl``), the Pareto plot and ``report.md``. (The run's
``summary.md`` across stages is :mod:`.summary`'s.)"""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.benchmarking import summary
from pipeline.benchmarking.passes import SplitReading
from pipeline.reports import markdown_table


def write_artifacts(folder: Path, m: dict, main: SplitReading, other: dict[str, SplitReading], twins: dict,
                    baseline_label: str) -> None:
    """All of them, from the metrics ``m`` and the readings (a greedy twin in ``twins`` shares its
    package's: not written twice)."""
    (folder / "benchmark.json").write_text(json.dumps(m, indent=2) + "\n")
    labels = [v["label"] for v in m["variants"] if v["label"] not in twins]
    write_predictions(folder / "predictions.jsonl", main, labels)
    for name, split in other.items():  # the other splits' readings too: paired comparisons need them
        write_predictions(folder / f"predictions-{name}.jsonl", split, labels)
    summary.pareto_plot(folder / "pareto.png", m["variants"], f"{m['n_formulas']} formulas, {m['threads']} thread(s), "
                                                             f"cap {m['max_length']}: images/s vs exact match")
    write_report(folder, m, baseline_label)


def write_predictions(path: Path, split: SplitReading, labels: list[str]) -> None:
    """One JSON line per formula of ``split``: its truth and the reading of each of ``labels`` that
    read it."""
    with open(path, "w", encoding="utf-8") as f:
        for i, truth in enumerate(split.truths):
            f.write(json.dumps({"truth": truth, **{label: split.reads[label]["texts"][i] for label in labels
                                                   if label in split.reads and i < split.reads[label]["n"]}},
                               ensure_ascii=False) + "\n")


def write_report(folder: Path, m: dict, baseline_label: str) -> None:
    """``report.md``: the table and the Pareto plot, then serving, decoding, speculative decoding,
    where each variant is, where the time went, the notes."""
    lines = _header(m) + _serving(m) + _decoding(m) + _speculative(m, baseline_label) + _locations(m) + _phases(m)
    if m["notes"]:
        lines += ["## Notes", ""] + [f"- {n}" for n in m["notes"]] + [""]
    (folder / "report.md").write_text("\n".join(lines))


def _header(m: dict) -> list[str]:
    return [f"# Benchmark: {len(m['variants'])} variants, same images, one run", "",
            f"{m['n_formulas']} formulas from the {m['source']}, decode cap {m['max_length']} (BOS included), "
            f"{m['threads']} intra-op thread(s) for torch and ONNX Runtime alike. Exact match and CER from one "
            f"batched greedy pass (batch {m['batch_size']}). images/s: the wall time of a batched pass with "
            f"nothing else running (the torch variants' accuracy pass; for the packages, the pass on their first "
            f"images when they read the split side by side: see Notes). Latency: batch 1, {m['latency_images']} images, each read by every variant in turn so "
            f"all see the same load. Identical tokens, and Δ points (exact match minus the reference's on "
            f"the same formulas): vs `{m['reference']}`. Peak RSS: a "
            f"fresh process per variant that loads it and reads one batch (includes the interpreter and "
            f"its libraries). Ratios against `{m['shipped']}`; wall-clock numbers on a shared machine: "
            f"compare ratios within one run.", "", summary.table(m["variants"]), "", "![Pareto](pareto.png)", ""]


def _serving(m: dict) -> list[str]:
    if not m["serving"]:
        return []
    return ["## Serving", "", f"{m['serving']['clients']} concurrent clients (threads) x "
            f"{m['serving']['requests_per_client']} batch-1 requests each against one in-process package "
            "(the threads share its ONNX Runtime sessions):", "", summary.serving_table(m["serving"]), ""]


def _decoding(m: dict) -> list[str]:
    return ["## Decoding", "", f"Batch {m['batch_size']}; finished rows leave the batch. Decoder steps per "
            "formula (EOS included) and the share stopped by the cap from the accuracy pass (n); the encoder's "
            "and decoder's milliseconds per formula from the quiet pass that gives images/s (timed n); the "
            "encoder's at batch 1: the median over the latency reads (the p50 column's reads).", "",
            markdown_table(["variant", "n", "steps / formula", "stopped at cap", "timed n", "encoder ms / formula",
                            "decoder ms / formula", "encoder p50 ms, batch 1"],
                           [[v["label"], v["accuracy_n"], f"{v.get('steps_per_formula', 0):.1f}",
                             f"{v['hit_cap_share']:.3f}", v.get("timed_n", v["accuracy_n"]),
                             f"{v.get('encoder_ms_per_formula', 0):.1f}",
                             f"{v.get('decoder_ms_per_formula', 0):.1f}",
                             f"{v['latency']['encoder_p50_ms']:.1f}" if "encoder_p50_ms" in v["latency"] else "–"]
                            for v in m["variants"]]), ""]


def _speculative(m: dict, baseline_label: str) -> list[str]:
    if not m.get("speculative"):
        return []
    return ["## Speculative decoding", "", "Each package with a drafter reads every split at batch 1 twice, "
            "image by image in turn: speculatively (its drafter proposes, `decoder_verify` checks the drafts "
            "in one call) and plain greedy (`decoder_step`, one call a token). Identical: the share of "
            "formulas whose tokens are the same in both (1 up to near-ties: the verify graph rounds unlike the "
            "step, docs/export.md); identical (verify greedy): the same against greedy decoding on the verify "
            "graph, the arithmetic the loop uses (1 unless the loop is broken). Decoder calls include the "
            "first; decoder ms per formula from the same reads. End to end: a formula's whole reading "
            f"(preprocessed image in, tokens out) at batch 1, mean ms, with `{baseline_label}` (plain greedy) "
            "read in the same turn where it is benchmarked.", "",
            _speculative_calls_table(m["speculative"]), "",
            _speculative_end_to_end_table(m["speculative"], baseline_label), ""]


def _speculative_calls_table(spec: dict) -> str:
    return markdown_table(["package", "drafter", "split", "n", "identical", "identical (verify greedy)",
                           "decoder calls / formula",
                           "greedy calls / formula", "calls ratio", "drafter calls / formula", "accepted / verify call",
                           "decoder ms / formula", "greedy decoder ms", "decoder ms ratio"],
                          [[label, f"{s['drafter']} (k={s['draft_len']})", split, r["n"],
                            f"{r['identical']:.3f}",
                            f"{r['identical_verify_greedy']:.3f}" if "identical_verify_greedy" in r else "–",
                            f"{r['calls_per_formula']:.1f}",
                            f"{r['greedy_calls_per_formula']:.1f}",
                            f"{r['greedy_calls_per_formula'] / max(r['calls_per_formula'], 1e-9):.2f}x",
                            f"{r.get('drafter_calls_per_formula', 0.0):.1f}",
                            f"{r['accepted_per_verify']:.2f}", f"{r['decoder_ms_per_formula']:.1f}",
                            f"{r['greedy_decoder_ms_per_formula']:.1f}",
                            f"{r['greedy_decoder_ms_per_formula'] / max(r['decoder_ms_per_formula'], 1e-9):.2f}x"]
                           for label, s in spec.items() for split, r in s["splits"].items()])


def _speculative_end_to_end_table(spec: dict, baseline_label: str) -> str:
    return markdown_table(["package", "split", "n", "end-to-end ms", "greedy end-to-end ms",
                           f"{baseline_label} ms", f"vs {baseline_label}", "greedy vs " + baseline_label],
                          [[label, split, r["n"], f"{r['ms_per_formula']:.1f}",
                            f"{r['greedy_ms_per_formula']:.1f}",
                            f"{r['baseline_ms_per_formula']:.1f}" if "baseline" in r else "–",
                            f"{r['baseline_ms_per_formula'] / r['ms_per_formula']:.2f}x" if "baseline" in r
                            else "–",
                            f"{r['baseline_ms_per_formula'] / r['greedy_ms_per_formula']:.2f}x"
                            if "baseline" in r else "–"]
                           for label, s in spec.items() for split, r in s["splits"].items()])


def _locations(m: dict) -> list[str]:
    return ["## Where each variant is", "",
            markdown_table(["variant", "kind", "location"], [[v["label"], v["kind"], f"`{v['location']}`"]
                                                              for v in m["variants"]]), ""]


def _phases(m: dict) -> list[str]:
    if not m.get("phase_seconds"):
        return []
    per = ", ".join(f"{v['label']} {v['accuracy_seconds']:.0f} s" for v in m["variants"])
    return ["## Where the time went", "", ", ".join(f"{k} {v:.0f} s" for k, v in m["phase_seconds"].items())
            + f" (accuracy by variant: {per}).", ""]
