"""The distill stage's readings and report: exact match, CER and decode steps of the char model and
the BPE student on the first eval formulas, the learning curve, ``predictions.jsonl`` and ``report.md``."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from pipeline import metrics as M
from pipeline.reports import markdown_table, savefig


def read(adapter, memory: torch.Tensor, truths: list[str], max_length: int, batch: int, texts: bool = True) -> dict:
    """Greedy readings (KV cache) of cached encoder outputs, scored against ``truths``; with ``texts``
    the readings themselves under "texts"."""
    result = adapter.generate(memory, max_length, batch_size=batch, use_cache=True, encoded=True)
    n = len(truths)
    row = {"exact_match": sum(M.exact_match(p, t) for p, t in zip(result.texts, truths)) / n,
           "cer": M.corpus_cer(result.texts, truths), "steps_per_formula": sum(result.steps) / n,
           "hit_cap_share": sum(result.hit_cap) / n, "decoder_seconds": result.decoder_seconds}
    return {**row, "texts": result.texts} if texts else row


def stage_metrics(m: dict, trained: dict, char_row: dict, final: dict, memory, steps_planned: int,
                  started: float) -> dict:
    """The manifest's metrics: ``m`` (model, tokenizer, targets ...) with the training's and both
    readings' figures, and the stage's minutes since ``started`` (``time.perf_counter``)."""
    kept = memory.kept
    char = {k: v for k, v in char_row.items() if k != "texts"}
    bpe = {k: v for k, v in final.items() if k != "texts"}
    return {
        **m,
        "train_images": len(kept),
        "train_from_split": len([k for k in kept if not k[0].startswith(("templated-", "varied-"))]),
        "train_varied": len([k for k in kept if k[0].startswith("varied-")]),
        "eval_images": len(memory.kept_eval), "encoder_cache_seconds": memory.seconds,
        "encoder_cache_reused": memory.train_reused,
        "steps": trained["steps"], "steps_planned": steps_planned, "stopped_by": trained["stopped_by"],
        "training_minutes": trained["minutes"], "resumed_at": trained["resumed_at"],
        "final_loss": trained["losses"][-1] if trained["losses"] else None,
        "char": char, "bpe": bpe,
        "steps_ratio": char["steps_per_formula"] / max(bpe["steps_per_formula"], 1e-9),
        "decoder_time_ratio": char["decoder_seconds"] / max(bpe["decoder_seconds"], 1e-9),
        "exact_match_points": 100 * (bpe["exact_match"] - char["exact_match"]),
        "curve": trained["curve"], "stage_minutes": (time.perf_counter() - started) / 60,
    }


def write_outputs(folder: Path, m: dict, config: dict, kept_eval: list[tuple[str, str]], char_row: dict,
                  final: dict) -> None:
    """The learning curve's plot, both decoders' readings (``predictions.jsonl``) and ``report.md``."""
    plot_curve(folder / "learning_curve.png", m["curve"], char_row, len(kept_eval))
    with open(folder / "predictions.jsonl", "w", encoding="utf-8") as f:
        for (fid, truth), c, s in zip(kept_eval, char_row["texts"], final["texts"]):
            f.write(json.dumps({"id": fid, "truth": truth, "char": c, "bpe": s}, ensure_ascii=False) + "\n")
    write_report(folder, m, config)


def plot_curve(path: Path, curve: list[dict], char: dict, n: int) -> None:
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    minutes = [p["minutes"] for p in curve]
    a.plot(minutes, [p["exact_match"] for p in curve], "o-", label="BPE student")
    a.axhline(char["exact_match"], color="grey", ls="--", label="char model")
    a.set_xlabel("training minutes")
    a.set_ylabel("exact match")
    a.legend()
    b.plot(minutes, [p["cer"] for p in curve], "o-", label="BPE student")
    b.axhline(char["cer"], color="grey", ls="--", label="char model")
    b.set_xlabel("training minutes")
    b.set_ylabel("CER")
    fig.suptitle(f"first {n} eval formulas, greedy, KV cache")
    savefig(fig, path)


def write_report(folder: Path, m: dict, config: dict) -> None:
    c, s = m["char"], m["bpe"]
    rows = [["char model", f"{c['exact_match']:.3f}", f"{c['cer']:.3f}", f"{c['steps_per_formula']:.1f}",
             f"{c['hit_cap_share']:.2f}", f"{c['decoder_seconds']:.2f}"],
            ["BPE student", f"{s['exact_match']:.3f}", f"{s['cer']:.3f}", f"{s['steps_per_formula']:.1f}",
             f"{s['hit_cap_share']:.2f}", f"{s['decoder_seconds']:.2f}"]]
    curve = [[p["step"], f"{p['minutes']:.1f}", "" if p["loss"] is None else f"{p['loss']:.3f}",
              f"{p['exact_match']:.3f}", f"{p['cer']:.3f}", f"{p['steps_per_formula']:.1f}"] for p in m["curve"]]
    resumed = f" (resumed from the checkpoint at step {m['resumed_at']})" if m["resumed_at"] else ""
    stop = "the step budget" if m["stopped_by"] == "steps" else \
        f"the {config['minutes']} min cap (the weights then depend on the machine's speed)"
    text = [
        "# Stage distill: a BPE decoder from the char model", "",
        f"Student of `{m['model']}` with the BPE `{m['tokenizer']}` ({m['vocab_size']} entries). Trained on "
        f"{m['train_images']} rendered formulas ({m['train_from_split']} from the train split, "
        f"{m['train_images'] - m['train_from_split'] - m.get('train_varied', 0)} templated, "
        f"{m.get('train_varied', 0)} from the varied grammar), encoder "
        f"frozen (outputs cached fp16: {m['encoder_cache_seconds']:.0f} s"
        f"{', reused' if m['encoder_cache_reused'] else ''}), {m['steps']} of {m['steps_planned']} steps in "
        f"{m['training_minutes']:.1f} training minutes, stopped by {stop}{resumed}; this process took "
        f"{m['stage_minutes']:.1f} min. Targets: "
        + ("the formulas." if m.get("targets", "truth") == "truth" else
           f"the char model's readings where they differ from the formula ({m['targets_from_teacher']} of "
           f"{m['train_images']} images; elsewhere the formula)."), "",
        f"## First {m['eval_images']} eval formulas (torch, KV cache, greedy)", "",
        markdown_table(["decoder", "exact match", "CER", "steps / formula", "stopped at cap", "decoder s (all)"], rows),
        "",
        f"{m['steps_ratio']:.1f}x fewer decoder steps, {m['decoder_time_ratio']:.1f}x less torch decoder time, "
        f"{m['exact_match_points']:+.1f} points exact match on these {m['eval_images']} formulas. The whole "
        "eval split in the ORT package: `stage=export export.model=distill`, then the benchmark (docs/distill.md).",
        "", "## Learning curve", "", "![learning curve](learning_curve.png)", "",
        markdown_table(["step", "minutes", "loss", "exact match", "CER", "steps / formula"], curve), "",
        "`predictions.jsonl`: both decoders' readings of these formulas.", "",
    ]
    (folder / "report.md").write_text("\n".join(text))
