"""The benchmark's table, its Pareto plot, and the run summary (``<artifacts>/summary.md`` and
``summary.json``): the table, where each package is, and a link to every stage's report."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Sequence

from matplotlib.ticker import NullFormatter

from pipeline.names import MANIFEST
from pipeline.reports import markdown_table, plt, savefig

SUMMARY_MD = "summary.md"
SUMMARY_JSON = "summary.json"
# the order stage=all makes its artifacts in (the corpus first: the stages read it)
RUN_ORDER = ("corpus", "evaluate", "prune", "tokenizer", "distill", "calibrate", "quantize", "export", "benchmark")

HEADER = ["variant", "exact match", "Δ points", "CER", "n", "identical tokens", "p50 ms", "p95 ms", "images/s (batch 8)",
          "peak RSS MB", "size MB", "speedup p50", "throughput ratio", "size ratio", "tokens kept (mean / p95)"]


def _f(v: Any, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


# the README's results table: these rows of a run's summary.json, in this order (those the run has)
README_ROWS = ("float-original (plain ORT)", "float-original", "deployable")
README_BASE = ("float-original (plain ORT)", "float-original")  # the ratios' base: the first the run has


def readme_table(payload: dict) -> str:
    """The README's results table from a run's ``summary.json``: both splits' exact match and CER, batch-1
    p50 and images/s at batch 8 with their ratio to the plain float original, size, tokens kept; and the
    machine it ran on. Generated, never typed (``benchmarks/readme_table.py`` writes or checks it)."""
    rows = {v["label"]: v for v in payload["variants"]}
    base = next((rows[b] for b in README_BASE if b in rows), None)
    if base is None:
        raise ValueError(f"summary has none of {', '.join(README_BASE)} to take the ratios against")
    out = []
    for label in (r for r in README_ROWS if r in rows):
        v = rows[label]
        shift = v.get("splits", {}).get("shift", {})
        p50, ips = v["latency"]["p50_ms"], v["images_per_s"]
        out.append([f"`{label}`", f"{v['exact_match']:.3f}", f"{v['cer']:.3f}", _f(shift.get("exact_match"), ".3f"),
                    _f(shift.get("cer"), ".3f"), f"{p50:.0f} ({base['latency']['p50_ms'] / p50:.2f}x)",
                    f"{ips:.2f} ({ips / base['images_per_s']:.2f}x)", f"{v['size_mb']:.1f}", _kept(v.get("tokens_kept"))])
    n = base["accuracy_n"]
    shift_n = base.get("splits", {}).get("shift", {}).get("n")
    head = (f"Eval split ({n} formulas), shift split ({shift_n} formulas from packages training never saw); batch 1, "
            f"{payload.get('threads', 1)} thread; on {machine_line(payload.get('machine'))}:")
    return head + "\n\n" + markdown_table(["variant", "exact match (eval)", "CER (eval)", "exact match (shift)",
                                          "CER (shift)", "p50 ms", "images/s (batch 8)", "size MB", "tokens kept"],
                                         out)


def machine() -> dict:
    """The machine a run measures on: its CPU model, cores this process may use, the platform."""
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo", encoding="utf-8")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "cores": cores, "platform": platform.platform()}


def machine_line(m: dict | None) -> str:
    return f"{m['cpu']}, {m['cores']} cores ({m['platform']})" if m else "a machine it did not record"


def _kept(stats: dict | None) -> str:
    """A row's tokens kept per image: "mean / p95", or "all" for an encoder that reads every token."""
    return "all" if not stats else f"{stats['mean']:.0f} / {stats['p95']:.0f}"


def extra_splits(variants: Sequence[dict]) -> list[str]:
    """The other splits some variant was read on, in first-seen order."""
    return list(dict.fromkeys(name for v in variants for name in v.get("splits", {})))


