"""Drafters for speculative greedy decoding: cheap guesses of the next tokens a reading will write.

A drafter proposes up to ``k`` tokens after the tokens written so far (BOS first); the package's
``decoder_verify`` graph checks them all in one call and greedy's own choice decides
(``pipeline/decoding.py: speculative_greedy``), so a drafter changes how many decoder calls a reading
takes, never what it reads. Each drafter is one JSON file in the package (``drafter.json``),
built by stage export from artifacts the chain already makes (never from the eval or shift splits):

- ``ngram``: what the model itself writes after the last ``n`` tokens, counted over its own greedy
  readings of train formulas (the display wrapper, the rest of ``\\frac{``, closing braces ...);
  the longest context seen at least ``min_count`` times decides, and the proposal chains. Each context
  keeps the share of its continuations its token had; with ``min_confidence`` c the chain stops before
  the product of those shares falls below c (a call checks the drafts likely to pass, and a shorter call
  costs less); with ``tail`` t, t more guesses follow where the confidence stopped it (on a CPU a guess
  costs about what it saves, on a GPU a wider call costs about the same). With ``self_lookup`` n, the
  reading itself is a table too: where the last n or more tokens were written before in this reading,
  what followed them then (the longest context wins; at equal length the reading's own; its share
  counts as 1).
- ``bpe``: the rest of a formula-BPE piece (stage tokenizer's vocabulary) the text so far ends in
  the start of: what all the pieces that start so go on with (after ``\\f``, ``rac{``); where they part
  at once, a guess from the most frequent piece (the earliest merge) when a guess is asked for.
- ``student``: the BPE student of stage distill reads the image first (its own two decoder graphs in
  the package, on the package's encoder output: a few BPE steps a formula), its reading spelled in the
  decoder's characters is the *guide*; where the last tokens written (``min_match`` or more) occur in
  the guide, what follows them there is proposed (the occurrence nearest after the last one followed);
  elsewhere (the display wrapper the student does not write, a place the two readings part) the
  ``ngram`` table above proposes, and where it proposes nothing before the guide was reached, the
  guide's start.

No torch and no other module of this project here: the package runtime loads it, and so does
``tests/macart_decode.py`` (the ONNX Runtime 1.12 venv), by file path. :data:`DRAFTERS` is the
registry; :func:`load` reads a ``drafter.json``. A drafter with ``begin(memory)`` is told each reading's
encoder output before its first proposal and returns the decoder calls it made.
"""
from __future__ import annotations

import collections
import json
import threading
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

FORMAT = "formula-compress drafter v1"


