"""A decoder that speaks the formula BPE, initialised from the char-level decoder (issue 14, first part).

The student keeps every block of the char model (encoder, decoder blocks, norms, position table) and
gets a new token embedding and output layer of the BPE's size. Each BPE token is made of char pieces
(``\\frac{`` = ``\\ f r a c {``); its rows are built from theirs:

* **embedding**: the mean of its pieces' embeddings (a special token keeps its own row);
* **output row and bias**: its *first* piece's: the char model, at the step where the BPE token
  starts, predicts that token's first character, so the student starts by ranking BPE tokens as the
  char model ranks their first characters.

A piece the char vocabulary lacks maps to the char ``<unk>``. The BPE's specials (``<pad> <bos> <eos>
<unk>``, ids 0-3) are the char vocabulary's, so the decoding loop and the pad mask stay the same.
The training loop is :mod:`pipeline.distillation.train`, the stage ``pipeline/stages/distill.py``.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Sequence

import torch
from tokenizers import Tokenizer
from torch import nn

from pipeline.tokenization.bpe import token_strings

SPECIAL_NAMES = ("pad", "bos", "eos", "unk")


def piece_map(tokenizer: Tokenizer, char_tokenizer: Any) -> list[list[int]]:
    """For each BPE id, the char-vocabulary ids of the pieces it is written with.

    ``char_tokenizer`` is the model's char vocabulary (``token_to_id``, ``specials``, ``unk_id``).
    A BPE special maps to the char special of the same name, and the specials must keep their ids."""
    strings = token_strings(tokenizer)
    specials = {getattr(char_tokenizer.specials, n): char_tokenizer.token_to_id[getattr(char_tokenizer.specials, n)]
                for n in SPECIAL_NAMES}
    pieces: list[list[int]] = []
    for bpe_id, text in enumerate(strings):
        if text in specials:
            if specials[text] != bpe_id:
                raise ValueError(f"BPE special {text!r} has id {bpe_id}, the char vocabulary's is {specials[text]}")
            pieces.append([specials[text]])
            continue
        if not text:
            raise ValueError(f"BPE entry {bpe_id} is empty")
        pieces.append([char_tokenizer.token_to_id.get(ch, char_tokenizer.unk_id) for ch in text])
    missing = [n for n in SPECIAL_NAMES if getattr(char_tokenizer.specials, n) not in strings]
    if missing:
        raise ValueError(f"the BPE vocabulary lacks the specials {missing}")
    return pieces


@torch.no_grad()
def init_student(model: nn.Module, model_config: Any, pieces: Sequence[Sequence[int]]) -> tuple[nn.Module, Any]:
    """A copy of ``model`` (a latex-ocr-junia model: ``decoder_embed.token_emb``, ``lm_head``) whose
    token embedding and output layer have one row per BPE entry, built from ``pieces``; and the model
    config with the new ``vocab_size``. ``model`` itself is left as it was."""
    student = copy.deepcopy(model)
    old_emb = model.decoder_embed.token_emb.weight
    old_head = model.lm_head
    size = len(pieces)
    index = torch.zeros(size, max(len(p) for p in pieces), dtype=torch.long)
    weight = torch.zeros(size, index.shape[1])
    for i, p in enumerate(pieces):
        index[i, :len(p)] = torch.as_tensor(list(p))
        weight[i, :len(p)] = 1.0 / len(p)
    emb = nn.Embedding(size, old_emb.shape[1], padding_idx=model.decoder_embed.token_emb.padding_idx)
    emb.weight.copy_(torch.einsum("vk,vkd->vd", weight, old_emb[index]))
    student.decoder_embed.token_emb = emb
    first = index[:, 0]
    head = nn.Linear(old_head.in_features, size, bias=old_head.bias is not None)
    head.weight.copy_(old_head.weight[first])
    if old_head.bias is not None:
        head.bias.copy_(old_head.bias[first])
    student.lm_head = head
    config = dataclasses.replace(model_config, vocab_size=size)
    if hasattr(student, "config_obj"):
        student.config_obj = config
    return student.eval(), config
