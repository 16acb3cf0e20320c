"""Stage evaluate's report: ``report.md`` (accuracy per split, batch-1 latency, the first misses)
and the plot of exact match by formula length."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.reports import grouped_bar_plot, markdown_table


def by_split(m: dict) -> dict[str, dict]:
    """The per-split metrics ({"": m} for a single source)."""
    return m.get("splits") or {"": m}


_LENGTH_BUCKETS = [(0, 10), (10, 20), (20, 40), (40, 80), (80, 10**9)]


def _exact_by_length(rows: list[dict]) -> dict[str, tuple[float, int]]:
    from pipeline.metrics import normalize
    out = {}
    for lo, hi in _LENGTH_BUCKETS:
        sel = [r for r in rows if lo <= len(normalize(r["truth"])) < hi]
        if sel:
            out[f"{lo}-{hi - 1}" if hi < 10**9 else f"{lo}+"] = (float(np.mean([r["exact"] for r in sel])), len(sel))
    return out


def _fmt(v, digits: int = 3) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def write_report(folder: Path, m: dict, rows: list[dict]) -> None:
    splits = by_split(m)
    names = list(splits)
    by_length = {n: _exact_by_length([r for r in rows if r.get("split", "") == n or n == ""]) for n in names}
    labels = [lab for lab in (f"{lo}-{hi - 1}" if hi < 10**9 else f"{lo}+" for lo, hi in _LENGTH_BUCKETS)
              if any(lab in b for b in by_length.values())]
    grouped_bar_plot(folder / "exact_match_by_length.png", labels,
                     {n or "exact match": [by_length[n].get(lab, (0.0, 0))[0] for lab in labels] for n in names},
                     annotations={n or "exact match": [by_length[n].get(lab, (0.0, 0))[1] for lab in labels]
                                  for n in names},
                     title="Exact match by normalized formula length", ylabel="exact match")
    lat = m.get("latency_batch1") or {}
    latc = m.get("latency_batch1_cached") or {}

    def row(label: str, fn) -> list:
        return [label, *(fn(s) for s in splits.values())]

    header = ["metric", *(f"split '{n}'" if n else "value" for n in names)]
    table = markdown_table(header, [
        row("formulas (n)", lambda s: s["n"]), row("source", lambda s: s["source"]),
        row("model", lambda s: s["model"]),
        row("exact match (normalized text)", lambda s: _fmt(s["exact_match"])),
        row("image exact match", lambda s: _fmt(s["image_exact_match"])),
        row("CER (corpus)", lambda s: _fmt(s["cer"])), row("CER (mean per formula)", lambda s: _fmt(s["cer_mean"])),
        row("BLEU-4 (LaTeX atoms)", lambda s: _fmt(s["bleu"])),
        row("stopped at the length cap", lambda s: f"{s['hit_cap_share']:.3f} (cap {s['max_length']})"),
        row("layout-run cap (README, Decoding)", lambda s: s.get("layout_run_cap", 0) or "off"),
        row(f"encoder ms / image (batch {m['batch_size']})", lambda s: _fmt(s["encoder_ms_per_image"], 1)),
        row(f"decoder ms / image (batch {m['batch_size']})", lambda s: _fmt(s["decoder_ms_per_image"], 1)),
        row("accuracy pass decoded with", lambda s: "KV cache" if s.get("kv_cache") else "full prefix (as shipped)"),
    ])
    latency = markdown_table(["latency at batch 1" + (f" (split '{names[0]}', {lat.get('n', 0)} image(s))" if names[0]
                                                      else f" ({lat.get('n', 0)} image(s))"), "value"], [
        ["encoder ms / image", f"{lat.get('encoder_ms', float('nan')):.1f}"],
        ["decoder ms / image (shipped full-prefix decoder)", f"{lat.get('decoder_ms', float('nan')):.1f}"],
        ["decoder ms / step (shipped)", f"{lat.get('decoder_ms_per_step', float('nan')):.1f}"],
        ["decoder ms / image (KV-cached)", f"{latc.get('decoder_ms', float('nan')):.1f}"],
    ])
    misses = []
    for n in names:
        misses += [r for r in rows if not r["exact"] and (r.get("split", "") == n or n == "")][:15 if len(names) == 1 else 8]
    miss_table = markdown_table(["split", "truth", "prediction", "CER"] if names[0] else ["truth", "prediction", "CER"],
                                [([r["split"]] if names[0] else []) + [f"`{r['truth']}`", f"`{r['pred'][:120]}`",
                                                                       f"{r['cer']:.2f}"] for r in misses])
    shift_note = ("\n\nThe shift split holds formulas from packages the corpus never read (`data.shift_packages`), "
                  "minus any formula whose normalized text is in the corpus; it is never used for training, "
                  "calibration or choosing defaults.") if "shift" in names else ""
    (folder / "report.md").write_text(
        "# Evaluation\n\n" + table + shift_note + "\n\n" + latency +
        "\n\n![exact match by length](exact_match_by_length.png)\n\n"
        "Normalization before comparing: display-math wrappers stripped, layout-only tokens "
        "(`\\left`, `\\,`, `\\quad`, `&`, `\\\\` ...) dropped, braces around single-token scripts "
        "removed, whitespace removed (see `pipeline/metrics.py`).\n\n## First misses\n\n" + miss_table + "\n")
