"""Stage tokenizer: atom integrity, round trip, loading in transformers, the cache, bad input.

Small in-test formula lists keep this fast; the real corpus is only used by the stage itself in
``python -m pipeline stage=tokenizer`` (and the benchmark script), never here.
"""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from conftest import make_ctx, run_cli
from pipeline.errors import PipelineError
from pipeline.tokenization.atoms import atoms, command_spans, normalize_formula, renderer_commands
from pipeline.tokenization.compare import char_candidate, hf_candidate, segmentation_metrics, split_commands
from pipeline.tokenization.serving import CachedEncoder
from pipeline.adapters.latex_ocr_junia import char_vocabulary as model_char_vocabulary
from pipeline.tokenization.train import SPECIALS, train_formula_bpe, train_plain_bpe

TRAIN = [
    r"\frac{a}{b} + \frac{c}{d}", r"x^{2} + y^{2} = z^{2}", r"\alpha_{i} + \beta_{j}", r"\sum_{i=0}^{n} x_{i}^{2}",
    r"\int_0^1 f(x)\,dx", r"\left(\frac{1}{2}\right)^{n}", r"e^{i\pi} + 1 = 0", r"\sqrt{x^{2} + y^{2}}",
    r"\mathrm{d}x \, \mathrm{d}y", r"\frac{\partial f}{\partial x}", r"a_{ij} = a_{ji}", r"\sigma^{2} = E[x^{2}]",
    r"\lambda_{1} \geq \lambda_{2}", r"\|x\|_{2} \leq 1", r"p(x) = \frac{1}{\sqrt{2\pi}} e^{-x^{2}/2}",
    r"\prod_{k=1}^{n} k = n!", r"\log(1 + x) \approx x", r"\{x \in \mathbb{R} : x > 0\}", r"A^{-1} A = I",
    r"\cos^{2}\theta + \sin^{2}\theta = 1", r"\alpha_{\beta^{2}}", r"f(x) = \max(0, x)", r"y_{i} = w^T x_{i} + b",
] * 3
HARD = [r"\alpha_{\beta^{2}}", r"\left(\frac{a}{b}\right)", r"a \, b", r"\,", r"\frac{\alpha}{\beta}\,\gamma",
        r"\\\alpha", r"x\ y", r"\{a\}", r"\nabla \cdot \vec{v}", r"\oplus_{i} V_{i}", r"\infty\int"]


@pytest.fixture(scope="module")
def trained():
    extra = [t for t in model_char_vocabulary().token_to_id if t not in SPECIALS]
    return train_formula_bpe([normalize_formula(f) for f in TRAIN], 1400, extra_atoms=extra,
                             known_commands=renderer_commands())


def boundaries(enc) -> set[int]:
    spans = [o for o, s in zip(enc.offsets, enc.special_tokens_mask) if not s]
    return {a for a, _ in spans} | {b for _, b in spans}


# ---- atoms and normalization -----------------------------------------------------------------
def test_atom_grammar_reads_latex_like_tex():
    assert atoms(r"\alpha_{\beta^{2}}") == ["\\alpha", "_", "{", "\\beta", "^", "{", "2", "}", "}"]
    assert atoms(r"\\\alpha\,x") == ["\\\\", "\\alpha", "\\,", "x"]  # line break, then \alpha
    assert atoms("a\\") == ["a", "\\"]  # a lone trailing backslash is kept, not dropped
    assert [r"\left(\frac{a}{b}\right)"[s:e] for s, e in command_spans(r"\left(\frac{a}{b}\right)")] == \
        ["\\left", "\\frac", "\\right"]


@pytest.mark.parametrize("raw, normalized", [
    ("$$ a +  b $$", "a + b"),
    ("\\[ x^{2}\n\t+ 1 \\]", "x^{2} + 1"),
    ("\\begin{equation*} E = mc^2 \\end{equation*}", "E = mc^2"),
    ("$x$", "x"),
    ("a = 5\\$", "a = 5\\$"),       # an escaped dollar is content, not a wrapper
    ("x\\ ", "x\\ "),               # a trailing control space stays
    ("\\left( a \\right)", "\\left( a \\right)"),  # layout commands stay: the model must emit them
])
def test_normalization_strips_wrapper_and_collapses_whitespace(raw, normalized):
    assert normalize_formula(raw) == normalized