def table_rows(variants: Sequence[dict]) -> list[list[str]]:
    rows = []
    splits = extra_splits(variants)
    for v in variants:
        r = v.get("ratios", {})
        delta = r.get("exact_match_points_vs_reference")
        on = f" (n={v['compared_n']})" if v.get("compared_n") not in (None, v["accuracy_n"]) else ""
        rows.append([v["label"], _f(v["exact_match"], ".3f"), ("–" if delta is None else f"{delta:+.1f}") + on,
                     _f(v["cer"], ".3f"), v["accuracy_n"],
                     _f(v.get("identical_tokens"), ".3f") + (on if v.get("identical_tokens") is not None else ""), _f(v["latency"]["p50_ms"], ".0f"),
                     _f(v["latency"]["p95_ms"], ".0f"), _f(v["images_per_s"], ".2f"),
                     _f(v.get("peak_mb"), ".0f"), _f(v["size_mb"], ".1f"),
                     _f(r.get("speedup_p50"), ".2f") + ("x" if r.get("speedup_p50") is not None else ""),
                     _f(r.get("throughput"), ".2f") + ("x" if r.get("throughput") is not None else ""),
                     _f(r.get("size"), ".2f") + ("x" if r.get("size") is not None else ""), _kept(v.get("tokens_kept"))]
                    + [_f(v.get("splits", {}).get(name, {}).get(key), ".3f") for name in splits
                       for key in ("exact_match", "cer")])
    return rows


def table(variants: Sequence[dict]) -> str:
    splits = extra_splits(variants)
    return markdown_table(HEADER + [f"{what} ({name})" for name in splits for what in ("exact match", "CER")],
                          table_rows(variants))


