"""Speculative greedy decoding (pipeline/decoding.py, pipeline/drafting.py): token for token what
plain greedy writes, whatever the drafter proposes, in fewer decoder calls when it proposes well.

The loop is checked first against a toy decoder in numpy whose next token depends on the whole
prefix (the K/V cache holds the tokens themselves, so a cache cut to the wrong length changes
what it writes); then on a tiny exported package (tests/test_speculative_package.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline import drafting
from pipeline.decoding import LayoutGuard, SpeculativeStats, speculative_greedy

VOCAB, BOS, EOS, PAD = 12, 1, 2, 0
TEXTS = ["", "", "", "a", "b", "c", "\\", ",", "&", "x", "y", "}"]  # ids 0-2: pad, BOS, EOS


class ToyDecoder:
    """Logits after a prefix: a fixed pseudo-random function of the last three tokens and the length,
    EOS likelier as the prefix grows. ``past``: the prefix itself as [1, 1, P, 1]."""

    def __init__(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.table = rng.standard_normal((VOCAB, VOCAB, VOCAB, VOCAB)).astype(np.float32)
        self.calls = 0

    def logits_after(self, prefix: list[int]) -> np.ndarray:
        a, b, c = ([0, 0] + prefix)[-3:]
        row = self.table[a, b, c].copy()
        row[EOS] += 0.15 * len(prefix) - 2.0
        return row

    def first(self, ids: np.ndarray):
        self.calls += 1
        prefix = ids[0].tolist()
        return self.logits_after(prefix)[None], [np.asarray(prefix, np.float32).reshape(1, 1, -1, 1)], []

    def verify(self, ids: np.ndarray, past: list, cross: list):
        self.calls += 1
        prefix = past[0].reshape(-1).astype(int).tolist()
        rows = []
        for t in ids[0].tolist():
            prefix.append(t)
            rows.append(self.logits_after(prefix))
        return np.stack(rows)[None], [np.asarray(prefix, np.float32).reshape(1, 1, -1, 1)]

    def greedy(self, max_length: int, guard: LayoutGuard | None = None) -> list[int]:
        """Plain greedy, one call a token (the reference)."""
        texts, prefix, out = [""], [BOS], []
        logits = self.first(np.asarray([[BOS]]))[0][0]
        while len(out) < max_length - 1:
            row = logits.copy()
            row[[PAD, BOS]] = -np.inf
            tok = int(row.argmax())
            if guard is not None:
                tok = guard.step(row[None], [tok], texts)[0]
            out.append(tok)
            prefix.append(tok)
            if tok == EOS:
                break
            logits = self.logits_after(prefix)
        return out


def oracle(truth: list[int]):
    """A drafter that knows the reading: proposes exactly its next tokens."""
    def propose(ids, k, at_least=0):
        n = len(ids) - 1
        return truth[n:n + k]
    return propose


def wrong(truth: list[int]):
    """A drafter that always proposes a token greedy does not write next."""
    def propose(ids, k, at_least=0):
        n = len(ids) - 1
        nxt = truth[n] if n < len(truth) else EOS
        return [3 if nxt != 3 else 4] * k
    return propose


def noisy(seed: int):
    rng = np.random.default_rng(seed)
    return lambda ids, k, at_least=0: rng.integers(0, VOCAB, size=int(rng.integers(0, k + 1))).tolist()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("cap", [0, 2])
def test_speculative_is_greedy_token_for_token_whatever_the_drafter(seed, k, cap):
    toy = ToyDecoder(seed)
    guard = LayoutGuard.for_vocabulary(TEXTS.__getitem__, VOCAB, EOS, cap) if cap else None
    for max_length in (2, 5, 40):
        want = toy.greedy(max_length, LayoutGuard(TEXTS, EOS, cap) if cap else None)
        own = drafting.NgramDrafter.build([toy.greedy(40)[3:], want[::2]], BOS, order=4, min_count=1, self_lookup=2)
        for name, propose in (("oracle", oracle(want)), ("wrong", wrong(want)), ("noisy", noisy(seed)),
                              ("none", lambda ids, kk, at_least=0: []), ("ngram, self lookup", own.propose)):
            stats = SpeculativeStats()
            got = speculative_greedy(toy.first, toy.verify, propose, BOS, EOS, [PAD, BOS], max_length, k,
                                     LayoutGuard(TEXTS, EOS, cap) if guard else None, stats)
            assert got == want, (name, max_length)
            assert stats.tokens == len(want)
            if name in ("wrong", "none"):  # one call a token, as plain greedy
                assert stats.calls == max(1, len(want)) and stats.accepted == 0
            if name == "oracle" and want:
                # the first call writes one token; each verify call then writes k + 1 (k accepted + its own)
                assert stats.calls == 1 + -(-(len(want) - 1) // (k + 1))


def test_k_equal_1_and_the_stats():
    toy = ToyDecoder(3)
    want = toy.greedy(40)
    stats = SpeculativeStats()
    assert speculative_greedy(toy.first, toy.verify, oracle(want), BOS, EOS, [PAD, BOS], 40, 1,
                              stats=stats) == want
    d = stats.as_dict()
    assert d["readings"] == 1 and d["tokens"] == len(want)
    assert 0 < d["accepted"] <= d["drafted"] and d["verify_calls"] == stats.calls - 1
    assert d["tokens_per_call"] == round(len(want) / stats.calls, 2)


def test_ngram_drafter_learns_what_the_model_writes_and_round_trips(tmp_path):
    wrapper = [3, 4, 5, 6, 7]  # a prefix every reading starts with
    readings = [wrapper + [9, 10, 11, EOS], wrapper + [9, 9, 11, EOS], wrapper + [10, 11, EOS]]
    d = drafting.NgramDrafter.build(readings, BOS, order=4, min_count=2)
    assert d.propose([BOS], 5) == wrapper                       # the wrapper after BOS
    assert d.propose([BOS, 3, 4], 3) == [5, 6, 7]
    assert d.propose([BOS, *wrapper, 9], 2) == []                # 9 was followed by 10, 9 and 11 once each
    assert d.propose([BOS, *wrapper, 10, 11], 2) == [EOS]        # 11 always ended the reading
    assert d.propose([8, 8, 8], 3) == []                         # an unseen context proposes nothing
    drafting.save(d, tmp_path / "drafter.json", 6, {"test": True})
    back, draft_len = drafting.load(tmp_path / "drafter.json")
    assert draft_len == 6 and back.table == d.table and back.order == 4
    with pytest.raises(ValueError):
        drafting.NgramDrafter.build(readings, BOS, order=0)


def test_ngram_self_lookup_proposes_what_followed_the_same_tokens_earlier_in_the_reading(tmp_path):
    table = drafting.NgramDrafter.build([[3, 4, EOS]], BOS, order=4, min_count=1)
    own = drafting.NgramDrafter.build([[3, 4, EOS]], BOS, order=4, min_count=1, self_lookup=2)
    reading = [BOS, 7, 8, 9, 3, 7, 8]                      # 7 8 was followed by 9 earlier in this reading
    assert table.propose(reading, 3) == []                 # the train readings never saw 7 8 / 8
    assert own.propose(reading, 3) == [9, 3, 7]            # 9 3 7: what followed 7 8 (and 8 9 3) before
    assert own.propose([BOS, 5, 6, 5], 1) == []            # one token of context: below self_lookup
    assert own.propose([BOS, 3], 2) == [4, EOS]            # another reading: the table (nothing of the last one)
    drafting.save(own, tmp_path / "drafter.json", 4, {})
    back, _ = drafting.load(tmp_path / "drafter.json")
    assert back.self_lookup == 2 and back.propose(reading, 3) == [9, 3, 7]
    with pytest.raises(ValueError, match="self_lookup"):
        drafting.NgramDrafter.build([[3]], BOS, order=2, self_lookup=3)


def test_ngram_min_confidence_cuts_the_draft_where_the_chain_grows_unsure(tmp_path):
    # after BOS: 3 (4 of 4 readings), then 4 (3 of 4), then 5 (2 of 3 after 3 4), then EOS (always)
    readings = [[3, 4, 5, EOS], [3, 4, 5, EOS], [3, 4, 6, EOS], [3, 7, EOS]]
    sure = drafting.NgramDrafter.build(readings, BOS, order=3, min_count=1)
    assert sure.shares[(BOS,)] == 1.0 and sure.shares[(BOS, 3)] == 0.75 and sure.shares[(BOS, 3, 4)] == 0.667
    assert sure.propose([BOS], 4) == [3, 4, 5, EOS]                   # 0: the whole chain
    for confidence, want in ((0.5, [3, 4, 5, EOS]), (0.7, [3, 4]), (0.8, [3]), (1.0, [3])):
        d = drafting.NgramDrafter.build(readings, BOS, order=3, min_count=1, min_confidence=confidence)
        assert d.propose([BOS], 4) == want, confidence                # 1 x 0.75 x 0.667 = 0.5 (x 1 for EOS)
    d = drafting.NgramDrafter.build(readings, BOS, order=3, min_count=1, min_confidence=0.8)
    assert d.propose([BOS, 3], 4) == []                               # the first draft already below: none
    drafting.save(d, tmp_path / "drafter.json", 4, {})
    back, _ = drafting.load(tmp_path / "drafter.json")
    assert back.min_confidence == 0.8 and back.shares == d.shares and back.propose([BOS], 4) == [3]
    # a drafter.json from before the shares (the table maps to tokens): every share 1
    data = json.loads((tmp_path / "drafter.json").read_text())
    data["table"] = {k: v[0] for k, v in data["table"].items()}
    del data["min_confidence"]
    (tmp_path / "drafter.json").write_text(json.dumps(data))
    old, _ = drafting.load(tmp_path / "drafter.json")
    assert old.propose([BOS], 4) == [3, 4, 5, EOS] and old.min_confidence == 0.0
    with pytest.raises(ValueError, match="min_confidence"):
        drafting.NgramDrafter.build(readings, BOS, order=3, min_confidence=1.5)


def test_at_least_proposes_the_best_guess_below_the_confidence_and_the_loop_fills_the_free_row():
    """A lone token's verify call is padded to two rows anyway (VerifyCalls.free_drafts): the loop asks
    the drafter for at least one draft there (``min_drafts``), its best guess however unsure; the reading
    is greedy's still, in fewer calls where the guess passes."""
    from pipeline.decoding import VerifyCalls

    readings = [[3, 4, 5, EOS], [3, 4, 5, EOS], [3, 4, 6, EOS], [3, 7, EOS]]
    d = drafting.NgramDrafter.build(readings, BOS, order=3, min_count=1, min_confidence=0.8)
    assert d.propose([BOS, 3], 4) == [] and d.propose([BOS, 3], 4, at_least=1) == [4]  # 0.75 < 0.8: a guess
    assert d.propose([BOS], 4, at_least=1) == [3]                        # a sure draft: the confidence decides
    assert d.propose([BOS, 3], 4, at_least=2) == [4, 5]
    assert d.propose([8, 8], 4, at_least=1) == []                        # no continuation: no guess
    assert drafting.BpeDrafter({"\\f": "rac{"}, TEXTS).propose([BOS], 2, at_least=1) == []

    toy = ToyDecoder(2)
    want = toy.greedy(40)
    table = drafting.NgramDrafter.build([want], BOS, order=2, min_count=1).table
    unsure = drafting.NgramDrafter(2, table, 0, {c: 0.5 for c in table}, 0.9)  # every continuation half sure
    assert unsure.propose([BOS], 4) == []

    def run(ids, past, cross):
        return toy.verify(ids, past, cross)

    def step(ids, past, cross):
        logits, present = toy.verify(ids, past, cross)
        return logits[:, 0], present

    assert VerifyCalls(run, step, 4, 60).free_drafts == 1 and VerifyCalls(run, step, 4, 60, fixed=True).free_drafts == 0
    calls = {}
    for free in (0, 1):
        stats = SpeculativeStats()
        got = speculative_greedy(toy.first, VerifyCalls(run, step, 4, 60), unsure.propose, BOS, EOS, [PAD, BOS], 40, 3,
                                 stats=stats, min_drafts=free)
        assert got == want
        calls[free] = stats.calls
        assert stats.drafted == (0 if free == 0 else stats.verify_calls)  # one guess a call, in the free row
    assert calls[0] == len(want) and calls[1] < calls[0]  # the reading's own table: its guesses pass