# ---- integrity and round trip --------------------------------------------------------------------
@pytest.mark.parametrize("formula", HARD)
def test_no_command_is_split_on_hard_cases(trained, formula):
    tok = trained.tokenizer
    text = normalize_formula(formula)
    enc = tok.encode(text)
    cuts = boundaries(enc)
    for s, e in command_spans(text):
        assert not any(s < b < e for b in cuts), f"{text[s:e]!r} cut in {enc.tokens}"
    assert "<unk>" not in enc.tokens
    assert tok.decode(enc.ids) == text


def test_random_atom_strings_keep_known_commands_whole_and_round_trip(trained):
    """2000 seeded random concatenations of known commands (alphabet, prefixes, renderer table),
    line breaks, control spaces, dollars, spaces and characters: no known command is ever cut."""
    import random

    tok = trained.tokenizer
    known = {a for a in tok.get_vocab() if a.startswith("\\") and atoms(a) == [a]} | set(trained.whole_commands)
    pool = sorted(known | set("abxyz{}^_()[]+-=,.0129 |'!") | {"\\\\", "\\ ", "\\$", "$", "  "})
    rng = random.Random(0)
    for _ in range(2000):
        x = "".join(rng.choice(pool) for _ in range(rng.randint(1, 12)))
        text = normalize_formula(x)
        enc = tok.encode(text)
        cuts = boundaries(enc)
        cut = [text[s:e] for s, e in command_spans(text) if text[s:e] in known and any(s < b < e for b in cuts)]
        assert not cut, (x, enc.tokens)
        assert tok.decode(tok.encode(x).ids) == text, x


def test_merges_join_atoms_into_larger_units(trained):
    tok = trained.tokenizer
    vocab = tok.get_vocab()
    assert trained.learned_merges > 50
    # units of several atoms exist and are used, each one a sequence of whole atoms
    assert {"^{2}", "\\frac{"} <= set(vocab)
    tokens = tok.encode(r"x^{2} + \frac{a}{b}").tokens
    assert any(len(atoms(t)) > 2 for t in tokens), tokens
    assert len(tokens) - 2 < len(atoms(r"x^{2} + \frac{a}{b}")) / 2


def test_renderer_commands_stay_whole_without_training_examples(trained):
    assert "\\nabla" not in "".join(TRAIN) and "\\nabla" in trained.whole_commands
    tokens = trained.tokenizer.encode(r"\nabla f + \oplus").tokens
    assert "\\nabla" in tokens and "\\oplus" in tokens
    # a line break followed by letters is not \nabla one character late
    tokens = trained.tokenizer.encode(r"a \\nabla").tokens
    assert "\\\\" in tokens and "\\nabla" not in tokens


def test_round_trip_returns_the_normalized_formula(trained):
    tok = trained.tokenizer
    raw = TRAIN[:23] + [f"$ {f} $" for f in HARD] + ["\\[ a\n+\tb \\]", "\\text{a  b}", "é + ü"]
    for x in raw:
        assert tok.decode(tok.encode(x).ids) == normalize_formula(x), x
    # a character neither the training formulas nor the model's vocabulary has is <unk>: the round
    # trip loses it (the report counts such formulas), it is never silently dropped from the ids
    enc = tok.encode("a \\leq ≤ b")
    assert "<unk>" in enc.tokens and tok.decode(enc.ids) != normalize_formula("a \\leq ≤ b")


def test_plain_bpe_splits_commands_and_ours_does_not(trained):
    texts = [normalize_formula(f) for f in TRAIN[:23]]
    plain = train_plain_bpe(texts, trained.tokenizer.get_vocab_size())
    ours = segmentation_metrics(hf_candidate("ours", trained.tokenizer), texts)
    base = segmentation_metrics(hf_candidate("plain", plain), texts)
    chars = segmentation_metrics(char_candidate("char", model_char_vocabulary()), texts)
    assert ours["commands_split"] == 0 and ours["round_trip_exact"] == 1.0
    assert base["commands_split"] > 0 and chars["commands_split"] == chars["commands"] > 0
    assert ours["tokens_mean"] < base["tokens_mean"] < chars["tokens_mean"]