def serving_table(s: dict) -> str:
    return markdown_table(["variant", "clients x requests", "mean ms", "p50 ms", "p95 ms", "requests/s"], [
        [s["label"], f"{s['clients']} x {s['requests_per_client']}", f"{s['mean_ms']:.0f}", f"{s['p50_ms']:.0f}",
         f"{s['p95_ms']:.0f}", f"{s['requests_per_s']:.2f}"]])


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (higher is better on both)."""
    front = []
    for i, (x, y) in enumerate(points):
        if not any((x2 >= x and y2 >= y) and (x2 > x or y2 > y) for j, (x2, y2) in enumerate(points) if j != i):
            front.append(i)
    return front


def pareto_plot(path: Path, variants: Sequence[dict], title: str) -> None:
    points = [(v["images_per_s"], v["exact_match"]) for v in variants]
    front = set(pareto_front(points))
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, (v, (x, y)) in enumerate(zip(variants, points)):
        ax.scatter([x], [y], s=40, color="#ee6677" if i in front else "#4477aa", zorder=3)
        ax.annotate(f"{v['label']} (n={v['accuracy_n']})", (x, y), textcoords="offset points", xytext=(5, 4),
                    fontsize=8)
    ordered = sorted((points[i] for i in front))
    if len(ordered) > 1:
        ax.plot([p[0] for p in ordered], [p[1] for p in ordered], color="#ee6677", lw=1, zorder=2)
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())  # minor tick labels overlap on a short log axis
    ax.set_xlabel("images/s at batch 8 (log)")
    ax.set_ylabel("exact match")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    savefig(fig, path)


def stage_reports(root: Path) -> list[dict]:
    """Every artifact under ``root`` with a manifest: its stage, folder, report (or manifest) and time."""
    out = []
    for folder in sorted(p for p in Path(root).iterdir() if p.is_dir() and not p.name.startswith(".")):
        manifest_path = folder / MANIFEST
        if not manifest_path.is_file():
            continue
        try:
            manifest = json.loads(manifest_path.read_text())
        except (json.JSONDecodeError, OSError):
            continue  # a damaged manifest is that stage's problem; the summary lists what it can read
        report = folder / "report.md"
        out.append({"stage": manifest.get("stage", folder.name), "folder": folder.name,
                    "report": f"{folder.name}/{'report.md' if report.is_file() else MANIFEST}",
                    "seconds": manifest.get("seconds")})
    return out


def stage_minutes_table(stages: Sequence[dict]) -> str:
    """One row a stage (its folders together: ``export-ort_cpu`` and ``export-metax`` are export's),
    in the order they were listed, and the total."""
    rows: dict[str, list] = {}
    for s in stages:
        family = s["folder"].split("-", 1)[0]
        row = rows.setdefault(family, [family, [], 0.0])
        row[1].append(s["folder"])
        row[2] += float(s["seconds"] or 0.0)
    total = sum(r[2] for r in rows.values())
    ordered = sorted(rows.values(), key=lambda r: (RUN_ORDER.index(r[0]) if r[0] in RUN_ORDER else len(RUN_ORDER), r[0]))
    return markdown_table(["stage", "folders", "minutes"],
                          [[f, ", ".join(folders), f"{sec / 60:.1f}"] for f, folders, sec in ordered]
                          + [["total", "", f"{total / 60:.1f}"]])


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``path`` through a temporary sibling and one rename: readers see the old or the new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_summary(root: Path, benchmark_folder: Path, metrics: dict) -> tuple[Path, Path]:
    """``<root>/summary.md`` and ``summary.json`` from the benchmark's metrics and every manifest."""
    root = Path(root)
    stages = stage_reports(root)
    rel = os.path.relpath(benchmark_folder, root)
    packages, seen = [], set()
    for v in metrics["variants"]:  # a package's greedy twin row is the same folder: listed once
        if v["kind"] == "package" and v["location"] not in seen:
            seen.add(v["location"])
            packages.append({"label": v["label"], "folder": v["location"], "model": v.get("model"),
                             "precision": v.get("precision")})
    where = metrics.get("machine") or machine()
    payload = {"benchmark": rel, "machine": where, "threads": metrics.get("threads"),
               "variants": metrics["variants"], "serving": metrics.get("serving"),
               "packages": packages, "stages": stages, "notes": metrics.get("notes", [])}
    lines = ["# Run summary", "",
             f"Benchmark: [{rel}/report.md]({rel}/report.md); ratios against `{metrics['shipped']}` "
             f"(the shipped model, full-prefix decoder), from one run on {machine_line(where)}; "
             f"{metrics['threads']} thread(s) per variant.", "", table(metrics["variants"]), ""]
    if metrics.get("serving"):
        lines += ["Serving (threads sharing one package's sessions):", "", serving_table(metrics["serving"]), ""]
    for label, spec in (metrics.get("speculative") or {}).items():
        lines += [f"Speculative decoding of `{label}` at batch 1 ({spec['drafter']} drafter, {spec['draft_len']} drafts "
                  f"a call) against its own plain greedy: " + "; ".join(
                      f"{split}: identical on {r['identical']:.3f} of {r['n']}"
                      + (f" (to greedy on the verify graph: {r['identical_verify_greedy']:.3f})"
                         if "identical_verify_greedy" in r else "") + ", decoder calls "
                      f"{r['greedy_calls_per_formula'] / max(r['calls_per_formula'], 1e-9):.2f}x fewer, decoder ms "
                      f"{r['greedy_decoder_ms_per_formula'] / max(r['decoder_ms_per_formula'], 1e-9):.2f}x lower"
                      + (f", end to end {r['baseline_ms_per_formula'] / max(r['ms_per_formula'], 1e-9):.2f}x "
                         f"`{r['baseline']}` ({r['baseline_ms_per_formula'] / max(r['greedy_ms_per_formula'], 1e-9):.2f}x "
                         f"decoding greedy)" if "baseline" in r else "")
                      for split, r in spec["splits"].items()) + ".", ""]
    lines += [f"![Pareto]({rel}/pareto.png)", "", "## Packages", ""]
    lines += [f"- {p['label']}: `{p['folder']}` (model {p['model'] or '?'}, precision "
              f"{', '.join(f'{g} {q}' for g, q in (p['precision'] or {}).items()) or '?'})" for p in packages] \
        or ["- none benchmarked"]
    lines += ["", "## Stage reports", "",
              markdown_table(["stage", "folder", "report", "seconds"],
                             [[s["stage"], s["folder"], f"[{s['report']}]({s['report']})",
                               "" if s["seconds"] is None else f"{s['seconds']:.0f}"] for s in stages]), ""]
    lines += ["## Where the minutes went", "",
              "Each stage's artifacts, the time they took when they were made (a reused artifact keeps the "
              "time of the run that made it):", "", stage_minutes_table(stages), ""]
    if metrics.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in metrics["notes"]] + [""]
    md, js = root / SUMMARY_MD, root / SUMMARY_JSON
    write_text_atomic(js, json.dumps(payload, indent=2, default=str) + "\n")
    write_text_atomic(md, "\n".join(lines))
    return md, js
