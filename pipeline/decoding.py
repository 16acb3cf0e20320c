"""Greedy decoding's guard against runaway readings: a cap on runs of layout-only LaTeX.

A formula recognizer that loses its place often keeps writing what costs it nothing to write:
spacing (``\\! \\, \\; \\quad \\qquad``), alignment ``&``, line breaks ``\\\\``, style switches
(``\\scriptstyle``). Those loops run to the length cap, cost up to the whole cap in decoder steps,
and leave the rest of the formula unread (``\\int_0^\\infty\\!\\!\\!\\!...`` where the image goes on
with a fraction). No formula needs many of them in a row: in the corpus's calib split no formula
has more than 3 consecutive layout atoms, and the model's correct readings there (runaways aside)
no more than 5. With ``cap`` set, greedy decoding never lets a reading's trailing run of layout
atoms grow past ``cap``: where the best token would, the next best that does not is taken (EOS
included), so the model goes on with what it reads or stops.

No torch and no other module of this project here: the package runtime loads it, and so does
``tests/macart_decode.py`` (the ONNX Runtime 1.12 venv), by file path.
"""
from __future__ import annotations

import re
from typing import Callable, Sequence

import numpy as np

# what the metric's normalization drops as layout (pipeline/metrics.py), one atom each
LAYOUT_ATOM = re.compile(r"\\(?:quad|qquad|scriptstyle|scriptscriptstyle|displaystyle|textstyle)"
                         r"|\\[,;:!> ]|\\\\|&|~|\s")
_ATOM = re.compile(r"\\[a-zA-Z]+|\\[^a-zA-Z]|\\$|[^\\]", re.S)
_OPEN = re.compile(r"\\[a-zA-Z]*")  # a command at the very end may still grow (``\qua`` -> ``\quad``)
_LONGEST = 20                       # characters of the longest layout atom, a space after it included
# a token can lengthen a run only if it holds one of these (letters alone only grow an open command)
_RUN_CHARS = frozenset("\\,;:!>&~")


def layout_run(text: str, cap: int = 64) -> int:
    """How many layout atoms end ``text`` (a command still open at the very end not counted),
    counted as far back as ``cap + 1`` atoms need."""
    atoms = _ATOM.findall(text[-_LONGEST * (cap + 2):])
    if atoms and _OPEN.fullmatch(atoms[-1]):
        atoms.pop()
    n = 0
    for atom in reversed(atoms):
        if not LAYOUT_ATOM.fullmatch(atom):
            break
        n += 1
    return n


class LayoutGuard:
    """The cap on layout runs for one vocabulary: ``token_texts[i]`` is what token ``i`` writes
    (``""`` for the specials); the reading's text is the concatenation of its tokens' texts."""

    def __init__(self, token_texts: Sequence[str], eos_id: int, cap: int):
        if cap < 1:
            raise ValueError("the layout-run cap must be at least 1 (0 = no guard: build none)")
        self.texts = list(token_texts)
        self.eos = int(eos_id)
        self.cap = int(cap)
        self._may_extend = [any(c in _RUN_CHARS or c.isspace() for c in t) for t in self.texts]

    @classmethod
    def for_vocabulary(cls, write: Callable[[int], str], vocab_size: int, eos_id: int, cap: int) -> "LayoutGuard":
        """The guard for token ids ``0 .. vocab_size - 1``, ``write(i)`` being what token ``i`` writes
        (EOS writes nothing)."""
        return cls(["" if i == eos_id else write(i) for i in range(vocab_size)], eos_id, cap)

    def step(self, logits: np.ndarray, proposed: Sequence[int], texts: list[str]) -> list[int]:
        """One greedy step for a batch: ``proposed`` (the argmax of each row's ``logits``, banned
        tokens already at -inf), kept unless it would make the row's layout run longer than the
        cap. ``texts`` (each row's reading so far) get the chosen tokens' texts appended."""
        out = []
        for row, tok in enumerate(proposed):
            tok = int(tok)
            if tok != self.eos and self._may_extend[tok]:
                tok = self._choose(logits[row], texts[row], tok)
            texts[row] += self.texts[tok]
            out.append(tok)
        return out

    def _choose(self, row: np.ndarray, text: str, tok: int) -> int:
        if layout_run(text + self.texts[tok], self.cap) <= self.cap:
            return tok
        limit = max(self.cap, layout_run(text, self.cap))
        row = np.asarray(row, dtype=np.float32)
        for cand in np.argsort(-row, kind="stable").tolist():
            if not np.isfinite(row[cand]):
                break
            if cand == self.eos or not self._may_extend[cand] or layout_run(text + self.texts[cand], self.cap) <= limit:
                return int(cand)
        return self.eos