def test_split_commands_counts_cut_commands():
    assert split_commands(r"\alpha+b", [(0, 6), (6, 7), (7, 8)]) == (0, 1)
    assert split_commands(r"\alpha+b", [(0, 1), (1, 6), (6, 8)]) == (1, 1)


# ---- artifact loading -------------------------------------------------------------------------------
def test_tokenizer_json_loads_in_tokenizers_and_transformers(trained, tmp_path):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    path = tmp_path / "tokenizer.json"
    trained.tokenizer.save(str(path), pretty=True)
    direct = Tokenizer.from_file(str(path))
    fast = PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")
    for x in HARD + ["$ x^{2} $"]:
        ids = fast(x)["input_ids"]
        assert ids == direct.encode(x).ids == trained.tokenizer.encode(x).ids
        assert ids[0] == fast.bos_token_id == 1 and ids[-1] == fast.eos_token_id == 2
        assert fast.decode(ids, skip_special_tokens=True) == normalize_formula(x)
    batch = fast(HARD, padding=True)["input_ids"]
    assert len({len(b) for b in batch}) == 1 and fast.pad_token_id == 0


def test_same_data_gives_byte_identical_tokenizer_json(trained):
    again = train_formula_bpe([normalize_formula(f) for f in TRAIN], 1400,
                              extra_atoms=[t for t in model_char_vocabulary().token_to_id if t not in SPECIALS],
                              known_commands=renderer_commands())
    assert again.tokenizer.to_str(pretty=True) == trained.tokenizer.to_str(pretty=True)


def test_min_formulas_drops_merges_only_one_formula_uses():
    lone = r"\zeta\varpi \zeta\varpi \zeta\varpi \zeta\varpi"  # frequent pair, but in one formula only
    formulas = [normalize_formula(f) for f in TRAIN] + [lone]
    per_occurrence = train_formula_bpe(formulas, 1400, known_commands=renderer_commands(), min_formulas=1)
    per_formula = train_formula_bpe(formulas, 1400, known_commands=renderer_commands(), min_formulas=2)
    assert "\\zeta\\varpi" in per_occurrence.tokenizer.get_vocab()
    assert "\\zeta\\varpi" not in per_formula.tokenizer.get_vocab()
    assert per_formula.learned_merges > 0 and "^{2}" in per_formula.tokenizer.get_vocab()
    # every learned token occurs in at least two training formulas
    inv = per_formula.tokenizer.get_vocab()
    learned = [t for t in inv if inv[t] >= len(inv) - per_formula.learned_merges - len(per_formula.whole_commands)
               and t not in per_formula.whole_commands]
    assert learned and all(sum(t.strip() in f for f in formulas) >= 2 for t in learned)


def test_vocab_smaller_than_alphabet_is_refused():
    with pytest.raises(PipelineError, match=r"smaller than the atom alphabet: .* use at least \d+"):
        train_formula_bpe([normalize_formula(f) for f in TRAIN], 100, known_commands=renderer_commands())


# ---- serving cache ------------------------------------------------------------------------------------
def test_cache_is_keyed_by_the_normalized_formula(trained):
    tok = trained.tokenizer
    enc = CachedEncoder(tok, capacity=2)
    first = enc.encode("x^{2}")
    assert enc.encode("$x^{2}$") == first == tuple(tok.encode("x^{2}").ids)
    assert enc.encode("\\[  x^{2} \\]") == first
    assert (enc.stats.hits, enc.stats.misses) == (2, 1)
    enc.encode("a")
    enc.encode("b")          # capacity 2: x^{2} is the least recently used and goes
    enc.encode("x^{2}")
    assert (enc.stats.hits, enc.stats.misses, enc.stats.evictions) == (2, 4, 2)
    for i in range(20):  # the memo of request spellings stays bounded
        enc.encode(f"x_{{{i}}}")
    assert len(enc._keys) <= 4 * enc.capacity and len(enc) == 2
    raw = CachedEncoder(tok, capacity=8, key="raw")
    for x in ("x^{2}", "$x^{2}$", "x^{2}"):
        raw.encode(x)
    assert (raw.stats.hits, raw.stats.misses) == (1, 2)


