"""Stage tokenizer: a formula-aware BPE that keeps LaTeX atoms whole, compared with char-level and plain BPE.

Trains on the corpus train split (default) or ``tokenizer.corpus=FILE`` (one formula per line), and
compares on the corpus eval split (default) or ``tokenizer.eval_formulas=FILE``, and on the shift split
(formulas from packages training never saw; or ``tokenizer.shift_formulas=FILE``). A curve of tokens
per formula against vocabulary size, on held-out train formulas and on both eval sets, is the
evidence for the default size; the size is chosen on the held-out train formulas only. Writes
``tokenizer.json`` + ``tokenizer_config.json`` (load in ``tokenizers`` and in
``transformers.PreTrainedTokenizerFast.from_pretrained(folder)``), the
baseline BPE it was compared with, ``comparison.json``, ``report.md`` and a PNG plot.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

from pipeline import files
from pipeline.artifacts import sha256_json
from pipeline.context import StageContext, file_hash
from pipeline.data.corpus import check_splits
from pipeline.errors import PipelineError
from pipeline.tokenization import compare, curve
from pipeline.tokenization.atoms import normalize_formula, renderer_commands
from pipeline.tokenization.report import write_report
from pipeline.tokenization.train import BOS, EOS, PAD, SPECIALS, UNK, train_formula_bpe, train_plain_bpe

log = logging.getLogger(__name__)

NAME = "tokenizer"
CONFIG_KEY = "tokenizer"
TOKENIZER_FILE = "tokenizer.json"
BASELINE_FILE = "baseline_bytelevel_bpe.json"
# the three tokenizers the stage compares, in the order its table and summary line show them
CHAR_NAME, PLAIN_NAME, OURS_NAME = "char-level (model today)", "byte-level BPE (pix2tex)", "ours: atom BPE"


@dataclass
class TokenizerConfig:
    vocab_size: int = 2560              # every entry: specials, atoms, command prefixes, whole commands, merges
    min_frequency: int = 2              # a pair of units must occur this often to become a merge ...
    min_formulas: int = 2               # ... and its token in this many distinct training formulas
    max_token_atoms: Optional[int] = None  # longest learned token, in atoms (None: no cap)
    include_model_chars: bool = True    # the model's current characters join the alphabet (no new <unk>)
    renderer_commands: bool = True      # commands mathtext knows stay whole even when training lacks them
    corpus: Optional[str] = None        # train on this file (one formula per line), not the corpus split
    split: str = "train"                # corpus split to train on when no file is given
    eval_formulas: Optional[str] = None  # compare on this file, not the corpus split ...
    eval_split: str = "eval"            # ... which is this one
    shift_split: Optional[str] = "shift"  # also compared on formulas training never saw (null: skip) ...
    shift_formulas: Optional[str] = None  # ... or on this file instead
    curve_sizes: List[int] = field(default_factory=lambda: [1536, 1792, 2048, 2560, 3072, 4096])
    curve_holdout: float = 0.2          # share of train formulas held out to choose the size on
    curve_tolerance: float = 0.05       # chosen size: the smallest within this of the fewest held-out tokens
    cache_capacity: int = 2048          # formulas held by the serving LRU cache
    replay_requests: int = 50000        # requests in the Zipf replay workload
    zipf_exponent: float = 1.1          # P(k-th most frequent formula) ~ 1/k^s
    timing_repeats: int = 3             # encode timings: best of this many passes
    decode_step_ms: Optional[float] = None  # ms per decoder step; None: stage evaluate's measurement if any
    name: str = "tokenizer"             # artifact folder


Config = TokenizerConfig


def read_formula_file(path_str: str, option: str) -> tuple[list[str], dict]:
    """Formulas of a one-per-line UTF-8 file (:func:`pipeline.files.read_formulas`: a file that is
    not UTF-8 is one error line, as for every stage)."""
    lines = files.read_formulas(path_str, f"tokenizer.{option}")
    return [ln for _, ln in lines], {"file": str(path_str)}


def load_formulas(cfg: TokenizerConfig, ctx: StageContext) -> tuple[dict, dict]:
    """Raw train and eval formulas with where they came from, and the input hashes."""
    sources, inputs = {}, {}
    roles = [("train", "corpus", cfg.split), ("eval", "eval_formulas", cfg.eval_split)]
    if cfg.shift_formulas or cfg.shift_split:
        roles.append(("shift", "shift_formulas", cfg.shift_split))
    for role, option, split in roles:
        path = getattr(cfg, option)
        if path:
            formulas, info = read_formula_file(path, option)
            inputs[role] = file_hash(path)
            sources[role] = {"formulas": formulas, "source": f"file {path}", **info}
        else:
            formulas = [f.latex for f in ctx.split(split)]
            inputs[role] = ctx.split_hash(split)
            sources[role] = {"formulas": formulas, "source": f"{'shift' if split == 'shift' else 'corpus'} split '{split}'"}
    return sources, inputs


def validate(cfg: TokenizerConfig) -> None:
    if cfg.vocab_size < len(SPECIALS) + 1:
        raise PipelineError(f"tokenizer.vocab_size must be positive and hold the special tokens, got {cfg.vocab_size}")
    for key, split, own_file in (("split", cfg.split, cfg.corpus), ("eval_split", cfg.eval_split, cfg.eval_formulas),
                                 ("shift_split", cfg.shift_split, cfg.shift_formulas)):
        if split is not None and not own_file:
            check_splits(f"tokenizer.{key}", split)
    if cfg.split == "shift" and not cfg.corpus:
        raise PipelineError("tokenizer.split=shift: the shift split is for measuring only, never for training")
    if cfg.min_formulas < 1:
        raise PipelineError(f"tokenizer.min_formulas must be at least 1, got {cfg.min_formulas}")
    if not 0 < cfg.curve_holdout < 1:
        raise PipelineError(f"tokenizer.curve_holdout={cfg.curve_holdout} not in (0, 1)")
    if cfg.curve_tolerance < 0:
        raise PipelineError(f"tokenizer.curve_tolerance must be >= 0, got {cfg.curve_tolerance}")
    if cfg.min_frequency < 1:
        raise PipelineError(f"tokenizer.min_frequency must be at least 1, got {cfg.min_frequency}")
    if cfg.max_token_atoms is not None and cfg.max_token_atoms < 2:
        raise PipelineError(f"tokenizer.max_token_atoms must be at least 2 (or null), got {cfg.max_token_atoms}")
    if cfg.cache_capacity < 1:
        raise PipelineError(f"tokenizer.cache_capacity must be at least 1, got {cfg.cache_capacity}")
    if cfg.replay_requests < 1 or cfg.timing_repeats < 1:
        raise PipelineError("tokenizer.replay_requests and tokenizer.timing_repeats must be at least 1")
    if cfg.zipf_exponent <= 0:
        raise PipelineError(f"tokenizer.zipf_exponent must be positive, got {cfg.zipf_exponent}")
    if cfg.decode_step_ms is not None and cfg.decode_step_ms <= 0:
        raise PipelineError(f"tokenizer.decode_step_ms must be positive, got {cfg.decode_step_ms}")


def _normalized(raw: list[str], role: str) -> tuple[list[str], list[str], int]:
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


def resolve_decode_step_ms(cfg: TokenizerConfig, ctx: StageContext) -> tuple[Optional[float], str]:
    """The cost of one decoder step: the config, else stage evaluate's batch-1 measurement, else unknown.

    It is not measured here: on a shared CPU one measurement takes minutes and swings tenfold with
    the load, while decode steps saved (the machine-independent figure) need no model at all."""
    if cfg.decode_step_ms is not None:
        return float(cfg.decode_step_ms), "tokenizer.decode_step_ms"
    try:
        lat = ctx.upstream("evaluate")["metrics"]["latency_batch1"]
        return float(lat["decoder_ms_per_step"]), f"stage evaluate's batch-1 measurement ({ctx.artifacts_dir / 'evaluate'})"
    except (PipelineError, KeyError, TypeError):
        return None, "unknown: run stage=evaluate first or set tokenizer.decode_step_ms"


def run(cfg: TokenizerConfig, ctx: StageContext) -> dict:
    validate(cfg)
    sources, inputs = load_formulas(cfg, ctx)
    char_tok, model_vocabulary = ctx.model_tokenizer("original")
    inputs["model_vocabulary"] = ctx.model_hash("original")
    known = renderer_commands() if cfg.renderer_commands else []
    inputs["renderer_commands"] = sha256_json(known)  # matplotlib's tables may change between versions
    # read here, not after the reuse check: a new evaluate measurement is a changed input
    step_ms, step_source = resolve_decode_step_ms(cfg, ctx)
    inputs["decode_step_ms"] = f"{step_ms} ({step_source})"
    config = asdict(cfg)
    with ctx.output(cfg.name, config, inputs) as out:
        if out.reused:
            log.info(f"[tokenizer] unchanged, reused {out.path}")
            _print_summary(out.metrics)
            return out.manifest
        train_raw, train_norm, train_dropped = _normalized(sources["train"]["formulas"], "train")
        eval_raw, eval_norm, eval_dropped = _normalized(sources["eval"]["formulas"], "eval")
        shift = _normalized(sources["shift"]["formulas"], "shift") if "shift" in sources else None
        extra = [t for t in model_vocabulary if t not in SPECIALS] if cfg.include_model_chars else []

        def train(formulas: list[str], size: int):
            return train_formula_bpe(formulas, size, extra_atoms=extra, known_commands=known,
                                     min_frequency=cfg.min_frequency, max_token_atoms=cfg.max_token_atoms,
                                     min_formulas=cfg.min_formulas)
        trained = train(train_norm, cfg.vocab_size)
        ours = trained.tokenizer
        # the baseline gets exactly as many entries as ours ended with (merges can run out first)
        plain = train_plain_bpe(train_norm, ours.get_vocab_size(), min_frequency=cfg.min_frequency)
        ours.save(str(out.path / TOKENIZER_FILE), pretty=True)
        plain.save(str(out.path / BASELINE_FILE), pretty=True)
        write_transformers_config(out.path)
        loading = check_loading(out.path, eval_raw[:50])

        cands = [compare.char_candidate(CHAR_NAME, char_tok), compare.hf_candidate(PLAIN_NAME, plain),
                 compare.hf_candidate(OURS_NAME, ours)]
        seg = {c.name: compare.segmentation_metrics(c, eval_norm) for c in cands}
        # ours also normalizes: encode the raw spelling, expect its normalized form back
        seg[OURS_NAME]["round_trip_exact"] = compare.segmentation_metrics(
            cands[2], eval_norm, expected=eval_norm, raw=eval_raw)["round_trip_exact"]
        times = {c.name: compare.encode_times(c, eval_raw if c is cands[2] else eval_norm, cfg.timing_repeats)
                 for c in cands}
        workload = compare.zipf_workload(eval_raw, cfg.replay_requests, cfg.zipf_exponent, ctx.seed)
        cache = {key: compare.replay(ours, workload, cfg.cache_capacity, key=key) for key in ("normalized", "raw")}
        capacities = sorted({16, 64, 256, 1024, 4096, cfg.cache_capacity})
        sweep = {key: [compare.replay(ours, workload, c, key=key, time_hits=False)["hit_rate"] for c in capacities]
                 for key in ("normalized", "raw")}

        held_fit, held_out = curve.holdout(train_norm, cfg.curve_holdout, ctx.seed)
        eval_sets = {"held-out train": held_out, "eval": eval_norm}
        if shift is not None:
            eval_sets["shift"] = shift[1]
        size_curve = curve.vocab_curve(train, train_norm, held_fit, sorted(set(cfg.curve_sizes) | {cfg.vocab_size}),
                                       eval_sets, cands[0], cfg.curve_tolerance, progress=ctx.progress)
        steps = {name: s["tokens_mean"] + 1 for name, s in seg.items()}  # + eos; bos is given, not decoded
        metrics = {
            "train": {k: v for k, v in sources["train"].items() if k != "formulas"}
            | {"formulas": len(train_norm), "empty_after_normalization": train_dropped},
            "eval": {k: v for k, v in sources["eval"].items() if k != "formulas"}
            | {"formulas": len(eval_norm), "empty_after_normalization": eval_dropped},
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
            "decode_steps_saved_vs_char": steps[CHAR_NAME] - steps[OURS_NAME],
            "decode_steps_saved_vs_plain_bpe": steps[PLAIN_NAME] - steps[OURS_NAME],
            "decode_ms_saved_vs_char": None if step_ms is None else (steps[CHAR_NAME] - steps[OURS_NAME]) * step_ms,
            "decode_ms_saved_vs_plain_bpe": None if step_ms is None else (steps[PLAIN_NAME] - steps[OURS_NAME]) * step_ms,
            "cache": cache,
            "cache_sweep": {"capacities": capacities, **sweep},
            "replay": {"requests": cfg.replay_requests, "zipf_exponent": cfg.zipf_exponent, "seed": ctx.seed,
                       "distinct_formulas": len(set(eval_raw))},
            "loading": loading,
            "curve": size_curve,
        }
        if shift is not None:
            shift_raw, shift_norm, shift_dropped = shift
            shift_seg = {c.name: compare.segmentation_metrics(c, shift_norm) for c in cands}
            shift_seg[OURS_NAME]["round_trip_exact"] = compare.segmentation_metrics(
                cands[2], shift_norm, expected=shift_norm, raw=shift_raw)["round_trip_exact"]
            metrics["shift"] = {
                **{k: v for k, v in sources["shift"].items() if k != "formulas"},
                "formulas": len(shift_norm), "empty_after_normalization": shift_dropped,
                "tokenizers": shift_seg,
                "reduction_vs_char": shift_seg[CHAR_NAME]["tokens_mean"] / shift_seg[OURS_NAME]["tokens_mean"],
                "reduction_vs_plain_bpe": shift_seg[PLAIN_NAME]["tokens_mean"] / shift_seg[OURS_NAME]["tokens_mean"],
            }
        metrics["targets"] = {
            "tokens >= 2.5x fewer than char-level": metrics["reduction_vs_char"] >= 2.5,
            **({} if shift is None else {
                "shift split: tokens >= 2.5x fewer than char-level": metrics["shift"]["reduction_vs_char"] >= 2.5,
                "shift split: 0 LaTeX commands split": metrics["shift"]["tokenizers"][OURS_NAME]["commands_split"] == 0,
            }),
            "vocab_size is the held-out train choice": size_curve["chosen_size"] == cfg.vocab_size,
            "fewer tokens than plain BPE": seg[OURS_NAME]["tokens_mean"] < seg[PLAIN_NAME]["tokens_mean"],
            "0 LaTeX commands split": seg[OURS_NAME]["commands_split"] == 0,
            "round trip 100 %": seg[OURS_NAME]["round_trip_exact"] == 1.0,
            "cached encode <= 0.05 ms": cache["normalized"]["ms_per_request"] <= 0.05,
            "cache hit rate >= 95 %": cache["normalized"]["hit_rate"] >= 0.95,
        }
        out.metrics.update(metrics)
        (out.path / "comparison.json").write_text(json.dumps(metrics, indent=2, ensure_ascii=False))
        write_report(out.path, metrics, [c.name for c in cands], examples=_examples(ours, plain, eval_norm))
    _print_summary(metrics)
    return out.manifest


def write_transformers_config(folder: Path) -> None:
    """``tokenizer_config.json`` beside ``tokenizer.json`` (special tokens named), so that
    ``PreTrainedTokenizerFast.from_pretrained(folder)`` and ``AutoTokenizer`` load the folder."""
    import shutil
    import tempfile

    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_file=str(folder / TOKENIZER_FILE), bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, unk_token=UNK)
    with tempfile.TemporaryDirectory() as tmp:  # only its config: tokenizer.json stays ours, byte for byte
        fast.save_pretrained(tmp)
        shutil.copyfile(Path(tmp) / "tokenizer_config.json", folder / "tokenizer_config.json")


def check_loading(folder: Path, sample: list[str]) -> dict:
    """Load the written folder with ``tokenizers`` and ``transformers``; all must encode alike."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    direct = Tokenizer.from_file(str(folder / TOKENIZER_FILE))
    fast = PreTrainedTokenizerFast.from_pretrained(str(folder))
    for x in sample:
        ids = fast(x)["input_ids"]
        if ids != direct.encode(x).ids or fast.decode(ids, skip_special_tokens=True) != direct.decode(ids):
            raise PipelineError(f"{folder}: transformers and tokenizers disagree on {x!r}")
    return {"tokenizers": True, "transformers_fast": True, "checked_formulas": len(sample)}