class NgramDrafter:
    """Next token by the longest matching context of up to ``order`` tokens, chained up to ``k`` times
    while the chain's confidence (the product of the contexts' shares) stays at ``min_confidence`` or above,
    and ``tail`` tokens more after that."""

    kind = "ngram"

    def __init__(self, order: int, table: dict[tuple[int, ...], int], self_lookup: int = 0,
                 shares: dict[tuple[int, ...], float] | None = None, min_confidence: float = 0.0, tail: int = 0):
        if order < 1:
            raise ValueError(f"the n-gram order must be at least 1, got {order}")
        if self_lookup < 0 or self_lookup > order:
            raise ValueError(f"self_lookup must be 0 (off) or 1..order ({order}), got {self_lookup}")
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {min_confidence}")
        if tail < 0:
            raise ValueError(f"tail must be 0 (off) or more, got {tail}")
        self.order = int(order)
        self.table = table
        self.shares = shares or {}  # a context missing: share 1
        self.self_lookup = int(self_lookup)
        self.min_confidence = float(min_confidence)
        self.tail = int(tail)
        self._local = threading.local()  # per thread (a served package reads requests in threads): the reading
        # the own table was built from, and its contexts -> the token that followed them last

    @classmethod
    def build(cls, readings: Iterable[Sequence[int]], bos: int, order: int = 8, min_count: int = 2,
              self_lookup: int = 0, min_confidence: float = 0.0, tail: int = 0) -> "NgramDrafter":
        """From token sequences as the model writes them (no BOS; EOS kept so the drafter proposes
        the end too): for each context of 1..``order`` tokens (BOS included) seen ``min_count`` times
        or more, its most frequent next token (ties: the smaller id) and that token's share of what
        followed the context (3 decimals)."""
        if min_count < 1:
            raise ValueError(f"min_count must be at least 1, got {min_count}")
        counts: dict[tuple[int, ...], collections.Counter] = collections.defaultdict(collections.Counter)
        for ids in readings:
            seq = [int(bos), *map(int, ids)]
            for i in range(1, len(seq)):
                for n in range(1, min(order, i) + 1):
                    counts[tuple(seq[i - n:i])][seq[i]] += 1
        table, shares = {}, {}
        for ctx, c in counts.items():
            tok, count = min(c.items(), key=lambda kv: (-kv[1], kv[0]))
            if count >= min_count:
                table[ctx] = tok
                shares[ctx] = round(count / sum(c.values()), 3)
        return cls(order, table, self_lookup, shares, min_confidence, tail)

    def _own_table(self, ids: list[int]) -> dict[tuple[int, ...], int]:
        """Contexts of ``self_lookup``..``order`` tokens in ``ids`` -> the token that followed them last;
        grown from the previous call's when ``ids`` extends the same reading."""
        mine = self._local
        if not hasattr(mine, "seen") or ids[:len(mine.seen)] != mine.seen:
            mine.seen, mine.own = [], {}
        for end in range(max(len(mine.seen), 1), len(ids)):  # ids[end] follows the contexts ending before it
            for n in range(self.self_lookup, min(self.order, end) + 1):
                mine.own[tuple(ids[end - n:end])] = ids[end]
        mine.seen = list(ids)
        return mine.own

    def propose(self, ids: Sequence[int], k: int, at_least: int = 0) -> list[int]:
        """Up to ``k`` tokens after ``ids``, while the chain's confidence holds and ``tail`` more; the first
        ``at_least`` whatever the confidence (where the table has a continuation)."""
        own = self._own_table(list(ids)) if self.self_lookup else {}
        work = list(ids[-self.order:])
        out: list[int] = []
        confidence, limit = 1.0, None  # limit: the draft's length once the confidence fell below
        while len(out) < k:
            nxt, share = None, 1.0
            for n in range(min(self.order, len(work)), 0, -1):
                context = tuple(work[-n:])
                nxt = own.get(context) if n >= self.self_lookup else None
                if nxt is None:
                    nxt = self.table.get(context)
                    share = self.shares.get(context, 1.0)
                if nxt is not None:
                    break
            if nxt is None:
                break
            if confidence * share < self.min_confidence:
                limit = max(at_least, len(out) + self.tail) if limit is None else limit
                if len(out) >= limit:
                    break
            confidence *= share
            out.append(nxt)
            work.append(nxt)
        return out

    def to_json(self) -> dict:
        """The table as ``"context ids": [token, share]`` (drafters from before the shares: ``token``)."""
        return {"order": self.order, "self_lookup": self.self_lookup, "min_confidence": self.min_confidence,
                "tail": self.tail,
                "table": {" ".join(map(str, k)): [v, self.shares.get(k, 1.0)] for k, v in sorted(self.table.items())}}

    @classmethod
    def from_json(cls, data: dict, **_) -> "NgramDrafter":
        table, shares = {}, {}
        for key, value in data["table"].items():
            ctx = tuple(int(t) for t in key.split())
            token, share = (value, 1.0) if isinstance(value, int) else value
            table[ctx], shares[ctx] = int(token), float(share)
        return cls(int(data["order"]), table, int(data.get("self_lookup", 0)), shares,
                   float(data.get("min_confidence", 0.0)), int(data.get("tail", 0)))


# where a sure completion stops: a piece's rest past these is what one formula or a few wrote next
_UNIT_END = frozenset("\\^_}])&, ")


def _one_unit(rest: str) -> str:
    """``rest`` up to the end of the command or group it completes: through an opening ``{``, before
    the next command, script, closing bracket, alignment, comma or space (``pha})^{\\beta`` -> ``pha``,
    ``rac{1}{`` -> ``rac{``)."""
    for i, c in enumerate(rest):
        if c == "{":
            return rest[:i + 1]
        if c in _UNIT_END:
            return rest[:i]
    return rest


