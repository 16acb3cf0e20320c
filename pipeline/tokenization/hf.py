"""Any Hugging Face ``tokenizers`` JSON (TrOCR's RoBERTa byte-level BPE, mBART's unigram, ...) behind
the char vocabulary's interface, with the model's own special ids given by the caller (they live in
the model's config, not always in the tokenizer). No torch here: the package runtime reads it too."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer

from pipeline.errors import SchemaError


def framed_ids(tokenizer: Tokenizer, text: str, bos_id: int, eos_id: int, max_length: int | None = None) -> list[int]:
    """BOS + ``tokenizer``'s ids for ``text`` (its own specials left out) + EOS, cut to ``max_length``
    with EOS kept last: the target sequence a decoder is trained and teacher-forced on."""
    ids = [bos_id, *tokenizer.encode(text, add_special_tokens=False).ids, eos_id]
    if max_length is not None:
        if max_length < 2:
            raise ValueError("max_length must be at least 2")
        ids = ids[:max_length]
        ids[-1] = eos_id
    return ids


class HfTokenizer:
    """``encode(text)`` -> BOS + ids + EOS; ``decode(ids)`` stops at the first EOS, drops special
    tokens and joins the rest as the tokenizer's own decoder does (byte-level BPE: plain text)."""

    def __init__(self, path: str | Path, bos_id: int, eos_id: int, pad_id: int | None = None):
        path = Path(path)
        where = f"{path.name} in {path.parent}"
        if not path.is_file():
            raise SchemaError(f"{where}: the tokenizer file is missing")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises its own Exception type
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise SchemaError(f"{where}: not a usable Hugging Face tokenizer ({reason})") from None
        self.path = path
        size = self.vocab_size
        for name, value in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id)):
            if value is None and name == "pad_id":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < size:
                raise SchemaError(f"{where}: {name} {value!r} is not a token id of its vocabulary (0 .. {size - 1})")
        self.bos_id, self.eos_id, self.pad_id = int(bos_id), int(eos_id), None if pad_id is None else int(pad_id)
        self._model_specials = {i for i in (self.bos_id, self.eos_id, self.pad_id) if i is not None}

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_strings(self) -> list[str]:
        """Every id's token string, in id order ("" for an id the vocabulary skips)."""
        return [self.tokenizer.id_to_token(i) or "" for i in range(self.vocab_size)]

    def encode(self, text: str, max_length: int | None = None) -> list[int]:
        return framed_ids(self.tokenizer, text, self.bos_id, self.eos_id, max_length)

    def decode(self, ids: Iterable[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i not in self._model_specials:  # the model's BOS/pad, special in the tokenizer or not
                out.append(i)
        return self.tokenizer.decode(out, skip_special_tokens=True)
