"""Recognition metrics: normalization, exact match, CER, BLEU-4, image exact match.

Normalization (documented in the README) makes two spellings that are the same formula compare
equal, and nothing more:
1. strip the display-math wrapper the model emits: ``$$ $``, ``\\[ \\]``, ``\\( \\)`` and
   ``\\begin{equation|align|gather|displaymath|math}[*]`` ... ``\\end{...}``, ``array``/``aligned``
   environments with one column;
2. drop layout-only tokens: ``\\left \\right \\big* \\Big*``, spacing (``\\, \\; \\: \\! \\ ``,
   ``\\quad \\qquad``, ``\\hspace{..}``, ``~``), alignment ``&``, line breaks ``\\\\``,
   ``\\displaystyle \\textstyle``, ``\\nonumber``;
3. remove braces around a single-token script argument: ``x^{2}`` -> ``x^2``,
   ``a_{\\alpha}`` -> ``a_\\alpha``;
4. remove all whitespace.
"""
from __future__ import annotations

import re
from typing import Sequence

from rapidfuzz.distance import Levenshtein
from sacrebleu.metrics import BLEU

# The display-math environments a formula may come wrapped in: one list for this normalizer and the
# tokenizer's (pipeline/tokenization/atoms.py), which removes one of them around the whole formula
DISPLAY_ENVIRONMENTS = ("equation", "align", "alignat", "gather", "displaymath", "math", "multline", "eqnarray")
# alignment-only environments that sit inside one of those; only this normalizer removes them
INNER_ENVIRONMENTS = ("split", "aligned", "gathered")
_ENVS = r"(?:" + "|".join(DISPLAY_ENVIRONMENTS + INNER_ENVIRONMENTS) + r")\*?"
_WRAPPERS = [
    re.compile(r"\\begin\{" + _ENVS + r"\}(?:\{[^{}]*\})?"),
    re.compile(r"\\end\{" + _ENVS + r"\}"),
    re.compile(r"\\begin\{array\}\{[lcr|]?\}"),  # a one-column array is just a wrapper
    re.compile(r"\\end\{array\}(?=\s*(?:\\end|\$|$))"),
    re.compile(r"^\s*\$\$?|\$\$?\s*$"),
    re.compile(r"^\s*\\\[|\\\]\s*$"),
    re.compile(r"^\s*\\\(|\\\)\s*$"),
]
_LAYOUT = re.compile(
    r"\\(?:left|right|[bB]ig+[lr]?|displaystyle|textstyle|scriptstyle|nonumber|notag|qquad|quad)(?![a-zA-Z])"
    r"|\\(?:hspace|vspace|hskip|kern|mkern)\*?\{[^{}]*\}"
    r"|\\[,;:!> ]"
    r"|\\\\(?:\[[^\]]*\])?"
    r"|&|~"
)
_SINGLE_SCRIPT = re.compile(r"([_^])\s*\{\s*(\\[a-zA-Z]+|\\.|[^{}\s\\])\s*\}")
_EMPTY_TEXT = re.compile(r"\\(?:text|mbox|mathrm)\s*\{\s*\}")
_WS = re.compile(r"\s+")
# corpus BLEU-4 as defined here: atoms are the words (tokenize="none"), no smoothing, order 4 always
# (force: atoms joined by spaces look like tokenized text to sacrebleu, and are meant to)
_BLEU = BLEU(tokenize="none", smooth_method="none", max_ngram_order=4, effective_order=False, force=True)


def normalize(latex: str) -> str:
    s = latex.strip()
    for _ in range(3):  # wrappers nest ($$ \begin{align*} ... \end{align*} $$)
        before = s
        for pat in _WRAPPERS:
            s = pat.sub(" ", s).strip()
        if s == before:
            break
    s = _LAYOUT.sub(" ", s)
    s = _EMPTY_TEXT.sub(" ", s)
    prev = None
    while prev != s:  # nested single-token scripts (a^{b_{c}})
        prev = s
        s = _SINGLE_SCRIPT.sub(r"\1\2", s)
    # every space goes, the one ending a control word too (``\alpha b`` -> ``\alphab``): both sides of
    # a comparison are normalized alike, so exact match is unaffected; tokens() then reads
    # ``\alphab`` as one command
    return _WS.sub("", s)


_BREAKS = re.compile(r"\\\\(?:\[[^\]]*\])?|&|\\(?:nonumber|notag)(?![a-zA-Z])|\\(?:label|tag)\{[^{}]*\}")


def strip_display(latex: str) -> str:
    """Only the display-math wrapper and alignment/line-break marks removed; spacing kept, so the
    result still renders as the same formula (for the image metric)."""
    s = latex.strip()
    for _ in range(3):
        before = s
        for pat in _WRAPPERS:
            s = pat.sub(" ", s).strip()
        if s == before:
            break
    return " ".join(_BREAKS.sub(" ", s).split())


def tokens(latex_normalized: str) -> list[str]:
    """LaTeX atoms of a normalized formula: commands, single characters."""
    return re.findall(r"\\[a-zA-Z]+|\\.|.", latex_normalized)


def exact_match(pred: str, truth: str) -> bool:
    return normalize(pred) == normalize(truth)


def edit_distance(a: Sequence, b: Sequence) -> int:
    """Levenshtein distance (unit costs) of two strings or sequences of hashable atoms."""
    return Levenshtein.distance(a, b)


def cer(pred: str, truth: str) -> float:
    """Character error rate of the normalized strings (edit distance / reference length)."""
    p, t = normalize(pred), normalize(truth)
    if not t:
        return 0.0 if not p else 1.0
    return edit_distance(p, t) / len(t)


def corpus_cer(preds: Sequence[str], truths: Sequence[str]) -> float:
    """Total edits over total reference characters (the usual corpus-level CER)."""
    edits = sum(edit_distance(normalize(p), normalize(t)) for p, t in zip(preds, truths))
    total = sum(len(normalize(t)) for t in truths)
    return edits / total if total else 0.0


def bleu4(preds: Sequence[str], truths: Sequence[str]) -> float:
    """Corpus BLEU-4 over LaTeX atoms of the normalized strings (uniform weights, brevity penalty, no
    smoothing: 0 when an n-gram order has no match), in [0, 1]. sacrebleu's BLEU on the atoms joined
    by spaces with its own tokenizer off, so an atom (``\\frac``, ``{``) is one of its words."""
    pairs = list(zip(preds, truths))
    hyps = [" ".join(tokens(normalize(p))) for p, _ in pairs]
    refs = [" ".join(tokens(normalize(t))) for _, t in pairs]
    if not any(hyps):
        return 0.0
    return _BLEU.corpus_score(hyps, [refs]).score / 100.0