def test_tail_drafts_guesses_after_the_confident_ones_and_round_trips(tmp_path):
    # after BOS: 3 (share 1), then 4 (0.75), then 5 (0.667), then EOS (1): confidence 1, 0.75, 0.5, 0.5
    readings = [[3, 4, 5, EOS], [3, 4, 5, EOS], [3, 4, 6, EOS], [3, 7, EOS]]
    for tail, want in ((0, [3]), (1, [3, 4]), (2, [3, 4, 5]), (5, [3, 4, 5, EOS])):
        d = drafting.NgramDrafter.build(readings, BOS, order=3, min_count=1, min_confidence=0.8, tail=tail)
        assert d.propose([BOS], 4) == want, tail
    d = drafting.NgramDrafter.build(readings, BOS, order=3, min_count=1, min_confidence=0.8, tail=1)
    assert d.propose([BOS], 1) == [3]                                  # k still caps the draft
    assert d.propose([BOS, 3], 4) == [4] and d.propose([BOS, 3], 4, at_least=2) == [4, 5]  # at_least: the larger
    drafting.save(d, tmp_path / "drafter.json", 4, {})
    back, _ = drafting.load(tmp_path / "drafter.json")
    assert back.tail == 1 and back.propose([BOS], 4) == [3, 4]
    student = drafting.StudentDrafter.from_ngram(d, {}, 2)
    assert student.tail == 1 and student.propose([BOS], 4) == [3, 4]
    with pytest.raises(ValueError, match="tail"):
        drafting.NgramDrafter.build(readings, BOS, order=3, tail=-1)


