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