class BpeDrafter:
    """The rest of the formula-BPE piece the text so far ends in the start of, spelled in the
    decoder's vocabulary (``token_texts``: what each token id writes; single characters here): what
    every piece that starts so continues with (``completions``), else, asked for ``at_least`` drafts, the
    most frequent piece's next characters (``guesses``)."""

    kind = "bpe"

    def __init__(self, completions: dict[str, str], token_texts: Sequence[str],
                 guesses: dict[str, str] | None = None):
        self.completions = completions
        self.guesses = guesses or {}
        self.longest = max((len(p) for p in (*completions, *self.guesses)), default=0)
        self.spell = {t: i for i, t in enumerate(token_texts) if t}
        self.texts = list(token_texts)

    @classmethod
    def build(cls, pieces: Sequence[str], token_texts: Sequence[str]) -> "BpeDrafter":
        """``pieces`` most frequent first (BPE merge order), those the vocabulary can spell. A text that
        starts a piece is completed by what all the longest pieces starting with it (those no other piece
        extends) have in common, up to the end of the command or group it is in (:func:`_one_unit`): BPE
        merges ``\\f``, ``\\fr``, ... ``\\frac{``, ``\\frac{1}{``, ``\\frac{x}{`` in turn, and after ``\\f`` every
        one of them goes on ``rac{``. Where they part at once (``\\le``: ``\\leq``, ``\\left``), the guess is
        the first merged piece's next characters (the most frequent pair)."""
        spell = {t for t in token_texts if t}
        kept = [p for p in pieces if len(p) >= 2 and all(c in spell for c in p)]
        inner = {p[:i] for p in kept for i in range(1, len(p))}
        common: dict[str, str] = {}
        for leaf in (p for p in kept if p not in inner):
            for i in range(1, len(leaf)):
                have, rest = common.get(leaf[:i], leaf[i:]), leaf[i:]
                same = next((j for j, (a, b) in enumerate(zip(have, rest)) if a != b), min(len(have), len(rest)))
                common[leaf[:i]] = have[:same]
        sure = {k: v for k, v in ((k, _one_unit(v)) for k, v in common.items()) if v}
        guesses: dict[str, str] = {}
        for piece in kept:
            for i in range(1, len(piece)):
                if piece[:i] not in sure:
                    guesses.setdefault(piece[:i], piece[i:])
        return cls(sure, token_texts, guesses)

    def propose(self, ids: Sequence[int], k: int, at_least: int = 0) -> list[int]:
        """The rest of the longest piece start the text written ends in: what every piece there goes on
        with; where they part at once, the ``at_least`` first characters of the most frequent one."""
        text = "".join(self.texts[i] if 0 <= i < len(self.texts) else "" for i in ids[-self.longest:])
        for n in range(min(self.longest, len(text)), 0, -1):
            start = text[-n:]
            rest = self.completions.get(start)
            if rest:
                return [self.spell[c] for c in rest[:k]]
            if start in self.guesses:
                return [self.spell[c] for c in self.guesses[start][:min(k, at_least)]]
        return []

    def to_json(self) -> dict:
        return {"completions": dict(sorted(self.completions.items())), "guesses": dict(sorted(self.guesses.items()))}

    @classmethod
    def from_json(cls, data: dict, token_texts: Sequence[str] = (), **_) -> "BpeDrafter":
        """(Drafters from before the guesses: their completions are the first merged piece's rest.)"""
        return cls(dict(data["completions"]), token_texts, dict(data.get("guesses", {})))