# ---- the stage ----------------------------------------------------------------------------------------
def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _stage_overrides(tmp_path: Path, train: Path, extra: list[str] = ()) -> list[str]:
    evals = _write(tmp_path / "eval.txt", HARD + TRAIN[:10])
    # unseen in training, but commands the renderer knows (one it does not, \binom, would be spelled in pieces)
    shift = _write(tmp_path / "shift.txt", [r"\oint_{C} \vec{F} \cdot d\vec{r}", r"\hat{p}^{k} \otimes q",
                                              r"\Gamma(z+1) = z\,\Gamma(z)", r"\zeta(s) = \sum_{n} n^{-s}"])
    return [f"tokenizer.corpus={train}", f"tokenizer.eval_formulas={evals}", f"tokenizer.shift_formulas={shift}",
            "tokenizer.vocab_size=1400", "tokenizer.curve_sizes=[200,1400,1500]",
            "tokenizer.replay_requests=3000", "tokenizer.timing_repeats=1", *extra]


def test_stage_writes_tokenizer_report_and_reuses(tmp_path, caplog):
    from pipeline.stages import tokenizer as stage

    art = tmp_path / "art"
    train = _write(tmp_path / "train.txt", TRAIN)
    overrides = _stage_overrides(tmp_path, train)  # no decode_step_ms and no evaluate artifact
    ctx = make_ctx(art, overrides)
    cfg = stage.TokenizerConfig(**ctx.section("tokenizer"))
    manifest = stage.run(cfg, ctx)
    folder = art / "tokenizer"
    for name in ("tokenizer.json", "tokenizer_config.json", "baseline_bytelevel_bpe.json", "comparison.json", "report.md",
                 "tokenizer_comparison.png", "manifest.json"):
        assert (folder / name).is_file(), name
    m = manifest["metrics"]
    assert m["train"]["file"] == str(train) and m["train"]["formulas"] == len(TRAIN)
    ours = m["tokenizers"]["ours: atom BPE"]
    assert ours["commands_split"] == 0 and ours["round_trip_exact"] == 1.0
    assert m["loading"]["transformers_fast"] is True
    from transformers import AutoTokenizer
    auto = AutoTokenizer.from_pretrained(str(folder))  # the folder loads as a transformers tokenizer
    assert auto.decode(auto("$\\alpha_{\\beta^{2}}$")["input_ids"], skip_special_tokens=True) == "\\alpha_{\\beta^{2}}"
    assert m["cache"]["normalized"]["requests"] == 3000
    report = (folder / "report.md").read_text()
    assert "tokens / formula, mean" in report and "tokenizer_comparison.png" in report
    # decode steps saved need no model; milliseconds need a measured step cost, none is invented
    assert m["decode_steps_saved_vs_char"] > 0 and m["decode_step_ms"] is None
    assert m["decode_ms_saved_vs_char"] is None and "Decoder step cost: unknown" in report
    assert manifest["outputs"]["tokenizer.json"] and manifest["inputs"]["train"] and manifest["inputs"]["shift"]
    sh = m["shift"]                                        # the shift set, side by side
    assert sh["formulas"] == 4 and sh["tokenizers"]["ours: atom BPE"]["commands_split"] == 0
    assert sh["reduction_vs_char"] == pytest.approx(
        sh["tokenizers"]["char-level (model today)"]["tokens_mean"] / sh["tokenizers"]["ours: atom BPE"]["tokens_mean"])
    cv = m["curve"]                                        # tokens per formula against vocabulary size
    assert [r["size"] for r in cv["rows"]] == [1400, 1500] and cv["skipped_sizes"] == [200]
    assert set(cv["rows"][0]["tokens"]) == {"held-out train", "eval", "shift"}
    assert cv["chosen_size"] in (1400, 1500)
    assert cv["rows"][1]["tokens"]["eval"] <= cv["rows"][0]["tokens"]["eval"]  # more entries, no more tokens
    assert (folder / "tokens_vs_vocab_size.png").is_file() and "## Tokens per formula against vocabulary size" in report
    assert "## On formulas training never saw (shift split)" in report
    before = (folder / "tokenizer.json").read_bytes()
    again = stage.run(cfg, make_ctx(art, overrides + ["artifacts.force=true"]))
    assert (folder / "tokenizer.json").read_bytes() == before  # same config + seed: same bytes
    assert again["key"] == manifest["key"]
    cfg.decode_step_ms = 24.0
    caplog.set_level(logging.INFO, logger="pipeline.stages.tokenizer")
    caplog.clear()
    priced = stage.run(cfg, make_ctx(art, overrides))  # a config change: trained again, priced
    fresh_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[tokenizer] ")]
    assert priced["metrics"]["decode_ms_saved_vs_char"] == pytest.approx(
        24.0 * priced["metrics"]["decode_steps_saved_vs_char"])
    assert "decoder ms saved / formula at 24.0 ms/step" in (folder / "report.md").read_text()
    caplog.clear()
    assert stage.run(cfg, make_ctx(art, overrides)) == priced  # unchanged: reused, not retrained
    # the reused summary reads like the fresh one (its manifest comes back with sorted keys)
    reused_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[tokenizer] ")]
    assert reused_lines[-len(fresh_lines):] == fresh_lines and fresh_lines[0].startswith("[tokenizer] char-level")
    # stage evaluate's step time is an input: a new measurement is not met with the old artifact
    from pipeline.artifacts import stage_output
    cfg.decode_step_ms = None
    with stage_output(art, "evaluate", {}, {}) as out:
        out.metrics["latency_batch1"] = {"decoder_ms_per_step": 10.0}
    measured = stage.run(cfg, make_ctx(art, overrides))
    assert measured["key"] != manifest["key"] and measured["metrics"]["decode_step_ms"] == 10.0


