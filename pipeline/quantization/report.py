"""The quantize stage's report: ``report.md`` (methods, sensitivity, plan searches, the decoder, the
check beside the anchors) with its plots, the notes it and the log share, and the summary line."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from pipeline.names import QDQ_ENCODER, QDQ_ENCODER_ORT
from pipeline.quantization import decoder as qdec
from pipeline.quantization.plan import Plan
from pipeline.quantization.search import json_number
from pipeline.reports import markdown_table, plt, savefig


def carried_line(carried: dict[str, list[str]]) -> str:
    """How an applied plan's groups were mapped onto this graph's (a pooled layer's q/k/v onto a merged qkv)."""
    return "groups carried over by what they are: " + ", ".join(
        f"{', '.join(f'`{s}`' for s in src)} → `{dst}`" for dst, src in sorted(carried.items()))


def resolution_note(m: dict) -> Optional[str]:
    """One line when the budget is finer than the search set resolves: the ort_cpu plan's loss there has
    a paired standard error above the budget, so other formulas may well see a loss over it
    (docs/quantize.md: plans that read within one formula of float on the search set lost 1.2 points
    on the whole eval split)."""
    r = m.get("ort_cpu_search")
    if not r or r["loss_se"] <= m["budget"]:
        return None
    return (f"the budget ({m['budget']:.1%} exact match) is finer than the {m['search_n']} search formulas resolve: "
            f"the ort_cpu plan's loss there is {r['loss']:+.1%} with a paired standard error of {r['loss_se']:.1%} "
            f"({r['gained']} formulas gained, {r['lost']} lost vs float), so on other formulas it may exceed the "
            f"budget; more search formulas resolve it better (quantize.search_split=train "
            f"quantize.search_images=2000: the whole train split)")


def decoder_line(plan: Plan) -> str:
    """What the plan made of the decoders, per target."""
    return (f"ort_cpu: {sum(v == 'int8' for v in plan.decoder_nodes.values())} of {len(plan.decoder_nodes)} "
            f"weight matrices in 8 bits (ORT MatMulNBits, blocks of {qdec.BLOCK}, symmetric), the rest FP32"
            + ("; decoder_first's cross-attention K/V projections dynamic INT8 (per-channel weights, "
               "per-tensor activations)" if plan.decoder_cross_kv == "int8" else "")
            if plan.decoder == "int8" else "ort_cpu: float (FP32)") \
        + "; TensorRT / Metax: float (export casts it to FP16)"


def plots(folder: Path, ranked, by_name, metric: str, table: list[dict]) -> None:
    """``sensitivity.png`` (bars, most sensitive first), ``sensitivity_heatmap.png`` (role x block) and,
    when the check timed the variants, ``pareto.png``."""
    names = [r.group for r in ranked]
    fig, ax = plt.subplots(figsize=(8, max(3.5, 0.28 * len(names))))
    y = np.arange(len(names))
    ax.barh(y + 0.2, [json_number(r.gain) for r in ranked], 0.4, color="#ee6677", label="gain when returned to float")
    ax.barh(y - 0.2, [min(json_number(r.only), 80) for r in ranked], 0.4, color="#4477aa", label=f"{metric}, only this group INT8")
    ax.set_yticks(y, names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(metric)
    ax.set_title("Per-group quantization sensitivity (most sensitive first)")
    ax.legend(fontsize=7, loc="lower right")
    savefig(fig, folder / "sensitivity.png")
    blocks = sorted({by_name[n].block for n in names}, key=lambda b: (len(b), b))
    roles = sorted({by_name[n].role for n in names})
    grid = np.full((len(roles), len(blocks)), np.nan)
    for r in ranked:
        g = by_name[r.group]
        grid[roles.index(g.role), blocks.index(g.block)] = min(json_number(r.only), 80)
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(blocks), 1 + 0.45 * len(roles)))
    im = ax.imshow(grid, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(blocks)), blocks, fontsize=7, rotation=20)
    ax.set_yticks(range(len(roles)), roles, fontsize=7)
    for i in range(len(roles)):
        for j in range(len(blocks)):
            if np.isfinite(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", fontsize=7, color="w")
    fig.colorbar(im, ax=ax, label=f"{metric}, only this group INT8 (low = sensitive)")
    ax.set_title("Sensitivity: layer x block")
    savefig(fig, folder / "sensitivity_heatmap.png")
    _pareto(folder, table)


def _pareto(folder: Path, table: list[dict]) -> None:
    rows = [r for r in table if "total_ms" in r]
    if not rows:  # quantize.check=false: nothing timed here
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    markers = "osD^vP*Xh<>"
    for i, r in enumerate(rows):  # a legend, not labels: the variants near float crowd one corner
        ax.scatter(r["total_ms"], r["exact_match"], s=45, marker=markers[i % len(markers)],
                   label=f"{r['variant']} ({r['total_ms']:.0f} ms, {r['exact_match']:.3f})")
    ax.legend(fontsize=7, loc="center right")  # the collapsed anchors sit at the bottom, the rest at the top
    ax.set_xlabel("end-to-end ms / formula (batch 1, 1 thread)")
    ax.set_ylabel(f"exact match ({rows[0]['n']} eval formulas)")
    ax.set_title("Latency vs exact match")
    savefig(fig, folder / "pareto.png")


def write_report(folder: Path, m: dict, plan: Plan) -> None:
    """``report.md`` from the stage's metrics ``m`` (``quantize.json``) and its plan."""
    ort_int8 = set(plan.ort_cpu_int8_groups())
    resolution = resolution_note(m)
    methods = markdown_table(["method", "exact match", "CER", "encoder SNR dB", "identical tokens vs float",
                              "calibration s"],
                             [[r["method"] + (" **(chosen)**" if r["method"] == m["method"] else ""),
                               f"{r['exact_match']:.3f}", f"{r['cer']:.3f}", f"{r['snr_db']:.1f}",
                               f"{r['identical']:.3f}", r["calibration_s"]] for r in m["methods"]])
    sens = markdown_table(["rank", "group", "kind", "MACs (M)", f"only this INT8 ({m['metric']})",
                           "all but this INT8", "gain", "plan", "plan (ort_cpu graph)"],
                          [[i + 1, f"`{r['group']}`", r["kind"], f"{r['macs'] / 1e6:.0f}", f"{r['only']:.1f}",
                            f"{r['all_but']:.1f}", f"{r['gain']:.1f}", plan.groups[r["group"]].precision,
                            ("int8" if r["group"] in ort_int8 else "float") if r["kind"] == "weights" else "fused, float"]
                           for i, r in enumerate(m["sensitivity"])])
    anchors_rows = []
    others = [sp for sp in next((list(r["splits"]) for r in m["anchors"] if "splits" in r), [])][1:]
    for r in m["anchors"]:
        if "total_ms" not in r:
            anchors_rows.append([r["variant"], "", "", *([""] * 2 * len(others)), "", "", "", "", "", "", "", r["note"]])
            continue
        anchors_rows.append([r["variant"], f"{r['exact_match']:.3f}", f"{r['cer']:.3f}",
                             *(f"{r['splits'][sp][k]:.3f}" for sp in others for k in ("exact_match", "cer")),
                             f"{r['identical_vs_float']:.3f}", f"{r['encoder_ms']:.1f}",
                             f"{r['decoder_ms_per_step']:.2f}", f"{r['total_ms']:.1f}", f"{r['size_mb']:.1f}",
                             f"{r['int8_mac_share']:.2f}", r["search_s"], r["note"]])
    anchors_t = markdown_table(["variant", "exact match", "CER",
                                *(f"{k} ({sp})" for sp in others for k in ("exact match", "CER")),
                                "identical tokens vs float", "encoder ms",
                                "decoder ms/step", "end-to-end ms", "encoder MB", "INT8 share of MatMul MACs",
                                "search s", "note"], anchors_rows)
    s = m["search"]
    def trace_table(rows: list[dict]) -> str:
        return markdown_table(["groups returned to float", "last returned", "exact match", "loss vs float",
                               "gained / lost vs float", "paired SE of the loss", "INT8 MAC share"],
                              [[t["float_groups"], f"`{t.get('returned')}`" if t.get("returned") else "",
                                f"{t['exact_match']:.3f}", f"{t['loss']:+.3f}", _paired_cell(t),
                                f"{t['loss_se']:.3f}" if "loss_se" in t else "",
                                f"{t.get('int8_mac_share', float('nan')):.2f}"] for t in rows])
    trace = trace_table(m["search_trace"])
    if m.get("ort_cpu_search_trace"):
        trace += ("\n\nThe ort_cpu graph (attention fused and float; its projections ranked the same way, "
                  f"searched on that graph): **{m['ort_cpu_int8_groups']} of {m['ort_cpu_groups']} projections "
                  f"INT8**, {m['ort_cpu_int8_mac_share']:.0%} of the encoder's MatMul MACs.\n\n"
                  + trace_table(m["ort_cpu_search_trace"]))
    applied = m.get("applied_plan")
    if applied:
        status = (f"met by the plan applied from `{applied}` (no search)" if m["met_budget"] else
                  f"**NOT met by the plan applied from `{applied}`** (no search: written as given, marked as such)")
        if m.get("carried"):
            status += f"; {carried_line(m['carried'])}"
    else:
        status = "met" if m["met_budget"] else "**NOT met: the best plan found is written, marked as such**"
    if not m["methods"]:
        methods = f"Not compared: the plan's method, {m['method']}."
    n_eval = next((r["n"] for r in m["anchors"] if "n" in r), 0)
    (folder / "report.md").write_text(
        f"# Quantization: {m['model']}\n\n"
        f"Symmetric INT8 (zero point 0), per-channel weights, per-tensor activations, explicit Q/DQ "
        f"(ONNX Runtime `quantize_static`, ranges from ORT's calibrators)"
        + ("; the ort_cpu graph's activations asymmetric UINT8 (zero point fitted to each range: ONNX Runtime "
           "CPU's U8S8)" if m.get("ort_cpu_activations") == "uint8" else "")
        + f". Decoder: {m['decoder']}.\n\n"
        f"Plan: **{m['int8_groups']} of {m['groups']} groups INT8**, {m['int8_mac_share']:.0%} of the encoder's "
        f"MatMul MACs; budget {m['budget']:.3f} exact-match loss vs float: {status}. "
        f"On the search set ({s['search_set']}): float {s['float_exact_match']:.3f} / CER {s['float_cer']:.3f}, "
        f"plan {s['plan_exact_match']:.3f} / {s['plan_cer']:.3f} (ort_cpu graph {s['ort_cpu_exact_match']:.3f}"
        + ").\n\n" + (f"**Resolution:** {resolution}.\n\n" if resolution else "")
        + _decoder_section(m) +
        f"Files: `plan.json` (edit a precision, feed it back with `quantize.plan=FILE`), `{QDQ_ENCODER}` "
        f"(TensorRT, Metax), `{QDQ_ENCODER_ORT}` (ONNX Runtime CPU, attention fused and float).\n\n"
        f"## Calibration methods (weight groups INT8, search set)\n\n{methods}\n\n{_smoothing_line(m)}\n\n"
        f"{_qat_line(m)}\n\n"
        f"## Sensitivity ({m['metric']} of the encoder output on calibration images; "
        f"all groups INT8: {m['all_int8_score']:.1f})"
        + (f": the numbers the plan file carries, measured on the model it was made for" if applied else "")
        + f"\n\n{sens}\n\n![sensitivity](sensitivity.png)\n\n"
        f"![heat map](sensitivity_heatmap.png)\n\n## Plan search (binary search over the ranking)\n\n"
        f"Loss: the float model's exact match minus the plan's on the {m['search_n']} search formulas (one formula "
        f"is {1 / max(1, m['search_n']):.3f}); the paired standard error says how finely they resolve it: a loss "
        f"within about one SE of the budget could be on either side of it on other formulas.\n\n{trace}\n\n"
        + (f"## Check on {n_eval} eval formulas (and as many of each other split: the shift split holds formulas "
           f"from packages training never saw), beside the anchors (same formulas, same session options)\n\n"
           f"{anchors_t}\n\n![pareto](pareto.png)\n\nLatency: batch 1, 1 intra-op thread, ONNX Runtime CPU, "
           f"images interleaved across variants; compare ratios within this run. " if m["anchors"] else
           "## Check\n\nOff (`quantize.check=false`, as in `stage=all`): export's parity check and the benchmark "
           "read the packages built from these graphs. ")
        + f"Seconds: sensitivity "
        f"{m['seconds']['sensitivity']}, search {m['seconds']['search']}, whole stage {m['seconds']['total']}"
        + (" (" + ", ".join(f"{k} {v:.0f}" for k, v in m.get("phase_seconds", {}).items()) + ")"
           if m.get("phase_seconds") else "") + ".\n")


def _paired_cell(t: dict) -> str:
    return f"{t['gained']} / {t['lost']}" if "gained" in t else ""


def _smoothing_line(m: dict) -> str:
    if m.get("smoothquant") is None:
        return ("SmoothQuant: off (`quantize.smoothquant=ALPHA` folds it into the model before export, "
                "`pipeline/quantization/smooth.py`).")
    ranges = ", ".join(f"`{k}` {v['before']:.0f} → {v['after']:.0f}" for k, v in m["smoothing"].items())
    return (f"SmoothQuant: alpha {m['smoothquant']} folded into the model's LayerNorms and value projections before "
            f"export (the graphs above are of that model; the float function is the same). Largest over median "
            f"input-channel maximum of each smoothed projection, before → after: {ranges}.")


def _qat_line(m: dict) -> str:
    q = m.get("qat") or {}
    if not q:
        return ("Quantization-aware finetune: off (`quantize.qat_steps=N` trains the encoder with INT8 fake "
                "quantizers first, `pipeline/quantization/qat.py`).")
    return (f"Quantization-aware finetune: {q['steps']} of {q['planned_steps']} steps (lr {q['lr']}, batch "
            f"{q['batch_size']}, {q['images']} calibration images, {q['quantized_modules']} encoder projections with "
            f"ModelOpt INT8 fake quantizers, {q['seconds']:.0f} s; targets: the float model's greedy readings by its "
            f"{q.get('teacher_readings', 'torch model')}, {q.get('teacher_readings_seconds', 0):.0f} s); the graphs above are of the finetuned weights, "
            f"every loss is against the float model handed over.")


def _decoder_section(m: dict) -> str:
    s = m["search"]
    if s.get("ort_cpu_int8_decoder_exact_match") is None:
        return ""
    sens = markdown_table(["rank", "decoder_step node", "logit SNR dB alone in 8 bits"],
                          [[i + 1, f"`{r['node']}`", f"{r['logit_snr_db']:.1f}"]
                           for i, r in enumerate(m.get("decoder_sensitivity", []))])
    trace = markdown_table(["nodes kept float", "last kept", "exact match", "loss vs float decoder",
                            "gained / lost", "paired SE of the loss", "identical readings"],
                           [[t["float_nodes"], f"`{t['returned']}`" if t.get("returned") else "", f"{t['exact_match']:.3f}",
                             f"{t['loss']:+.3f}", _paired_cell(t), f"{t['loss_se']:.3f}" if "loss_se" in t else "",
                             f"{t['identical']:.3f}"] for t in m.get("decoder_search_trace", [])])
    return (f"## ort_cpu decoder\n\n{m['decoder']}. On the decoder search set ({s['decoder_search_set']}), with the "
            f"INT8 encoder: float decoder {s['decoder_float_exact_match']:.3f} / CER {s['decoder_float_cer']:.3f}, "
            f"the plan's decoder {s['ort_cpu_int8_decoder_exact_match']:.3f} / {s['ort_cpu_int8_decoder_cer']:.3f} "
            f"({s['ort_cpu_int8_decoder_identical']:.0%} of readings identical).\n\n"
            + (f"Sensitivity (logits of recorded greedy decoder steps, each node alone in 8 bits):\n\n{sens}\n\n"
               f"Search:\n\n{trace}\n\n" if m.get("decoder_sensitivity") else "")
            + _cross_kv_line(s))


def _cross_kv_line(s: dict) -> str:
    c = s.get("decoder_cross_kv_check")
    if not c:
        return ""
    kept = "kept" if s.get("decoder_cross_kv") == "int8" else "over the budget: they stay FP32"
    return (f"Then decoder_first's {s['decoder_cross_kv_nodes']} cross-attention K/V projections of the encoder "
            f"output in dynamic INT8, with the plan's decoder: exact match {c['exact_match']:.3f} on {c['n']} "
            f"formulas, loss {c['loss']:+.3f} vs the float decoder ({_paired_cell(c)}, paired SE "
            f"{c.get('loss_se', float('nan')):.3f}), {c['identical']:.0%} of readings identical: {kept}.\n\n")


def summary_line(m: dict) -> str:
    """The line a quantize run owes the terminal: the plan, the decoder, the budget and the eval check."""
    ours = next((r for r in m["anchors"] if r["variant"].startswith("ours (plan, ort_cpu")), None)
    base = next((r for r in m["anchors"] if r["variant"].startswith("float")), None)
    speed = ""
    if ours and base and "total_ms" in ours:
        speed = (f"; eval check n={ours['n']}: exact match {base['exact_match']:.3f} -> {ours['exact_match']:.3f}, "
                 f"encoder {base['encoder_ms'] / ours['encoder_ms']:.2f}x, end to end "
                 f"{base['total_ms'] / ours['total_ms']:.2f}x faster (ort_cpu, 1 thread)"
                 + "".join(f"; {sp} n={v['n']}: {base['splits'][sp]['exact_match']:.3f} -> {v['exact_match']:.3f}"
                           for sp, v in list(ours.get("splits", {}).items())[1:]))
    return (f"[quantize] {m['model']}: {m['method']} ranges, {m['int8_groups']}/{m['groups']} groups INT8 "
            f"({m['int8_mac_share']:.0%} of MatMul MACs; ort_cpu graph {m.get('ort_cpu_int8_groups', '?')}/"
            f"{m.get('ort_cpu_groups', '?')} projections), ort_cpu decoder {m.get('decoder_precision', 'float')}, "
            f"budget {'met' if m['met_budget'] else 'NOT met'}{speed}")