def test_bpe_drafter_completes_a_piece_as_far_as_every_longer_piece_goes(tmp_path):
    """Pieces in merge order, as a BPE trainer writes them: ``\\f`` first, then each longer one."""
    texts = ["", "", ""] + list("\\frac{}12xleqt^()")
    pieces = ["\\f", "\\fr", "\\fra", "\\frac", "\\frac{", "\\le", "^{", "\\leq", "\\lef", "\\frac{1}{",
              "\\left", "\\left(", "\\frac{x}{", "\\frac{1}{2}", "xx})^{\\frac"]
    d = drafting.BpeDrafter.build(pieces, texts)
    ids = {t: i for i, t in enumerate(texts) if t}

    def after(text: str, k: int = 8, at_least: int = 0) -> str:
        return "".join(texts[i] for i in d.propose([BOS, *(ids[c] for c in text)], k, at_least))

    assert after("\\f") == "rac{" and after("2\\fra") == "c{"     # every longer piece goes on so, to its group
    assert after("\\f", k=2) == "ra"
    assert after("\\frac{") == "" and after("\\frac{", at_least=1) == "1"  # they part at once: the first merged
    assert after("\\le") == "" and after("\\le", at_least=2) == "q"        # ... guessed when asked (\\leq: its rest)
    assert after("\\lef") == "t(" and after("^") == "{"
    assert after("xx") == ""                              # what one piece wrote on past a group's end: not sure
    assert after("t") == "" and after("t", at_least=3) == ""  # no piece starts so: nothing
    drafting.save(d, tmp_path / "drafter.json", 8, {})
    back, _ = drafting.load(tmp_path / "drafter.json", texts)
    assert back.completions == d.completions and back.guesses == d.guesses
    old = drafting.BpeDrafter({"\\f": "r"}, texts)                   # a file from before the guesses
    assert old.propose([BOS, ids["\\"], ids["f"]], 8) == [ids["r"]]


