"""The formula BPE (``tokenizer.json`` of HF ``tokenizers``) behind the char vocabulary's interface,
so a model adapter or an exported package decodes a BPE decoder unchanged. No torch here: the
package runtime reads it too."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer

from pipeline.errors import SchemaError
from pipeline.tokenization.hf import framed_ids
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0-3, as in the model's char vocabulary


def token_strings(tokenizer: Tokenizer) -> list[str]:
    """The BPE's entries by id (added tokens included); ids must cover 0 .. V-1 without gaps."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    by_id = {i: s for s, i in vocab.items()}
    if sorted(by_id) != list(range(len(by_id))):
        raise ValueError("the BPE vocabulary's ids are not contiguous from 0")
    return [by_id[i] for i in range(len(by_id))]


def is_bpe_file(path: str | Path) -> bool:
    """True for an HF ``tokenizers`` JSON (a ``model`` of type BPE), False for the char vocabulary's."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False  # the char loader names what is wrong with it
    return isinstance(data, dict) and isinstance(data.get("model"), dict) and data["model"].get("type") == "BPE"


class BpeTokenizer:
    """``bos_id`` ... ``vocab_size``, ``encode(text, max_length)`` (BOS ... EOS), ``decode(ids)``
    stopping at EOS: the interface of the model's char vocabulary."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        strings = token_strings(tokenizer)
        missing = [s for s in SPECIALS if s not in strings]
        if missing:
            raise ValueError(f"the BPE vocabulary lacks the specials {missing}")
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = (strings.index(s) for s in SPECIALS)

    @classmethod
    def from_file(cls, path: str | Path) -> "BpeTokenizer":
        path = Path(path)
        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as exc:  # tokenizers raises its own Exception type
            raise SchemaError(f"{path.name} in {path.parent}: not a usable BPE tokenizer "
                              f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, max_length: int | None = None) -> list[int]:
        return framed_ids(self.tokenizer, text, self.bos_id, self.eos_id, max_length)

    def decode(self, ids: Iterable[int]) -> str:
        out = []
        for i in ids:
            if int(i) == self.eos_id:
                break
            out.append(int(i))
        return self.tokenizer.decode(out, skip_special_tokens=True)