def _examples(ours, plain, texts: list[str], k: int = 6) -> list[tuple[str, list[str], list[str]]]:
    picked = sorted(texts, key=lambda t: (-len(set(t)), t))[:k]  # varied formulas, deterministic pick
    return [(t, [t[s:e] for s, e in ours.encode(t).offsets[1:-1]],
             [t[s:e] for s, e in plain.encode(t).offsets[1:-1]]) for t in picked]


def _print_summary(m: dict) -> None:
    rows = m["tokenizers"]  # a reused manifest comes back with its keys sorted: print in the table's order
    parts = [f"{name}: {rows[name]['tokens_mean']:.1f} tok/formula, split {rows[name]['commands_split_share']:.1%}, "
             f"round trip {rows[name]['round_trip_exact']:.1%}" for name in (CHAR_NAME, PLAIN_NAME, OURS_NAME)]
    c = m["cache"]["normalized"]
    saved = m["decode_ms_saved_vs_char"]
    ms = "" if saved is None else f" = {saved:.0f} ms at {m['decode_step_ms']:.1f} ms/step"
    log.info("[tokenizer] " + " | ".join(parts))
    sh = m.get("shift")
    if sh:
        log.info(f"[tokenizer] shift split ({sh['formulas']} formulas): {sh['reduction_vs_char']:.2f}x fewer tokens "
                 f"than char-level, {sh['tokenizers'][OURS_NAME]['commands_split']} commands split")
    cv = m.get("curve")
    if cv:
        log.info(f"[tokenizer] held-out train curve chooses vocab {cv['chosen_size']} "
                 f"(tolerance {cv['tolerance']:.0%}); configured {m['vocab_size_configured']}")
    log.info(f"[tokenizer] vocab {m['vocab_size']}; {m['reduction_vs_char']:.2f}x fewer tokens than char-level"
             f"{' on the eval split' if sh else ''}, "
             f"{m['reduction_vs_plain_bpe']:.2f}x fewer than plain BPE; saves {m['decode_steps_saved_vs_char']:.1f} "
             f"decode steps{ms} per formula; cache hit rate {c['hit_rate']:.1%}, "
             f"{c['ms_per_request'] * 1000:.1f} us/request")
