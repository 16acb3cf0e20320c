"""Training the formula-aware BPE, the plain byte-level BPE it is compared with, and loading the
char-level vocabulary the model uses today.

HF BPE merges adjacent symbols inside a pre-tokenizer word, starting from single characters, so
three things make it atom-aware without any Python callback at serving time:

* **Learning over atoms.** Every atom of the alphabet is written as one private-use character and
  ``tokenizers``' own ``BpeTrainer`` learns merges over those strings; each learned merge therefore
  joins whole atoms (``^`` + ``{`` + ``2`` + ``}`` -> ``^{2}``, ``\\frac`` + ``{`` -> ``\\frac{``).
  The merges are written back in real text.
* **Assembling commands first.** A command is spelled with several characters, so the vocabulary
  also holds its prefixes (``\\``, ``\\f``, ``\\fr`` ...) and the merge list starts with the chains
  that build every command of the alphabet from its characters. BPE applies merges by rank, so every
  command is whole before any learned merge runs; a chain's left side starts with ``\\`` and can
  only grow inside its own command.
* **Known commands training never saw** (the renderer's table: ``\\nabla``, ``\\oplus`` ...) are
  added tokens, one entry each, matched whole (longest first) before BPE, so they are not spelled in
  pieces either; so is the line break ``\\\\``.

The result is an ordinary ``tokenizer.json`` (BPE model, Split pre-tokenizer, Replace normalizers,
Fuse decoder, bos/eos template) that ``tokenizers`` and ``transformers`` load as is.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pipeline.errors import PipelineError
from pipeline.tokenization.atoms import atoms, build_normalizer, build_pre_tokenizer, is_command, words
from pipeline.tokenization.bpe import SPECIALS  # <pad> <bos> <eos> <unk>, ids 0-3

PAD, BOS, EOS, UNK = SPECIALS
LINE_BREAK = "\\\\"
_PUA = (0xE000, 0xF8FF)  # Unicode private-use area: one character per atom while learning merges


@dataclass
class TrainedTokenizer:
    tokenizer: Tokenizer
    alphabet: list[str]                  # the atoms every merge starts from
    command_prefixes: list[str]          # vocabulary entries that only assemble commands
    whole_commands: list[str]            # commands matched whole before BPE (added tokens)
    learned_merges: int                  # merges learned over atoms
    stats: dict = field(default_factory=dict)


def _prefix_entries(alphabet: set[str]) -> set[str]:
    """Entries the chains need besides the atoms: each command's characters and proper prefixes."""
    internal: set[str] = set()
    for atom in alphabet:
        if is_command(atom):
            internal.update(atom)
            internal.update(atom[:k] for k in range(1, len(atom)))
    return internal - alphabet - set(SPECIALS)


def plan_alphabet(train_atoms: Iterable[str], extra_atoms: Iterable[str] = (),
                  known_commands: Iterable[str] = ()) -> dict:
    """Split the atoms a tokenizer must write whole into BPE alphabet, chain prefixes and added tokens.

    Atoms of the training formulas and ``extra_atoms`` form the BPE alphabet. A known command outside
    it becomes an added token (matched whole, longest first, before BPE) unless it is a prefix of an
    alphabet command: that one is a chain node already, so it comes out whole by itself. ``\\\\``
    (line break) is always an added token, so that in ``\\\\nabla`` the backslash pair is taken first
    and ``\\nabla`` never matches one character too late.
    """
    alphabet = (set(train_atoms) | {a for x in extra_atoms for a in atoms(x)}) - set(SPECIALS) - {LINE_BREAK}
    internal = _prefix_entries(alphabet)
    whole = {c for c in known_commands if is_command(c) and atoms(c) == [c]} | {LINE_BREAK}
    whole -= alphabet | internal
    needed = len(SPECIALS) + len(alphabet) + len(internal) + len(whole)
    return {"alphabet": sorted(alphabet), "internal": sorted(internal), "whole": sorted(whole), "needed": needed}