@pytest.mark.parametrize("content, message", [
    (None, "tokenizer.corpus: no such file"),
    (b"\n  \n", "tokenizer.corpus: .* holds no formula"),
    (b"x^2\n\xc3(\n", "tokenizer.corpus: .* is not UTF-8 text .* at line 2"),  # one policy for every stage
])
def test_bad_corpus_is_one_clear_error_and_no_artifact(tmp_path, content, message):
    from pipeline.stages import tokenizer as stage

    path = tmp_path / "corpus.txt"
    if content is not None:
        path.write_bytes(content)
    ctx = make_ctx(tmp_path / "art", _stage_overrides(tmp_path, path))
    with pytest.raises(PipelineError, match=message):
        stage.run(stage.TokenizerConfig(**ctx.section("tokenizer")), ctx)
    assert not (tmp_path / "art" / "tokenizer").exists()


def test_training_on_the_shift_split_is_refused(tmp_path):
    from pipeline.stages import tokenizer as stage

    ctx = make_ctx(tmp_path / "art", ["tokenizer.split=shift"])
    with pytest.raises(PipelineError, match="never for training"):
        stage.run(stage.TokenizerConfig(**ctx.section("tokenizer")), ctx)
    assert not (tmp_path / "art").exists()


@pytest.mark.slow
def test_cli_small_vocab_exits_2_with_one_line(tmp_path):
    train = _write(tmp_path / "train.txt", TRAIN)
    proc = run_cli("stage=tokenizer", f"artifacts.dir={tmp_path / 'art'}", "progress=false",
                   *_stage_overrides(tmp_path, train, ["tokenizer.vocab_size=200"]), timeout=120)
    assert proc.returncode == 2
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "smaller than the atom alphabet" in err[0], proc.stderr
    assert not (tmp_path / "art" / "tokenizer").exists()
