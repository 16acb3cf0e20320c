"""Normalization and metrics on known pairs."""
from __future__ import annotations

import pytest

from pipeline.evaluation import image_exact_match
from pipeline.metrics import bleu4, cer, corpus_cer, edit_distance, exact_match, normalize, strip_display


@pytest.mark.parametrize("raw, expected", [
    (r"\begin{equation*}\begin{array}{c}\frac{a}{b}\end{array}\end{equation*}", r"\frac{a}{b}"),
    (r"\begin{align*}& x^{\,2}+1\end{align*}", "x^2+1"),
    (r"$$\sum_{i\,=\,1}^n\!\!\!x_i\hspace{2cm}$$", r"\sum_{i=1}^nx_i"),
    (r"\begin{align*}a_{n+1} &= a_n + d \\\end{align*}", "a_{n+1}=a_n+d"),
    (r"\left( \frac{a}{b} \right)", r"(\frac{a}{b})"),
    (r"x_{i}^{2} \quad y", "x_i^2y"),
    (r"a^{\alpha_{1}}", r"a^{\alpha_1}"),
    (r"\[ x \]", "x"),
])
def test_normalize(raw, expected):
    assert normalize(raw) == expected


def test_normalize_keeps_what_changes_the_formula():
    assert normalize(r"x^{2a}") == "x^{2a}"          # a two-token script keeps its braces
    assert normalize(r"\frac{a}{b}") != normalize(r"\frac{b}{a}")
    assert normalize(r"\alpha") != normalize("a")


def test_exact_match_and_cer_on_known_pairs():
    assert exact_match(r"\begin{align*}x^{2}\end{align*}", "x^2")
    assert not exact_match("x^3", "x^2")
    assert edit_distance("kitten", "sitting") == 3
    assert cer("x^3", "x^2") == pytest.approx(1 / 3)
    assert cer("x^2", "x^2") == 0.0
    assert corpus_cer(["ab", "x"], ["ac", "xyz"]) == pytest.approx((1 + 2) / 5)


def test_bleu_known_values():
    truths = [r"\frac{a}{b}+c^2=d", r"\sum_{i=1}^nx_i"]
    assert bleu4(truths, truths) == pytest.approx(1.0)
    assert bleu4(["qqqq"], ["zzzz"]) == 0.0
    partial = bleu4([r"\frac{a}{b}+c^2=e"], [r"\frac{a}{b}+c^2=d"])
    assert 0.0 < partial < 1.0


def test_image_exact_match():
    assert image_exact_match("x^2", "x^{2}")           # same drawing, other spelling
    assert image_exact_match(r"{a}+b", "a+b")
    assert image_exact_match(r"(E\ast 3,E)", "(E*3,E)")
    assert image_exact_match(r"\begin{align*}& \mathrm{sign}(v) \\\end{align*}", r"\text{sign}(v)")
    assert not image_exact_match(r"\alpha", "a")
    assert not image_exact_match(r"\frac{a}{", "a")      # unrenderable prediction is a miss


def test_strip_display_keeps_spacing_for_rendering():
    assert strip_display(r"\begin{equation*}\alpha x\end{equation*}") == r"\alpha x"
    assert strip_display(r"$$a &= b \\$$") == "a = b"


def test_one_list_of_display_environments_for_both_normalizers():
    from pipeline.metrics import DISPLAY_ENVIRONMENTS, INNER_ENVIRONMENTS
    from pipeline.tokenization.atoms import normalize_formula

    for env in DISPLAY_ENVIRONMENTS:
        for star in ("", "*"):
            wrapped = rf"\begin{{{env}{star}}} x^{{2}} \end{{{env}{star}}}"
            assert normalize(wrapped) == "x^2", env
            assert normalize_formula(wrapped) == "x^{2}", env  # the tokenizer keeps the braces
    for env in INNER_ENVIRONMENTS:  # alignment-only, inside a wrapper: metrics drops them, the tokenizer keeps them
        inner = rf"\begin{{{env}}} a \end{{{env}}}"
        assert normalize(rf"\begin{{equation}} {inner} \end{{equation}}") == "a"
        assert normalize_formula(rf"\begin{{equation}} {inner} \end{{equation}}") == inner.strip()


