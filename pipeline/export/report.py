"""report.md and op_histogram.png of an exported package."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.export.parity import FINETUNED_MAX_EXACT_LOSS
from pipeline.reports import markdown_table, plt, savefig


def histogram_plot(path: Path, histograms: dict[str, dict[str, dict[str, int]]]) -> None:
    graphs = list(histograms)
    fig, axes = plt.subplots(1, len(graphs), figsize=(4.2 * len(graphs), 3.6))
    for ax, g in zip(np.atleast_1d(axes), graphs):
        phases = list(histograms[g])
        totals = [sum(histograms[g][p].values()) for p in phases]
        bars = ax.bar(phases, totals, color="#4477aa")
        for b, v in zip(bars, totals):
            ax.annotate(str(v), (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
        ax.set_title(g)
        ax.set_ylabel("nodes")
        ax.tick_params(axis="x", labelrotation=30)
    savefig(fig, path)


def _histogram_table(h: dict[str, dict[str, int]]) -> str:
    phases = list(h)
    ops = sorted({op for p in phases for op in h[p]}, key=lambda op: (-max(h[p].get(op, 0) for p in phases), op))
    rows = [[op, *[h[p].get(op, 0) for p in phases]] for op in ops]
    rows.append(["**total**", *[sum(h[p].values()) for p in phases]])
    return markdown_table(["op", *phases], rows)


def write_report(folder: Path, meta: dict, histograms: dict, metrics: dict, rows: list[dict], failures: list[str]) -> None:
    histogram_plot(folder / "op_histogram.png", histograms)
    t = metrics["tokens"]
    tensor_rows = [[name, s["n"], f"{s['max_abs']:.3g}", f"{s['cosine']:.6f}", f"{s['snr_db']:.1f}"]
                   for name, s in metrics["tensors"].items()]
    tol = metrics["tolerances"]
    limit = metrics["parity_limit"]
    scope = (f"the first {t['n']} renderable formulas of {metrics['eval_source']} "
             f"(export.parity_limit={limit}; {metrics['eval_available']} available)" if limit
             else f"all {t['n']} renderable formulas of {metrics['eval_source']}")
    parts = [
        f"# Export: {meta['target']}\n",
        markdown_table(["", ""], [
            ["graphs", ", ".join(meta["graphs"].values())],
            ["precision", ", ".join(f"{g}: {p}" for g, p in meta["precision"].items())],
            ["opset / IR", f"{meta['opset']} / {', '.join(f'{g}: {v}' for g, v in meta['ir_version'].items())}"],
            ["provider", f"{meta['provider']} {meta['provider_options'] or ''}"],
            ["decode cap (tokens incl. BOS)", meta["max_length"]],
            ["verdict", "PASS" if not failures else "FAIL: " + "; ".join(failures)],
        ]),
        "\n## Tensor parity vs torch\n",
        "Worst case over calibration images; the decoder graphs read the torch memory and are "
        "teacher-forced on the true tokens, so each decoder row measures the decoder alone. "
        "Parity runs on ONNX Runtime CPU, the reference runtime for every target.\n",
        markdown_table(["output", "images", "max abs", "cosine", "SNR dB"], tensor_rows),
        f"\nTolerances for the least precise graph ({metrics['tolerance_level']}): cosine >= {tol['min_cosine']}, "
        f"SNR >= {tol['min_snr_db']} dB, identical greedy tokens >= {tol['min_identical']}"
        + (f" (or, its encoder finetuned quantization-aware, at most {FINETUNED_MAX_EXACT_LOSS} fewer formulas read "
           "right than torch)" if metrics.get("qat_finetuned") else "") + ".\n",
        "\n## Greedy decoding vs torch\n",
        f"On {scope}, same cap for both.\n",
        markdown_table(["metric", "value"], [
            ["identical token sequences", f"{t['identical']:.3f}"],
            ["token agreement (positions)", f"{t['token_agreement']:.4f}"],
            ["exact match, torch", f"{t['exact_match_torch']:.3f}"],
            ["exact match, ONNX", f"{t['exact_match_onnx']:.3f}"],
        ]),
    ]
    diffs = [r for r in rows if not r["identical"]][:10]
    if diffs:
        parts += ["\nFirst differences:\n", markdown_table(
            ["truth", "torch", "onnx"], [[f"`{r['truth']}`", f"`{r['torch'][:80]}`", f"`{r['onnx'][:80]}`"] for r in diffs])]
    trt = metrics.get("tensorrt")
    if trt is not None:
        parts.append("\n## TensorRT\n")
        if trt.get("built"):
            parts.append(markdown_table(["graph", "engine", "build s", "INT8"],
                                        [[g, e["engine"], e["build_seconds"], e["int8"]] for g, e in trt["engines"].items()]))
        else:
            parts.append(f"Engines not built here ({trt['reason']}). `build_engines.sh` holds the exact "
                         "`trtexec` commands (FP16, INT8 where the graph has Q/DQ, min/opt/max shapes of "
                         "`tensorrt_profiles.json`, a shared timing cache).")
    parts.append("\n## Op types per graph\n\n![node counts](op_histogram.png)\n")
    for g, h in histograms.items():
        parts += [f"\n### {g}\n", _histogram_table(h)]
    (folder / "report.md").write_text("\n".join(parts) + "\n")
