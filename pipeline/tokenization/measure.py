"""The tokenizer stage's steps below the stage: normalize the formula sets, train ours and the plain
BPE it is compared with, and measure the three tokenizers (segmentation, encode time, the serving
cache on a Zipf replay, the vocabulary-size curve) into the stage's metrics and targets."""
from __future__ import annotations

import logging
from typing import Callable, Optional

from pipeline.errors import PipelineError
from pipeline.tokenization import compare
from pipeline.tokenization.atoms import normalize_formula
from pipeline.tokenization.train import train_formula_bpe

log = logging.getLogger(__name__)

# the three tokenizers the stage compares, in the order its table and summary line show them
CHAR_NAME, PLAIN_NAME, OURS_NAME = "char-level (model today)", "byte-level BPE (pix2tex)", "ours: atom BPE"
CACHE_CAPACITIES = (16, 64, 256, 1024, 4096)  # the cache sweep's sizes, beside the configured one


def normalized(raw: list[str], role: str) -> tuple[list[str], list[str], int]:
    """(raw, normalized) pairs whose normalized form is not empty, and how many were dropped."""
    keep_raw, keep_norm = [], []
    for latex in raw:
        norm = normalize_formula(latex)
        if norm:
            keep_raw.append(latex)
            keep_norm.append(norm)
    dropped = len(raw) - len(keep_raw)
    if not keep_norm:
        raise PipelineError(f"no {role} formula is left once normalized (all were blank or only a math wrapper)")
    if dropped:
        log.warning(f"[tokenizer] {role}: skipped {dropped} formula(s) that are empty once normalized")
    return keep_raw, keep_norm, dropped


def trainer(cfg, extra: list[str], known: list[str]) -> Callable:
    """``train(formulas, size)``: ours with the stage's settings (the curve trains it at every size)."""
    def train(formulas: list[str], size: int):
        return train_formula_bpe(formulas, size, extra_atoms=extra, known_commands=known,
                                 min_frequency=cfg.min_frequency, max_token_atoms=cfg.max_token_atoms,
                                 min_formulas=cfg.min_formulas)
    return train


def candidates(char_tok, plain, ours) -> list:
    """The three tokenizers compared, in the table's order: char-level, plain BPE, ours."""
    return [compare.char_candidate(CHAR_NAME, char_tok), compare.hf_candidate(PLAIN_NAME, plain),
            compare.hf_candidate(OURS_NAME, ours)]


def segmentation(cands: list, raw: list[str], norm: list[str]) -> dict:
    """Each tokenizer's segmentation of ``norm``; ours also normalizes, so its round trip encodes the
    raw spelling and expects the normalized form back."""
    seg = {c.name: compare.segmentation_metrics(c, norm) for c in cands}
    seg[OURS_NAME]["round_trip_exact"] = compare.segmentation_metrics(
        cands[2], norm, expected=norm, raw=raw)["round_trip_exact"]
    return seg


def cache_replay(ours, eval_raw: list[str], capacity: int, requests: int, exponent: float, seed: int) -> tuple:
    """The serving cache on a Zipf replay of ``eval_raw``: (at ``capacity``, the capacity sweep)."""
    workload = compare.zipf_workload(eval_raw, requests, exponent, seed)
    cache = {key: compare.replay(ours, workload, capacity, key=key) for key in ("normalized", "raw")}
    capacities = sorted(set(CACHE_CAPACITIES) | {capacity})
    sweep = {key: [compare.replay(ours, workload, c, key=key, time_hits=False)["hit_rate"] for c in capacities]
             for key in ("normalized", "raw")}
    return cache, {"capacities": capacities, **sweep}


def _source_info(source: dict, formulas: int, dropped: int) -> dict:
    return {k: v for k, v in source.items() if k != "formulas"} | {"formulas": formulas,
                                                                   "empty_after_normalization": dropped}