# ---- the libraries' metrics against the hand-written ones they replaced -----------------------------
def _reference_edit_distance(a, b) -> int:
    """The pure-Python Levenshtein pipeline/metrics.py had before rapidfuzz."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
        prev = cur
    return prev[-1]


def _reference_bleu4(preds, truths) -> float:
    """The hand-written corpus BLEU-4 pipeline/metrics.py had before sacrebleu."""
    import math
    from collections import Counter

    from pipeline.metrics import tokens

    matches, totals = [0] * 4, [0] * 4
    pred_len = ref_len = 0
    for p, t in zip(preds, truths):
        pt, tt = tokens(normalize(p)), tokens(normalize(t))
        pred_len += len(pt)
        ref_len += len(tt)
        for n in range(1, 5):
            pc = Counter(tuple(pt[i:i + n]) for i in range(len(pt) - n + 1))
            tc = Counter(tuple(tt[i:i + n]) for i in range(len(tt) - n + 1))
            matches[n - 1] += sum(min(c, tc[g]) for g, c in pc.items())
            totals[n - 1] += max(len(pt) - n + 1, 0)
    if pred_len == 0 or any(m == 0 for m in matches):
        return 0.0
    log_p = sum(math.log(m / t) for m, t in zip(matches, totals)) / 4
    bp = 1.0 if pred_len > ref_len else math.exp(1 - ref_len / pred_len)
    return bp * math.exp(log_p)


def _misreadings(truths, seed: int) -> list[str]:
    """Each formula misread the ways a recognizer does: atoms dropped, doubled, swapped or replaced,
    the tail cut, a display wrapper added; some read exactly, some not at all."""
    import random

    from pipeline.metrics import tokens

    rng = random.Random(seed)
    preds = []
    for t in truths:
        atoms = tokens(t.replace(" ", ""))
        kind = rng.randrange(7)
        for _ in range(rng.randint(1, 3)):
            if not atoms:
                break
            i = rng.randrange(len(atoms))
            if kind == 0:
                del atoms[i]
            elif kind == 1:
                atoms.insert(i, atoms[i])
            elif kind == 2:
                j = rng.randrange(len(atoms))
                atoms[i], atoms[j] = atoms[j], atoms[i]
            elif kind == 3:
                atoms[i] = rng.choice(["x", "\\alpha", "{", "}", "^", "2", "\\frac"])
            elif kind == 4:
                atoms = atoms[:i]
        pred = "".join(atoms)
        preds.append({5: t, 6: rng.choice(["", f"$${t}$$"])}.get(kind, pred))
    return preds


def _check_against_reference(truths):
    preds = _misreadings(truths, seed=len(truths))
    assert any(p != t for p, t in zip(preds, truths)) and any(p == t for p, t in zip(preds, truths))
    for p, t in zip(preds, truths):
        np_, nt = normalize(p), normalize(t)
        assert edit_distance(np_, nt) == _reference_edit_distance(np_, nt), (p, t)
    assert corpus_cer(preds, truths) > 0
    chunks = [(preds, truths)] + [(preds[i:i + 16], truths[i:i + 16]) for i in range(0, len(truths), 16)]
    values = []
    for p, t in chunks:
        values.append(bleu4(p, t))
        assert values[-1] == pytest.approx(_reference_bleu4(p, t), rel=1e-12, abs=1e-15)
    assert 0.0 < values[0] < 1.0 and len(set(values)) > 2  # the comparison saw real scores, not only 0 and 1


def test_library_metrics_equal_the_hand_written_ones_on_misread_formulas():
    from pipeline.data.templates import varied_formulas

    _check_against_reference(varied_formulas(400, seed=3))


@pytest.mark.slow
def test_library_metrics_equal_the_hand_written_ones_on_the_eval_split(corpus):
    _check_against_reference([f.latex for f in corpus if f.split == "eval"])
