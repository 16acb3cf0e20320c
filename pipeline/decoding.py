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

Below the guard, the loops that use it: :func:`greedy` (any backend's step), :func:`cached_greedy`
(an exported package's KV-cache calls), :func:`speculative_greedy` (batch 1, drafts checked by a verify
graph), and :class:`StudentReader`, a BPE student's greedy reading (the student drafter's guide).

No torch and no other module of this project here: the package runtime loads it, and so does
``tests/macart_decode.py`` (the ONNX Runtime 1.12 venv), by file path.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np


@dataclass
class DecodeResult:
    """Greedy decoding output plus where the time went."""

    token_ids: list[list[int]]
    texts: list[str]
    encoder_seconds: float = 0.0
    decoder_seconds: float = 0.0
    steps: list[int] = field(default_factory=list)  # decode steps per sample
    hit_cap: list[bool] = field(default_factory=list)  # stopped by max_length, not by EOS
    calls: list[int] = field(default_factory=list)  # decoder calls per sample (speculative decoding: fewer
                                                     # than steps); empty: one per step

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


# ---- greedy decoding: one loop, a step function per backend ----------------------------------------
def greedy(first: Callable[[], np.ndarray], step: Callable[[np.ndarray], np.ndarray],
           keep: Callable[[np.ndarray], None], n: int, eos: int, banned: Sequence[int], max_length: int,
           guard: LayoutGuard | None = None) -> list[list[int]]:
    """Greedy decoding of ``n`` rows at once, the loop the torch adapter and the package runtime share.

    The backend gives ``first()``: the logits ``[n, vocab]`` after BOS; ``step(tokens)``: the active
    rows' logits after their ``tokens`` (``[rows]``); ``keep(mask)``: drop the rows ``mask`` is False
    for (they finished: they leave the batch and cost nothing more). ``max_length`` caps the sequence,
    BOS included; banned tokens never win; ``guard`` caps runs of layout-only atoms. Returns each
    row's tokens after BOS (EOS included when it was written)."""
    if max_length < 2:
        return [[] for _ in range(n)]
    out: list[list[int] | None] = [None] * n
    seqs: list[list[int]] = [[] for _ in range(n)]
    active = np.arange(n)
    texts = [""] * n  # each active row's reading so far (the layout guard's view)
    banned = list(banned)
    logits = first()
    for t in range(max_length - 1):
        logits = np.array(logits, dtype=np.float32, copy=True)
        logits[:, banned] = -np.inf
        nxt = logits.argmax(-1)
        if guard is not None:
            nxt = np.asarray(guard.step(logits, nxt.tolist(), texts), dtype=np.int64)
        for row, tok in enumerate(nxt.tolist()):
            seqs[active[row]].append(int(tok))
        done = nxt == eos
        if done.any():
            for row in np.flatnonzero(done):
                out[active[row]] = seqs[active[row]]
            kept = ~done
            active, nxt = active[kept], nxt[kept]
            texts = [x for x, k in zip(texts, kept.tolist()) if k]
            if active.size == 0:
                break
            keep(kept)
        if t == max_length - 2:  # the cap: no call for logits nobody reads
            break
        logits = step(nxt)
    for idx in active.tolist():  # stopped by the cap
        out[idx] = seqs[idx]
    return [o if o is not None else [] for o in out]


def cached_greedy(first: Callable, step: Callable, n: int, bos: int, eos: int, banned: Sequence[int],
                  max_length: int, guard: LayoutGuard | None = None) -> list[list[int]]:
    """:func:`greedy` on a decoder with a KV cache, the calls of an exported package: ``first(ids [n, 1])
    -> (logits [n, V], past, cross)`` after BOS, ``step(ids [rows, 1], past, cross) -> (logits [rows, V],
    present)``; rows that finish leave the past and the cross K/V with the batch."""
    if max_length < 2:
        return [[] for _ in range(n)]
    logits, past, cross = first(np.full((n, 1), bos, dtype=np.int64))
    state = {"past": past, "cross": cross}

    def next_logits(tokens: np.ndarray) -> np.ndarray:
        out, state["past"] = step(tokens[:, None], state["past"], state["cross"])
        return out

    def keep(rows: np.ndarray) -> None:
        state["past"] = [p[rows] for p in state["past"]]
        state["cross"] = [c[rows] for c in state["cross"]]

    return greedy(lambda: logits, next_logits, keep, n, eos, banned, max_length, guard)