def test_student_drafter_follows_its_guide_and_falls_back_to_the_table(tmp_path):
    table = drafting.NgramDrafter.build([[5, 6, 7, EOS]], BOS, order=4, min_count=1)
    d = drafting.StudentDrafter.from_ngram(table, {"first": "f.onnx"}, min_match=2)
    guide = [10, 11, 12, 13, 10, 11, 14, 15]  # the student's reading: 10 11 twice
    d.reader = lambda memory: (guide, 3)
    assert d.begin(np.zeros((1, 4, 2), dtype=np.float32)) == 3
    assert d.propose([BOS, 5], 3) == [6, 7, EOS]                        # not in the guide: the table
    assert d.propose([BOS, 8, 9], 3) == [10, 11, 12]                    # nor the table, guide not reached: its start
    assert d.propose([BOS, 9, 10, 11], 3) == [12, 13, 10]               # the first 10 11
    assert d.propose([BOS, 9, 10, 11, 12, 13, 10, 11], 3) == [14, 15]   # the longer context: the second
    assert d.propose([BOS, 9, 10, 11], 3) == [14, 15]                   # 10 11 again: the one after the last followed
    assert d.propose([BOS, 11, 12], 8) == [13, 10, 11, 14, 15]          # to the guide's end
    assert d.propose([BOS, 3, 10], 3) == []                             # one token of context: below min_match
                                                                        # (the guide was reached: not its start)
    d.reader = lambda memory: ([20, 21, 22], 1)                         # the next reading: its own guide
    d.begin(None)
    assert d.propose([BOS, 10, 11], 3) == [20, 21, 22]                  # nothing of the last one: this one's start
    assert d.propose([BOS, 20, 21], 3) == [22] and d.propose([BOS, 8, 9], 3) == []
    drafting.save(d, tmp_path / "drafter.json", 4, {})
    back, draft_len = drafting.load(tmp_path / "drafter.json")       # no graphs to open: no reader
    assert draft_len == 4 and back.kind == "student" and back.student == {"first": "f.onnx"}
    assert back.min_match == 2 and back.table == table.table and back.propose([BOS, 5], 3) == [6, 7, EOS]
    with pytest.raises(ValueError, match="no reader"):
        back.begin(None)
    data = json.loads((tmp_path / "drafter.json").read_text())
    del data["student"]
    (tmp_path / "drafter.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="a student drafter without 'student'"):
        drafting.load(tmp_path / "drafter.json")
    with pytest.raises(ValueError, match="min_match"):
        drafting.StudentDrafter.from_ngram(table, {}, min_match=5)


class _ScriptedSession:
    """An ONNX Runtime session's ``run`` for a student decoder that writes ``script`` (one BPE id a call),
    its cache one [1, 1, P, 1] tensor a layer and kind (num_layers 1)."""

    def __init__(self, script: list[int], vocab: int, first: bool):
        self.script, self.vocab, self.first, self.feeds = script, vocab, first, []

    def run(self, _, feed):
        self.feeds.append(feed)
        past = feed.get("past_key_0", np.zeros((1, 1, 0, 1), dtype=np.float32))
        at = past.shape[2] + 1 if not self.first else 1  # tokens read so far: BOS + the steps
        logits = np.zeros((1, self.vocab), dtype=np.float32)
        logits[0, self.script[min(at - 1, len(self.script) - 1)]] = 1.0
        grown = np.zeros((1, 1, at, 1), dtype=np.float32)
        return [logits, grown, grown] if not self.first else [logits, grown, grown, np.ones((1, 1, 4, 1)),
                                                               np.ones((1, 1, 4, 1))]


@pytest.mark.parametrize("script,pieces,max_tokens,guide,calls", [
    ([3, 4, EOS], [[], [], [], [5, 6], [7]], 10, [5, 6, 7], 3),             # EOS ends it
    ([3, 3, 3, 3], [[], [], [], [5, 6, 7]], 5, [5, 6, 7, 5, 6], 2),         # 6 spelled >= 5: no third call
    ([3, 9, 3], [[], [], [], [5]], 10, [5], 2),                             # an id the spelling lacks: the end
    ([EOS], [[], [], [], [5]], 10, [], 1),                                  # nothing read
])
def test_a_student_reader_spells_its_greedy_reading_and_stops_at_the_guides_length(script, pieces, max_tokens,
                                                                                  guide, calls):
    from pipeline.decoding import StudentReader

    first, step = _ScriptedSession(script, 10, True), _ScriptedSession(script, 10, False)
    reader = StudentReader(first, step, ["input_ids", "past_key_0", "past_value_0", "cross_key_0", "cross_value_0"],
                           1, BOS, EOS, [PAD, BOS], pieces, max_tokens)
    assert reader(np.zeros((1, 4, 2), dtype=np.float32)) == (guide, calls)
    assert len(step.feeds) == calls - 1 and [int(f["input_ids"][0, 0]) for f in step.feeds] == script[:calls - 1]
    assert int(first.feeds[0]["input_ids"][0, 0]) == BOS


@pytest.mark.parametrize("payload,needle", [
    ("not json", "unreadable"),
    (json.dumps({"format": "other"}), "not a"),
    (json.dumps({"format": drafting.FORMAT, "kind": "magic", "draft_len": 4}), "unknown kind 'magic'"),
    (json.dumps({"format": drafting.FORMAT, "kind": "ngram", "draft_len": 0}), "draft_len"),
])
def test_a_broken_drafter_file_is_one_clear_error(tmp_path, payload, needle):
    (tmp_path / "drafter.json").write_text(payload)
    with pytest.raises(ValueError, match=needle):
        drafting.load(tmp_path / "drafter.json")


@pytest.mark.parametrize("fixed", [False, True])
@pytest.mark.parametrize("positions", [12, 40])
def test_verify_calls_read_the_drafts_and_step_near_the_position_table(positions, fixed):
    """A call reads the last token and the drafts, a lone token (nothing drafted) padded to two rows (a
    graph of fixed width, from older packages: padded to it, a lone token to the step graph; the padded
    positions' logits unused, their K/V cut); where a call would pass the position table, the tokens go
    one step each."""
    from pipeline.decoding import VerifyCalls

    toy = ToyDecoder(5)
    widths = []

    def run(ids, past, cross):
        widths.append(ids.shape[1])
        assert past[0].shape[2] + ids.shape[1] <= positions  # never past the table
        return toy.verify(ids, past, cross)

    steps = []

    def step(ids, past, cross):
        steps.append(ids.shape[1])
        logits, present = toy.verify(ids, past, cross)
        return logits[:, 0], present

    want = toy.greedy(30)
    for propose in (oracle(want), noisy(1)):
        widths.clear(), steps.clear()
        fed = []

        def counted(ids, k, at_least=0, propose=propose):
            out = propose(ids, k, at_least)
            fed.append(1 + len(out))
            return out

        verify = VerifyCalls(run, step, 4, positions, fixed)
        got = speculative_greedy(toy.first, verify, counted, BOS, EOS, [PAD, BOS], 30, 3)
        assert got == want
        if positions == 40:  # the table never in the way: a call of two or more tokens is one verify call
            assert widths == ([4] * len(widths) if fixed else [max(n, 2) for n in fed])
            assert steps == ([1] * sum(n == 1 for n in fed) if fixed else [])
    with pytest.raises(ValueError, match="5 tokens for a verify graph of width 4"):
        VerifyCalls(run, step, 4, positions, fixed)(np.ones((1, 5), np.int64), *toy.first(np.ones((1, 1), np.int64))[1:])
    widths.clear(), steps.clear()
    got = speculative_greedy(toy.first, VerifyCalls(run, step, 4, positions, fixed), lambda ids, k, at_least=0: [],
                             BOS, EOS, [PAD, BOS], 30, 3)
    assert got == want
    if fixed:  # nothing drafted: plain steps
        assert widths == [] and steps == [1] * (len(want) - 1)
    else:      # nothing drafted: every token its own verify call of two rows (the table's end: steps)
        assert set(widths) == {2} and len(widths) + len(steps) == len(want) - 1
        assert steps == ([] if positions == 40 else [1] * len(steps))



def test_export_fails_a_package_whose_speculative_check_shows_a_broken_loop_or_a_confident_flip():
    """Stage export's verdict on a package's speculative check (pipeline/export/drafter.py: check)."""
    from pipeline.export.drafter import verdict

    good = {"n": 32, "identical": 0.97, "verify_greedy_differing": [], "max_tie_margin": 0.06}
    assert verdict(good, min_identical=0.8, tie_margin=0.25) == []
    broken = verdict({**good, "verify_greedy_differing": [3, 9]}, 0.8, 0.25)
    assert len(broken) == 1 and "2 of 32 readings differ from greedy decoding on the verify graph" in broken[0]
    few = verdict({**good, "identical": 0.5}, 0.8, 0.25)
    assert len(few) == 1 and "0.500 of 32 formulas < export.min_speculative_identical=0.8" in few[0]
    wide = verdict({**good, "max_tie_margin": 1.5}, 0.8, 0.25)
    assert len(wide) == 1 and "1.500 apart > export.speculative_tie_margin=0.25" in wide[0]
    assert "export.drafter=none ships plain greedy" in wide[0]  # what a user does about it
