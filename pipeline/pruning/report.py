"""The prune stage's report: ``report.md`` (variants, where the pruned model holds, criteria against
ablation, recovery, time) with the head-score heat map beside it, and its one-line summary."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pipeline.pruning import select
from pipeline.reports import markdown_table, savefig


def summary_line(m: dict) -> str:
    """The line a prune run owes the terminal: heads removed, FLOPs and accuracy on each split."""
    splits = m.get("splits") or {"eval": {"exact_match_original": m["exact_match_original"],
                                          "exact_match": m["exact_match"], "n": m["eval_n"]}}
    acc = "; ".join(f"{name}: exact match {v['exact_match_original']:.3f} -> {v['exact_match']:.3f}"
                    + (f", CER {v['cer_original']:.3f} -> {v['cer']:.3f}" if "cer" in v else "")
                    + f" (n={v['n']})" for name, v in splits.items())
    return (f"[prune] {m['criterion']}: {m['heads_removed']}/{m['heads_total']} heads removed, encoder "
            f"{m['encoder_gflops_original']:.2f} -> {m['encoder_gflops']:.2f} GFLOPs ({m['flops_reduction']:.1%} less), "
            f"{acc}")


def write_head_scores(path: Path, cfg, head_counts, all_scores: dict, removed: dict, random_removed: dict,
                      correlations: dict) -> None:
    """``head_scores.json``: every criterion's scores, the heads removed (and the random baseline's), the
    criteria's rank correlation with the ablation."""
    path.write_text(json.dumps({
        "criterion": cfg.criterion, "normalize": cfg.normalize, "head_counts": head_counts,
        "scores": all_scores, "removed": {str(k): v for k, v in removed.items()},
        "random_removed": {str(k): v for k, v in random_removed.items()},
        "spearman_vs_ablation": correlations}, indent=2))