def comparison(cfg, seed: int, sources: dict, texts: dict, trained, plain, cands: list, size_curve: dict,
               step_ms: Optional[float], step_source: str, loading: dict) -> dict:
    """The stage's metrics: ours against char-level and plain BPE on the eval set (and the shift set
    when ``texts`` has one), in decode steps and milliseconds saved, the cache, the curve, the targets."""
    ours = trained.tokenizer
    (_, train_norm, train_dropped), (eval_raw, eval_norm, eval_dropped) = texts["train"], texts["eval"]
    seg = segmentation(cands, eval_raw, eval_norm)
    times = {c.name: compare.encode_times(c, eval_raw if c is cands[2] else eval_norm, cfg.timing_repeats)
             for c in cands}
    cache, sweep = cache_replay(ours, eval_raw, cfg.cache_capacity, cfg.replay_requests, cfg.zipf_exponent, seed)
    steps = {name: s["tokens_mean"] + 1 for name, s in seg.items()}  # + eos; bos is given, not decoded
    saved = {other: steps[other] - steps[OURS_NAME] for other in (CHAR_NAME, PLAIN_NAME)}
    metrics = {
        "train": _source_info(sources["train"], len(train_norm), train_dropped),
        "eval": _source_info(sources["eval"], len(eval_norm), eval_dropped),
        "vocab_size": ours.get_vocab_size(),
        "vocab_size_configured": cfg.vocab_size,
        "alphabet_atoms": len(trained.alphabet),
        "command_prefixes": len(trained.command_prefixes),
        "whole_commands": len(trained.whole_commands),
        "learned_merges": trained.learned_merges,
        "tokenizers": {name: {**seg[name], **times[name], "decode_steps_mean": steps[name]} for name in seg},
        "reduction_vs_char": seg[CHAR_NAME]["tokens_mean"] / seg[OURS_NAME]["tokens_mean"],
        "reduction_vs_plain_bpe": seg[PLAIN_NAME]["tokens_mean"] / seg[OURS_NAME]["tokens_mean"],
        "decode_step_ms": step_ms,
        "decode_step_source": step_source,
        "decode_steps_saved_vs_char": saved[CHAR_NAME],
        "decode_steps_saved_vs_plain_bpe": saved[PLAIN_NAME],
        "decode_ms_saved_vs_char": None if step_ms is None else saved[CHAR_NAME] * step_ms,
        "decode_ms_saved_vs_plain_bpe": None if step_ms is None else saved[PLAIN_NAME] * step_ms,
        "cache": cache,
        "cache_sweep": sweep,
        "replay": {"requests": cfg.replay_requests, "zipf_exponent": cfg.zipf_exponent, "seed": seed,
                   "distinct_formulas": len(set(eval_raw))},
        "loading": loading,
        "curve": size_curve,
    }
    if "shift" in texts:
        metrics["shift"] = shift_metrics(sources["shift"], texts["shift"], cands)
    metrics["targets"] = targets(metrics, seg, size_curve, cfg.vocab_size)
    return metrics


def shift_metrics(source: dict, text: tuple, cands: list) -> dict:
    """The three tokenizers on the shift set (formulas training never saw)."""
    shift_raw, shift_norm, shift_dropped = text
    shift_seg = segmentation(cands, shift_raw, shift_norm)
    return {
        **_source_info(source, len(shift_norm), shift_dropped),
        "tokenizers": shift_seg,
        "reduction_vs_char": shift_seg[CHAR_NAME]["tokens_mean"] / shift_seg[OURS_NAME]["tokens_mean"],
        "reduction_vs_plain_bpe": shift_seg[PLAIN_NAME]["tokens_mean"] / shift_seg[OURS_NAME]["tokens_mean"],
    }


def targets(metrics: dict, seg: dict, size_curve: dict, vocab_size: int) -> dict:
    """The stage's pass/fail lines (the report's checklist)."""
    shift = metrics.get("shift")
    cache = metrics["cache"]
    return {
        "tokens >= 2.5x fewer than char-level": metrics["reduction_vs_char"] >= 2.5,
        **({} if shift is None else {
            "shift split: tokens >= 2.5x fewer than char-level": shift["reduction_vs_char"] >= 2.5,
            "shift split: 0 LaTeX commands split": shift["tokenizers"][OURS_NAME]["commands_split"] == 0,
        }),
        "vocab_size is the held-out train choice": size_curve["chosen_size"] == vocab_size,
        "fewer tokens than plain BPE": seg[OURS_NAME]["tokens_mean"] < seg[PLAIN_NAME]["tokens_mean"],
        "0 LaTeX commands split": seg[OURS_NAME]["commands_split"] == 0,
        "round trip 100 %": seg[OURS_NAME]["round_trip_exact"] == 1.0,
        "cached encode <= 0.05 ms": cache["normalized"]["ms_per_request"] <= 0.05,
        "cache hit rate >= 95 %": cache["normalized"]["hit_rate"] >= 0.95,
    }