class StudentDrafter(NgramDrafter):
    """What follows the last tokens written in the student's reading of the image (the guide), else the
    ngram table. ``reader(memory) -> (guide ids, calls)`` (``pipeline/decoding.py: StudentReader`` in a
    package)."""

    kind = "student"

    def __init__(self, order: int, table: dict[tuple[int, ...], int], self_lookup: int = 0,
                 shares: dict[tuple[int, ...], float] | None = None, min_confidence: float = 0.0,
                 reader: Callable[[np.ndarray], tuple[list[int], int]] | None = None, min_match: int = 2,
                 student: dict | None = None, tail: int = 0):
        super().__init__(order, table, self_lookup, shares, min_confidence, tail)
        if min_match < 1 or min_match > order:
            raise ValueError(f"min_match must be 1..order ({order}), got {min_match}")
        self.reader, self.min_match, self.student = reader, int(min_match), dict(student or {})

    @classmethod
    def from_ngram(cls, ngram: NgramDrafter, student: dict, min_match: int = 2) -> "StudentDrafter":
        return cls(ngram.order, ngram.table, ngram.self_lookup, ngram.shares, ngram.min_confidence,
                   min_match=min_match, student=student, tail=ngram.tail)

    def begin(self, memory: np.ndarray) -> int:
        """Read ``memory`` with the student: the guide of this thread's next reading; its calls."""
        if self.reader is None:
            raise ValueError("the student drafter has no reader (its graphs were not loaded)")
        guide, calls = self.reader(memory)
        self.follow(guide)
        return calls

    def follow(self, guide: Sequence[int]) -> None:
        """Take ``guide`` as this thread's next reading's guide: its contexts of ``min_match``..``order``
        tokens -> where they end in it."""
        ends: dict[tuple[int, ...], list[int]] = collections.defaultdict(list)
        guide = [int(t) for t in guide]
        for end in range(1, len(guide)):
            for n in range(self.min_match, min(self.order, end) + 1):
                ends[tuple(guide[end - n:end])].append(end)
        self._local.guide, self._local.ends, self._local.cursor, self._local.entered = guide, ends, 0, False

    def _guided(self, ids: Sequence[int], k: int) -> list[int]:
        mine = self._local
        guide, ends = getattr(mine, "guide", None), getattr(mine, "ends", None)
        if not guide:
            return []
        for n in range(min(self.order, len(ids)), self.min_match - 1, -1):
            at = ends.get(tuple(ids[-n:]))
            if at:
                ahead = [e for e in at if e >= mine.cursor]
                end = ahead[0] if ahead else at[-1]
                mine.cursor, mine.entered = end, True
                return guide[end:end + k]
        return []

    def propose(self, ids: Sequence[int], k: int, at_least: int = 0) -> list[int]:
        """The guide where the last tokens occur in it; else the table (``at_least``: as the table
        reads it); else, while the reading has not reached the guide yet (the display wrapper, which the
        student does not write, just ended), the guide's start."""
        out = self._guided(ids, k) or super().propose(ids, k, at_least)
        if not out and not getattr(self._local, "entered", True):
            out = self._local.guide[:k]
        return out

    def to_json(self) -> dict:
        return {**super().to_json(), "min_match": self.min_match, "student": self.student}

    @classmethod
    def from_json(cls, data: dict, open_reader: Callable[[dict], Callable] | None = None, **_) -> "StudentDrafter":
        """``open_reader(student entry)``: the student's reader, on its graphs in the package (none: no
        reader, the table alone)."""
        ngram = NgramDrafter.from_json(data)
        student = dict(data["student"])
        reader = None if open_reader is None else open_reader(student)
        return cls(ngram.order, ngram.table, ngram.self_lookup, ngram.shares, ngram.min_confidence, reader,
                   int(data.get("min_match", 2)), student, ngram.tail)


DRAFTERS: dict[str, type] = {"ngram": NgramDrafter, "bpe": BpeDrafter, "student": StudentDrafter}


def save(drafter, path: Path, draft_len: int, source: dict) -> None:
    """``drafter.json``: the kind, how many tokens a call checks, where it was built from, the table."""
    payload = {"format": FORMAT, "kind": drafter.kind, "draft_len": int(draft_len), "source": source,
               **drafter.to_json()}
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, ensure_ascii=False, separators=(",", ":")))
    tmp.replace(path)


def load(path: Path, token_texts: Sequence[str] = (), open_reader: Callable[[dict], Callable] | None = None
         ) -> tuple[object, int]:
    """The drafter of a ``drafter.json`` and its draft length; a wrong file is a ``ValueError``.
    ``open_reader``: the reader of the student a drafter names (its ``student`` entry ->
    ``reader(memory) -> (guide ids, calls)``: ``pipeline/decoding.py: StudentReader``)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"drafter {path}: unreadable ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"drafter {path}: not a {FORMAT!r} file")
    kind = data.get("kind")
    if kind not in DRAFTERS:
        raise ValueError(f"drafter {path}: unknown kind {kind!r}; known: {', '.join(DRAFTERS)}")
    draft_len = data.get("draft_len")
    if not isinstance(draft_len, int) or draft_len < 1:
        raise ValueError(f"drafter {path}: draft_len must be an integer >= 1, got {draft_len!r}")
    try:
        drafter = DRAFTERS[kind].from_json(data, token_texts=token_texts, open_reader=open_reader)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"drafter {path}: a {kind} drafter without {exc}") from None
    return drafter, draft_len