def write_report(folder: Path, cfg, m: dict, all_scores: dict, removed: dict, head_counts) -> None:
    """``report.md`` and ``head_scores.png`` in ``folder`` from the stage's metrics ``m``; ``cfg``: the stage's
    PruneConfig (criterion, normalize, tolerances, score_images)."""
    import matplotlib.pyplot as plt

    crits = [cfg.criterion] + (["ablation"] if cfg.criterion != "ablation" and "ablation" in all_scores else [])
    fig, axes = plt.subplots(1, len(crits), figsize=(4.2 * len(crits), 3.2), squeeze=False)
    width = max(head_counts)
    for ax, c in zip(axes[0], crits):
        grid = np.full((len(head_counts), width), np.nan)
        for l, row in enumerate(select.normalized(all_scores[c], cfg.normalize)):
            grid[l, :len(row)] = row
        im = ax.imshow(grid, cmap="viridis", aspect="auto")
        for l, hs in removed.items():
            for h in hs:
                ax.text(h, l, "x", ha="center", va="center", color="red", fontsize=14, fontweight="bold")
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(width))
        ax.set_yticks(range(len(head_counts)))
        ax.set_title(f"{c} ({cfg.normalize}-normalized)" + ("" if c != cfg.criterion else "\nx = removed"))
        fig.colorbar(im, ax=ax)
    savefig(fig, folder / "head_scores.png")

    rows = []
    splits = list(m["splits"])
    narrowed = "encoder_mlp" in m  # prune.mlp_ratio: each variant's MLP units per layer beside its heads
    for label, v in m["variants"].items():
        rows.append([label, "/".join(map(str, v["encoder_heads"])),
                     *(["/".join(map(str, v.get("encoder_mlp", [])))] if narrowed else []),
                     f"{v['params']:,}", f"{v['attention_params']:,}",
                     f"{v['encoder_gflops']:.2f}", f"{v['encoder_ms_batch1']:.1f}",
                     *(f"{v['splits'][s]['exact_match']:.3f}" for s in splits),
                     *(f"{v['splits'][s]['cer']:.3f}" for s in splits),
                     *(f"{v['splits'][s]['hit_cap_share']:.2f}" for s in splits)])
    table = markdown_table(["variant", "heads per layer", *(["MLP units per layer"] if narrowed else []),
                            "params", "attention params", "encoder GFLOPs",
                            "encoder ms (batch 1)", *(f"exact match ({s})" for s in splits),
                            *(f"CER ({s})" for s in splits), *(f"hit length cap ({s})" for s in splits)], rows)
    holds = markdown_table(
        ["split", "formulas", "exact match original -> pruned", "CER original -> pruned", "holds"],
        [[s, v["n"], f"{v['exact_match_original']:.3f} -> {v['exact_match']:.3f} ({-v['exact_match_drop']:+.3f})",
          f"{v['cer_original']:.3f} -> {v['cer']:.3f} ({v['cer_relative_change']:+.1%})", "yes" if v["holds"] else "NO"]
         for s, v in m["splits"].items()])
    corr = (f"## Criteria against the ground truth\n\nGround truth: the increase of the teacher-forced loss "
            f"(against the original's own reading) when one head alone is off ({cfg.score_images} rendered train "
            f"formulas).\n\n" + markdown_table(["criterion", "Spearman vs single-head ablation"],
                                                [[c, f"{v:.2f}"] for c, v in m["spearman_vs_ablation"].items()])
            + "\n\n") if m["spearman_vs_ablation"] else ""
    rec = m.get("recovery") or {}
    rec_lines = "\n".join(
        f"- round {i + 1}: removed {e['removed']}; refit relative error "
        + ", ".join(f"L{l} attention {d['attn_rel_error_before']:.2f}->{d['attn_rel_error_after']:.2f}"
                    + (f", block {d['mlp_rel_error_before']:.2f}->{d['mlp_rel_error_after']:.2f}" if "mlp_rel_error_after" in d else "")
                    for l, d in e["refit"].items())
        + "".join(f"; distill L{l} {d['block_rel_error_before']:.2f}->{d['block_rel_error_after']:.2f} "
                  f"({d['steps']} steps)" for l, d in e.get("distill", {}).items())
        + f"; finetune {e['finetune'].get('steps', 0)} step(s)"
        + (f" of {e['finetune_planned']}, stopped by prune.finetune_minutes"
           if e['finetune'].get('steps', 0) < e.get('finetune_planned', 0) else "")
        + (f", loss {e['finetune']['first_loss']:.3f} -> {e['finetune']['last_loss']:.3f}"
           if e['finetune'].get('steps') else "") + "; CPU "
        f"{e['refit_cpu_seconds'] + e.get('distill_cpu_seconds', 0) + e['finetune_cpu_seconds']:.0f} s"
        for i, e in enumerate(rec.get("rounds", [])))
    (folder / "report.md").write_text(
        f"# Prune\n\nCriterion `{cfg.criterion}` ({cfg.normalize}-normalized), {m['heads_removed']} of "
        f"{m['heads_total']} encoder heads removed (at least {cfg.min_heads_per_layer} kept per layer): "
        f"{m['removed']}. Encoder FLOPs per image at batch 1, `torch.utils.flop_counter`; one head costs "
        f"{m['flops_per_head'] / 1e9:.3f} GFLOPs. Accuracy on the first "
        + ", ".join(f"{v['n']} formulas of the {s} split" for s, v in m["splits"].items())
        + f" (the shift split: packages training never saw), greedy decoding capped at {m['max_length']} tokens "
        f"for every variant.\n\n{table}\n\n"
        f"The pruned model holds where exact match drops at most {cfg.em_tolerance:.3f} and CER rises at most "
        f"{cfg.cer_tolerance:.0%} (relative) against the original:\n\n{holds}\n\n"
        f"![head scores](head_scores.png)\n\n{corr}## Recovery\n\n{rec_lines or 'none'}\n\nRecovery CPU minutes (pruned model): "
        f"{rec.get('cpu_minutes', 0.0):.1f}. The saved model reloads with identical encoder outputs: "
        f"{m['reload_identical']}.\n"
        + (f"\n## Where the time went\n\n" + ", ".join(f"{k} {v:.0f} s" for k, v in m["phase_seconds"].items())
           + "\n" if m.get("phase_seconds") else ""))
