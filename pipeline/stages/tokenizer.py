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
from pipeline.data.corpus import Split, check_splits
from pipeline.errors import PipelineError
from pipeline.names import TOKENIZER
from pipeline.tokenization import curve, measure
from pipeline.tokenization.atoms import renderer_commands
from pipeline.tokenization.measure import CHAR_NAME, OURS_NAME, PLAIN_NAME
from pipeline.tokenization.report import write_report
from pipeline.tokenization.train import BOS, EOS, PAD, SPECIALS, UNK, train_plain_bpe

log = logging.getLogger(__name__)

NAME = "tokenizer"
CONFIG_KEY = "tokenizer"
TOKENIZER_FILE = TOKENIZER  # the BPE stage distill and export.drafter=bpe read
BASELINE_FILE = "baseline_bytelevel_bpe.json"


@dataclass
class TokenizerConfig:
    vocab_size: int = 2560              # every entry: specials, atoms, command prefixes, whole commands, merges
    min_frequency: int = 2              # a pair of units must occur this often to become a merge ...
    min_formulas: int = 2               # ... and its token in this many distinct training formulas
    max_token_atoms: Optional[int] = None  # longest learned token, in atoms (None: no cap)
    include_model_chars: bool = True    # the model's current characters join the alphabet (no new <unk>)
    renderer_commands: bool = True      # commands mathtext knows stay whole even when training lacks them
    corpus: Optional[str] = None        # train on this file (one formula per line), not the corpus split
    split: Split = Split.train          # corpus split to train on when no file is given
    eval_formulas: Optional[str] = None  # compare on this file, not the corpus split ...
    eval_split: Split = Split.eval      # ... which is this one
    shift_split: Optional[Split] = Split.shift  # also compared on formulas training never saw (null: skip) ...
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
    with ctx.output(cfg.name, asdict(cfg), inputs) as out:
        if out.reused:
            log.info(f"[tokenizer] unchanged, reused {out.path}")
            _print_summary(out.metrics)
            return out.manifest
        texts = {role: measure.normalized(source["formulas"], role) for role, source in sources.items()}
        extra = [t for t in model_vocabulary if t not in SPECIALS] if cfg.include_model_chars else []
        train = measure.trainer(cfg, extra, known)
        trained = train(texts["train"][1], cfg.vocab_size)
        # the baseline gets exactly as many entries as ours ended with (merges can run out first)
        plain = train_plain_bpe(texts["train"][1], trained.tokenizer.get_vocab_size(), min_frequency=cfg.min_frequency)
        trained.tokenizer.save(str(out.path / TOKENIZER_FILE), pretty=True)
        plain.save(str(out.path / BASELINE_FILE), pretty=True)
        write_transformers_config(out.path)
        loading = check_loading(out.path, texts["eval"][0][:50])
        cands = measure.candidates(char_tok, plain, trained.tokenizer)
        size_curve = _size_curve(cfg, ctx, train, texts, cands[0])
        metrics = measure.comparison(cfg, ctx.seed, sources, texts, trained, plain, cands, size_curve, step_ms,
                                     step_source, loading)
        out.metrics.update(metrics)
        (out.path / "comparison.json").write_text(json.dumps(metrics, indent=2, ensure_ascii=False))
        write_report(out.path, metrics, [c.name for c in cands],
                     examples=_examples(trained.tokenizer, plain, texts["eval"][1]))
    _print_summary(metrics)
    return out.manifest


def _size_curve(cfg: TokenizerConfig, ctx: StageContext, train, texts: dict, char_candidate) -> dict:
    """Tokens per formula against vocabulary size, the size chosen on held-out train formulas."""
    train_norm = texts["train"][1]
    held_fit, held_out = curve.holdout(train_norm, cfg.curve_holdout, ctx.seed)
    eval_sets = {"held-out train": held_out, "eval": texts["eval"][1]}
    if "shift" in texts:
        eval_sets["shift"] = texts["shift"][1]
    return curve.vocab_curve(train, train_norm, held_fit, sorted(set(cfg.curve_sizes) | {cfg.vocab_size}),
                             eval_sets, char_candidate, cfg.curve_tolerance, progress=ctx.progress)


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