class StudentReader:
    """A BPE student's greedy reading of one encoder output (batch 1) on its ``decoder_first`` and
    ``decoder_step`` graphs (ONNX Runtime sessions), spelled in the package's vocabulary: ``pieces[i]``
    are the token ids BPE id ``i`` writes. Stops at the student's EOS or once ``max_tokens`` are spelled.
    No layout cap, no exactness asked: the guide only decides what a drafter proposes
    (``pipeline/drafting.py: StudentDrafter``)."""

    def __init__(self, first, step, step_inputs: Sequence[str], num_layers: int, bos: int, eos: int,
                 banned: Sequence[int], pieces: Sequence[Sequence[int]], max_tokens: int):
        self.first, self.step, self.step_inputs = first, step, list(step_inputs)
        self.n = 2 * int(num_layers)
        self.bos, self.eos, self.banned = int(bos), int(eos), list(banned)
        self.pieces = [list(p) for p in pieces]
        self.max_tokens = int(max_tokens)

    @classmethod
    def from_entry(cls, student: dict, open_graph: Callable[[str], object]) -> "StudentReader":
        """From a ``drafter.json``'s ``student`` entry; ``open_graph(file name)``: a session of that graph."""
        return cls(open_graph(student["first"]), open_graph(student["step"]), student["step_inputs"],
                   student["num_layers"], student["bos"], student["eos"], student["banned"], student["pieces"],
                   student["max_tokens"])

    def __call__(self, memory: np.ndarray) -> tuple[list[int], int]:
        """(the guide's token ids, the student's decoder calls)."""
        calls, spelled, stop = [1], [0], [None]

        def first(ids: np.ndarray):
            outs = self.first.run(None, {"input_ids": ids, "memory": memory})
            stop[0] = np.full_like(outs[0], -np.inf)
            stop[0][:, self.eos] = 0.0  # past max_tokens spelled: the logits of an EOS
            return outs[0], outs[1:1 + self.n], outs[1 + self.n:]

        def step(ids: np.ndarray, past: list, cross: list):
            tok = int(ids[0, 0])
            if not 0 <= tok < len(self.pieces):  # a token the spelling does not know: the guide ends before it
                return stop[0], past
            spelled[0] += len(self.pieces[tok])
            if spelled[0] >= self.max_tokens:  # the guide is long enough: no call for more
                return stop[0], past
            calls[0] += 1
            outs = self.step.run(None, dict(zip(self.step_inputs, [ids, *past, *cross])))
            return outs[0], outs[1:]

        # at most max_tokens BPE steps: a piece spells a token or more, so the spelled length stops it first,
        # but for pieces that spell nothing (a special the student is not banned from), which the cap ends
        ids = cached_greedy(first, step, 1, self.bos, self.eos, self.banned, self.max_tokens + 1)[0]
        guide = [t for tok in ids if 0 <= tok < len(self.pieces) and tok != self.eos for t in self.pieces[tok]]
        return guide[:self.max_tokens], calls[0]


# ---- speculative greedy decoding -------------------------------------------------------------------

class SpeculativeStats:
    """What speculative decoding did over the readings it was handed: decoder calls (the first call
    included), verify calls, tokens drafted and drafted tokens accepted, tokens written; the drafter's
    own decoder calls (a student's: not the package's decoder, counted apart)."""

    def __init__(self) -> None:
        self.readings = self.calls = self.verify_calls = self.drafted = self.accepted = self.tokens = 0
        self.drafter_calls = 0

    def as_dict(self) -> dict:
        n = max(1, self.readings)
        return {"readings": self.readings, "decoder_calls": self.calls, "verify_calls": self.verify_calls,
                "drafted": self.drafted, "accepted": self.accepted, "tokens": self.tokens,
                "drafter_calls": self.drafter_calls,
                "calls_per_reading": round(self.calls / n, 2), "tokens_per_reading": round(self.tokens / n, 2),
                "tokens_per_call": round(self.tokens / max(1, self.calls), 2),
                "accepted_per_verify": round(self.accepted / max(1, self.verify_calls), 2),
                "acceptance": round(self.accepted / max(1, self.drafted), 3),
                "drafter_calls_per_reading": round(self.drafter_calls / n, 2)}


