"""Tokens per formula against vocabulary size: the evidence for the default size.

The size is chosen on training data only: the tokenizer is fitted on part of the train formulas and
counted on the part held out; the chosen size is the smallest whose held-out tokens per formula are
within ``tolerance`` of the fewest on the curve (past it, more entries buy little and every entry
is one more output row the decoder must learn from fewer examples). The same curve on the eval split
and the shift split checks the choice on formulas the choice never saw.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Sequence

import numpy as np
from tqdm import tqdm

from pipeline.errors import PipelineError
from pipeline.tokenization import compare

HELD_OUT = "held-out train"


def holdout(formulas: Sequence[str], share: float, seed: int) -> tuple[list[str], list[str]]:
    """(fit, held out): a seeded hash of each formula decides, so the parts do not depend on order."""
    fit, held = [], []
    for f in formulas:
        h = int(hashlib.sha256(f"{seed}:holdout:{f}".encode()).hexdigest()[:12], 16) / float(16 ** 12)
        (held if h < share else fit).append(f)
    if not fit or not held:
        raise PipelineError(f"tokenizer.curve_holdout={share} leaves no formula to fit on or to hold out "
                            f"({len(formulas)} train formulas)")
    return fit, held


def _tokens_mean(tok, texts: Sequence[str]) -> float:
    return float(np.mean([len(e.ids) - 2 for e in tok.encode_batch(list(texts))]))  # bos, eos not counted


def vocab_curve(train: Callable[[list[str], int], object], train_all: list[str], train_fit: list[str],
                sizes: Sequence[int], eval_sets: dict[str, list[str]], char: compare.Candidate,
                tolerance: float, progress: bool = False) -> dict:
    """Tokens per formula at each vocabulary size on each set, and the size the held-out train set chooses.

    ``eval_sets[HELD_OUT]`` is counted with the tokenizer fitted on ``train_fit``; every other set
    with the one trained on ``train_all`` (what the stage ships). Sizes below the atom alphabet are
    skipped and listed."""
    char_tokens = {name: float(np.mean([len(char.segment(t)[0]) for t in texts])) for name, texts in eval_sets.items()}
    rows, skipped = [], []
    for size in tqdm(list(sizes), desc="vocabulary curve", disable=not progress):
        try:
            fitted = train(train_fit, size).tokenizer
        except PipelineError:
            skipped.append(size)  # smaller than the atom alphabet
            continue
        full = train(train_all, size).tokenizer
        row = {"size": size, "entries": full.get_vocab_size(), "tokens": {}, "commands_split": {}}
        for name, texts in eval_sets.items():
            if name == HELD_OUT:
                row["tokens"][name] = _tokens_mean(fitted, texts)
            else:
                seg = compare.segmentation_metrics(compare.hf_candidate("ours", full), texts)
                row["tokens"][name] = seg["tokens_mean"]
                row["commands_split"][name] = seg["commands_split"]
        row["reduction_vs_char"] = {n: char_tokens[n] / t for n, t in row["tokens"].items()}
        rows.append(row)
    if not rows:
        raise PipelineError(f"tokenizer.curve_sizes {list(sizes)}: every size is smaller than the atom alphabet")
    best = min(r["tokens"][HELD_OUT] for r in rows)
    chosen = min(r["size"] for r in rows if r["tokens"][HELD_OUT] <= best * (1 + tolerance))
    return {"rows": rows, "skipped_sizes": skipped, "char_tokens": char_tokens, "tolerance": tolerance,
            "held_out_formulas": len(eval_sets.get(HELD_OUT, [])), "fit_formulas": len(train_fit),
            "chosen_size": chosen}
