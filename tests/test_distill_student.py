"""The BPE student's initialisation from the char decoder (issue 14): pieces, rows, first-step logits."""
from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from pipeline.adapters.junia_student import init_student, piece_map
from pipeline.tokenization.bpe import token_strings
from pipeline.tokenization.atoms import normalize_formula
from pipeline.adapters.latex_ocr_junia import char_vocabulary as model_char_vocabulary
from pipeline.tokenization.train import SPECIALS, train_formula_bpe
from tests.tiny_model import FORMULAS, build_tiny


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    char = model_char_vocabulary()
    extra = [t for t in char.token_to_id if t not in SPECIALS]
    return train_formula_bpe([normalize_formula(f) for f in FORMULAS * 3], 400, extra_atoms=extra).tokenizer


def test_pieces_spell_every_token(bpe):
    char = model_char_vocabulary()
    strings = token_strings(bpe)
    pieces = piece_map(bpe, char)
    assert len(pieces) == bpe.get_vocab_size() == len(strings)
    for i, name in enumerate(SPECIALS):
        assert strings[i] == name and pieces[i] == [char.token_to_id[name]]
    multi = 0
    for text, ids in zip(strings[len(SPECIALS):], pieces[len(SPECIALS):]):
        assert "".join(char.id_to_token[j] for j in ids) == text
        multi += len(ids) > 1
    assert multi > 10  # \frac{, x_i ... : real multi-char entries, not only single chars
    frac = strings.index("\\frac")
    assert [char.id_to_token[j] for j in pieces[frac]] == list("\\frac")


def test_student_rows_and_first_step_logits(bpe):
    teacher = build_tiny()
    before = {k: v.clone() for k, v in teacher.model.state_dict().items()}
    pieces = piece_map(bpe, model_char_vocabulary())
    student, config = init_student(teacher.model, teacher.model_config, pieces)
    assert config.vocab_size == len(pieces) != teacher.model_config.vocab_size
    for k, v in teacher.model.state_dict().items():  # the char model is untouched
        assert torch.equal(v, before[k]), k
    emb_t, emb_s = teacher.model.decoder_embed.token_emb.weight, student.decoder_embed.token_emb.weight
    for i, p in enumerate(pieces):
        torch.testing.assert_close(emb_s[i], emb_t[p].mean(0))
        assert torch.equal(student.lm_head.weight[i], teacher.model.lm_head.weight[p[0]])
        assert torch.equal(student.lm_head.bias[i], teacher.model.lm_head.bias[p[0]])
    # every other weight is the char model's, so after <bos> the student ranks each BPE token as
    # the char model ranks its first character
    images = torch.rand(2, *teacher.input_shape)
    with torch.no_grad():
        memory = teacher.encode(images)
        bos = torch.full((2, 1), teacher.bos_id)
        char_logits = teacher.decode_logits(bos, memory)[:, -1]
        bpe_logits = student.decode(bos, memory)[:, -1]
    first = torch.tensor([p[0] for p in pieces])
    torch.testing.assert_close(bpe_logits, char_logits[:, first])
    # the student is an ordinary model of the new size: a fresh build loads its weights
    from pipeline.adapters.latex_ocr_junia import LatexOcrJuniaAdapter
    rebuilt = LatexOcrJuniaAdapter._build(config, teacher.encoder_head_counts())
    rebuilt.load_state_dict(student.state_dict())


def test_specials_must_keep_their_ids():
    from tokenizers import models
    vocab = {"<bos>": 0, "<pad>": 1, "<eos>": 2, "<unk>": 3, "a": 4}
    swapped = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    with pytest.raises(ValueError, match="<bos>"):
        piece_map(swapped, model_char_vocabulary())
    missing = Tokenizer(models.BPE(vocab={"<pad>": 0, "<bos>": 1, "<eos>": 2, "a": 3}, merges=[]))
    with pytest.raises(ValueError, match="unk"):
        piece_map(missing, model_char_vocabulary())


def test_bpe_tokenizer_round_trips_like_the_char_one(bpe):
    from pipeline.tokenization.bpe import BpeTokenizer
    tok = BpeTokenizer(bpe)
    char = model_char_vocabulary()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (char.pad_id, char.bos_id, char.eos_id, char.unk_id)
    for f in FORMULAS:
        ids = tok.encode(normalize_formula(f))
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and len(ids) < len(char.encode(f))
        assert tok.decode(ids[1:]) == normalize_formula(f)
        assert tok.decode(ids[1:] + [5, 6]) == normalize_formula(f)  # stops at EOS
    capped = tok.encode(normalize_formula(FORMULAS[2]), max_length=3)
    assert len(capped) == 3 and capped[-1] == tok.eos_id


def test_the_untrained_student_reads_like_the_char_model(bpe):
    """Single-char entries come before the merges, so a tie between a char and the longer entries it
    starts goes to the char (argmax takes the first): untrained, the student writes the char model's
    text one char at a time — training starts from the char model's readings, not from noise."""
    from pipeline.adapters.latex_ocr_junia import LatexOcrJuniaAdapter
    from pipeline.tokenization.bpe import BpeTokenizer
    teacher = build_tiny()
    student, config = init_student(teacher.model, teacher.model_config, piece_map(bpe, model_char_vocabulary()))
    reader = LatexOcrJuniaAdapter(student, config, BpeTokenizer(bpe), teacher.tokenizer_path)
    torch.manual_seed(1)
    images = torch.rand(4, *teacher.input_shape)
    want = teacher.generate(images, 24, use_cache=True)
    got = reader.generate(images, 24, use_cache=True)
    assert got.texts == want.texts and got.steps == want.steps
    assert any(want.texts)