class VerifyCalls:
    """A verify graph (batch 1, up to ``width`` tokens) as the loop's ``verify``.

    Every token goes through the verify graph, a lone one (the drafter proposed nothing) padded to two
    rows: the graph's rows are bit for bit the same whatever the call's width, padding or a token's
    place in it, so the loop writes exactly what greedy decoding on the verify graph writes
    (:meth:`OnnxPackage.verify_greedy`), and the cache holds the same K/V whichever calls wrote it.
    The step graph attends from a single query row, which a CPU kernel rounds otherwise (~1e-7): a lone
    token sent there would make the reading depend on where the drafter stopped. Tokens a call would
    carry past the decoder's position table (``max_positions``) go one ``step`` call each. ``fixed``: the
    graph's width is fixed (packages exported before the width was dynamic): fewer tokens are padded
    with the last one up to it, and a lone token goes to ``step`` (a whole-width call for one token
    costs three steps). A padded position reads only what precedes it, so the real positions' logits
    are unchanged; its logits and K/V are never used: the loop cuts the cache to the tokens written."""

    def __init__(self, run: Callable, step: Callable, width: int, max_positions: int, fixed: bool = False):
        self.run, self.step, self.width, self.max_positions = run, step, int(width), int(max_positions)
        self.fixed = bool(fixed)
        if self.width < 2:
            raise ValueError(f"a verify graph reads at least 2 tokens, got width {self.width}")

    @property
    def free_drafts(self) -> int:
        """Drafts a lone token's call checks at no cost: the row it is padded with (a fixed-width graph
        sends a lone token to ``step``: none). The loop's ``min_drafts``."""
        return 0 if self.fixed else 1

    def __call__(self, ids: np.ndarray, past: list, cross: list):
        n = ids.shape[1]
        if n > self.width:
            raise ValueError(f"{n} tokens for a verify graph of width {self.width}")
        fed_n = self.width if self.fixed else max(n, 2)
        if (n == 1 and self.fixed) or past[0].shape[2] + fed_n > self.max_positions:
            rows = []
            for t in range(n):
                logits, past = self.step(ids[:, t:t + 1], past, cross)
                rows.append(logits)
            return np.stack(rows, axis=1), past
        fed = np.concatenate([ids, np.repeat(ids[:, -1:], fed_n - n, axis=1)], axis=1) if n < fed_n else ids
        logits, present = self.run(fed, past, cross)
        return logits[:, :n], present


def speculative_greedy(first: Callable, verify: Callable, propose: Callable[..., list[int]],
                       bos: int, eos: int, banned: Sequence[int], max_length: int, draft_len: int,
                       guard: "LayoutGuard | None" = None, stats: SpeculativeStats | None = None,
                       min_drafts: int = 0) -> list[int]:
    """One reading (batch 1), token for token what greedy decoding writes, in fewer decoder calls.

    ``first(ids [1, 1]) -> (logits [1, V], past, cross)``; ``verify(ids [1, T], past, cross) ->
    (logits [1, T, V], present)``: the T tokens after ``past``, the logits after each, ``present`` the
    past grown by T. ``propose(ids, k, at_least)``: up to ``k`` tokens a drafter expects after ``ids``
    (BOS and the tokens written so far). Each verify call feeds the last written token and the drafts; greedy's own
    choice is taken at every position (pad and BOS banned, the layout guard applied to the text so
    far), the drafts are accepted while they equal it, and the first choice that differs is written
    too: each call writes at least the one token a plain step would. The cache keeps only what was
    written. ``max_length`` counts BOS, as greedy's cap does. ``min_drafts``: the ``at_least`` asked for,
    drafts proposed where the drafter has any guess, however unsure (a lone token's call is padded to
    two rows anyway: :attr:`VerifyCalls.free_drafts`; a guess there costs nothing)."""
    if max_length < 2:
        return []
    banned = list(banned)
    texts = [""]

    def choose(row: np.ndarray) -> int:
        row = row.astype(np.float32, copy=True)
        row[banned] = -np.inf
        tok = int(row.argmax())
        if guard is not None:
            tok = guard.step(row[None], [tok], texts)[0]
        return tok

    logits, past, cross = first(np.full((1, 1), bos, dtype=np.int64))
    seq = [choose(logits[0])]
    calls, verifies, drafted, accepted = 1, 0, 0, 0
    limit = max_length - 1  # tokens a reading may write
    while seq[-1] != eos and len(seq) < limit:
        room = limit - len(seq)
        k = min(draft_len, room - 1)
        drafts = [int(t) for t in propose([bos, *seq], k, min(min_drafts, k))][:k] if k > 0 else []
        fed = np.asarray([[seq[-1], *drafts]], dtype=np.int64)
        logits, present = verify(fed, past, cross)
        calls, verifies, drafted = calls + 1, verifies + 1, drafted + len(drafts)
        took = 0
        for j in range(fed.shape[1]):
            tok = choose(logits[0, j])
            seq.append(tok)
            if tok == eos or len(seq) >= limit or j >= len(drafts) or tok != drafts[j]:
                break
            took += 1
        accepted += took
        keep = past[0].shape[2] + 1 + took  # the last written token and the accepted drafts were fed
        past = [p[:, :, :keep] for p in present]
    if stats is not None:
        stats.readings += 1
        stats.calls += calls
        stats.verify_calls += verifies
        stats.drafted += drafted
        stats.accepted += accepted
        stats.tokens += len(seq)
    return seq