def train_formula_bpe(normalized: Sequence[str], vocab_size: int, extra_atoms: Iterable[str] = (),
                      known_commands: Iterable[str] = (), min_frequency: int = 2,
                      max_token_atoms: int | None = None, min_formulas: int = 1) -> TrainedTokenizer:
    """Train the atom-aware BPE on normalized formulas. ``extra_atoms`` join the alphabet even when
    the training formulas do not use them (the model's current characters); ``known_commands`` are
    kept whole even when training never saw them (the renderer's command table).

    ``min_formulas``: a learned token must occur (whole atoms, inside a word) in at least this many
    distinct training formulas; ``BpeTrainer``'s ``min_frequency`` counts occurrences, so a phrase
    one formula repeats would pass it. The trainer learns past the budget, merges below the bar are
    dropped, and the first ones that fit the budget are kept, in the trainer's order. A token's
    parts occur wherever it does, so every kept merge's parts are kept too."""
    # words of atoms; a line break is an added token, so it ends a word for training as at serving
    word_atoms: list[list[list[str]]] = []
    for f in normalized:
        pieces = []
        for w in words(f):
            run: list[str] = []
            for a in atoms(w) + [LINE_BREAK]:
                if a == LINE_BREAK:
                    if run:
                        pieces.append(run)
                    run = []
                else:
                    run.append(a)
        word_atoms.append(pieces)
    counts = Counter(a for f in word_atoms for w in f for a in w)
    plan = plan_alphabet(counts, extra_atoms, known_commands)
    alphabet, internal, whole = plan["alphabet"], plan["internal"], plan["whole"]
    if vocab_size < plan["needed"]:
        raise PipelineError(
            f"tokenizer.vocab_size={vocab_size} is smaller than the atom alphabet: {len(alphabet)} atoms + "
            f"{len(internal)} command prefixes + {len(whole)} whole commands + {len(SPECIALS)} special tokens "
            f"= {plan['needed']}; use at least {plan['needed']}")
    if len(alphabet) > _PUA[1] - _PUA[0] + 1:
        raise PipelineError(f"the atom alphabet has {len(alphabet)} atoms, more than this trainer can map")
    to_pua = {a: chr(_PUA[0] + i) for i, a in enumerate(alphabet)}
    from_pua = {v: k for k, v in to_pua.items()}

    # Learn merges over atoms with the library's trainer: each word is a string of private-use
    # characters, words are separated by real spaces, and the training pre-tokenizer splits on them.
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if min_formulas < 1:
        raise PipelineError(f"min_formulas must be at least 1, got {min_formulas}")
    budget = vocab_size - len(SPECIALS) - len(internal) - len(whole)
    trainer = trainers.BpeTrainer(
        # with a formula bar, learn past the budget: the merges below the bar leave room for others
        vocab_size=budget if min_formulas == 1 else budget + 4 * (budget - len(alphabet)),
        min_frequency=min_frequency,
        special_tokens=[], initial_alphabet=list(to_pua.values()), limit_alphabet=len(alphabet),
        show_progress=False, max_token_length=max_token_atoms)
    lines = [" ".join("".join(to_pua[a] for a in w) for w in f) for f in word_atoms]
    trainer_tok.train_from_iterator(lines, trainer=trainer, length=len(word_atoms))
    learned = [tuple(p.split(" ")) if isinstance(p, str) else tuple(p)
               for p in json.loads(trainer_tok.to_str())["model"]["merges"]]
    if min_formulas > 1:
        learned = [(left, right) for left, right in learned
                   if sum(left + right in line for line in lines) >= min_formulas]
        learned = learned[:max(budget - len(alphabet), 0)]

    def text(pua: str) -> str:
        return "".join(from_pua[c] for c in pua)

    vocab: dict[str, int] = {}
    for token in [*SPECIALS, *sorted(set(alphabet) | set(internal), key=lambda s: (len(s), s))]:
        vocab[token] = len(vocab)
    # chains first: every command of the alphabet is whole before any learned merge runs
    chain = {(a[:k - 1], a[k - 1]) for a in alphabet if is_command(a) for k in range(2, len(a) + 1)}
    merges: list[tuple[str, str]] = sorted(chain, key=lambda m: (len(m[0]), m))
    for left, right in learned:
        merged = text(left) + text(right)
        if merged in vocab:  # an atom string is unique (the atom regex reads it one way only)
            raise PipelineError(f"internal: learned token {merged!r} collides with an existing entry")
        vocab[merged] = len(vocab)
        merges.append((text(left), text(right)))

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=UNK, fuse_unk=False))
    tok.normalizer = build_normalizer()
    tok.pre_tokenizer = build_pre_tokenizer()
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}", special_tokens=[(BOS, vocab[BOS]), (EOS, vocab[EOS])])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    # whole commands are matched in the normalized text, longest first, before pre-tokenization
    tok.add_tokens([AddedToken(c, special=False, normalized=True) for c in whole])
    return TrainedTokenizer(tok, alphabet, internal, whole, len(learned),
                            stats={"atoms_in_train": sum(counts.values()), "train_formulas": len(normalized)})


def train_plain_bpe(normalized: Sequence[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """The baseline: byte-level BPE trained the way pix2tex does (``ByteLevelBPETokenizer``: GPT-2
    byte-level pre-tokenizer and decoder, no prefix space), same data, same vocabulary size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(normalized), trainer=trainer, length=len(normalized))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}", special_tokens=[(BOS, tok.token_to_id(BOS)), (EOS, tok.token_to_id(EOS))])
    return tok
