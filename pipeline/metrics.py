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

import math
import re
from collections import Counter
from typing import Sequence

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
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
        prev = cur
    return prev[-1]


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
    """Corpus BLEU-4 over LaTeX atoms of the normalized strings (uniform weights, brevity penalty)."""
    matches = [0] * 4
    totals = [0] * 4
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
