"""Greedy decoding's cap on layout-only runs (pipeline/decoding.py): what counts as a run, which
token gives way, and that torch, the package runtime and the MacaRT decode script apply it alike
(on a tiny model whose every step prefers the same layout token: a runaway by construction)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from tiny_model import FORMULAS, build_tiny, fake_ctx
from pipeline.decoding import LayoutGuard, layout_run


@pytest.mark.parametrize("text,run", [
    ("x\\!\\!\\!", 3),               # three negative spaces
    ("x\\!\\!\\", 2),                # a lone backslash may still become \end: not counted yet
    ("x\\qquad\\qquad", 1),          # the last command may still grow (\qquadx is another word)
    ("x\\qquad\\qquad}", 0),         # a brace ends the run
    ("a & & &", 6),                  # alignment marks and the spaces between them
    ("\\frac{a}{b}\\\\\\\\\\\\", 3),  # line breaks
    ("\\scriptstyle\\scriptstyle x", 0),
    ("", 0),
])
def test_layout_run_counts_the_trailing_layout_atoms(text, run):
    assert layout_run(text) == run


def test_guard_keeps_a_run_at_the_cap_and_takes_the_next_best_token():
    texts = ["<pad>", "<bos>", "", "\\", "!", "x", "&", "}"]  # id 2 is EOS
    guard = LayoutGuard(texts, eos_id=2, cap=2)
    logits = np.array([[-np.inf, -np.inf, 0.0, 1.0, 5.0, 2.0, 4.0, 3.0]] * 3, dtype=np.float32)
    rows = ["a\\!\\!\\", "a\\!\\", "a&&"]
    # row 0: "!" would write a third \! -> the next best that does not: "&" (an escaped \&, a
    # character, not layout); row 1: the second \! is within the cap; row 2: a plain "!" ends the run
    assert guard.step(logits, [4, 4, 4], rows) == [6, 4, 4]
    assert rows == ["a\\!\\!\\&", "a\\!\\!", "a&&!"]
    # "&" after "a&&" would be a third layout atom: the best token that is not one ("!") instead
    assert guard.step(logits[:1], [6], ["a&&"]) == [4]
    # EOS is never refused, and a token that cannot lengthen a run is not even checked
    assert guard.step(logits[:2], [2, 5], ["\\!\\!", "\\!\\!"]) == [2, 5]
    with pytest.raises(ValueError):
        LayoutGuard(texts, eos_id=2, cap=0)


@pytest.fixture(scope="module")
def looping(tmp_path_factory):
    """A tiny model whose output layer is its bias alone: "&" first, "x" second, at every step; and
    its package, exported with model.layout_run_cap=2."""
    from pipeline.stages import export

    root = tmp_path_factory.mktemp("decoding")
    adapter = build_tiny()
    amp, x = adapter.encode_text("&")[1], adapter.encode_text("x")[1]
    with torch.no_grad():
        head = adapter.model.lm_head
        head.weight.zero_()
        head.bias.fill_(-5.0)
        head.bias[amp], head.bias[x] = 5.0, 3.0
    adapter.save(root / "loop-model")
    (root / "formulas.txt").write_text("\n".join(FORMULAS[:2]) + "\n")
    ctx = fake_ctx(root, [f"export.model={root / 'loop-model'}", "export.quantized=none",
                          f"export.formulas={root / 'formulas.txt'}", "model.max_length=12", "model.layout_run_cap=2",
                          "export.parity_images=1", "export.parity_limit=2", "export.min_identical=1", "export.drafter=ngram"])
    export.run(OmegaConf.to_object(ctx.cfg.export), ctx)
    model = ctx.load_model(str(root / "loop-model"))
    images = torch.rand(2, *model.input_shape)
    return root, model, images


def test_torch_the_package_and_the_macart_script_cap_the_runaway_alike(looping):
    from pipeline.export.runtime import OnnxPackage

    root, model, images = looping
    package = OnnxPackage(root / "export-ort_cpu", threads=1)
    assert package.meta["layout_run_cap"] == 2 and model.layout_run_cap == 2
    want = "&&x&&x&&x&&"  # 11 tokens: the cap of 12 counts BOS
    for use_cache in (False, True):
        assert model.generate(images, 12, use_cache=use_cache).texts == [want, want]
    got = package.generate(images.numpy(), 12, batch_size=2)
    assert got.texts == [want, want]
    # batch 1: speculative decoding (the package's verify graph and ngram drafter), the guard applied alike
    assert package.speculative
    fast = package.generate(images.numpy(), 12, batch_size=1)
    assert fast.token_ids == got.token_ids and sum(fast.calls) < sum(got.steps)
    sys.path.insert(0, str(Path(__file__).parent))
    from macart_decode import Package

    script = Package(root / "export-ort_cpu", threads=1)
    assert script.greedy(script.encode(images.numpy()), 12) == got.token_ids
    assert [script.speculative(script.encode(im[None]), 12) for im in images.numpy()] == got.token_ids
    # without the cap the same model writes the loop to the end, in all three
    model.layout_run_cap = 0
    assert model.generate(images, 12).texts == ["&" * 11] * 2
    meta = json.loads((root / "export-ort_cpu" / "package.json").read_text())
    meta["layout_run_cap"] = 0
    (root / "export-ort_cpu" / "package.json").write_text(json.dumps(meta))
    assert OnnxPackage(root / "export-ort_cpu", threads=1).generate(images.numpy(), 12).texts == ["&" * 11] * 2
    assert OnnxPackage(root / "export-ort_cpu", threads=1).generate(images.numpy(), 12, batch_size=1).texts == \
        ["&" * 11] * 2
    script = Package(root / "export-ort_cpu", threads=1)
    assert script.greedy(script.encode(images.numpy()), 12) == [[43] * 11] * 2
    model.layout_run_cap = 2


def _row_rule(ids: np.ndarray, eos: int, amp: int, x: int, vocab: int) -> np.ndarray:
    """Logits for rows whose id is 0 (EOS at once) or 1 ("&" first, "x" second: a runaway)."""
    out = np.full((len(ids), vocab), -5.0, dtype=np.float32)
    for r, i in enumerate(ids):
        if i == 0:
            out[r, eos] = 5.0
        else:
            out[r, amp], out[r, x] = 5.0, 3.0
    return out


def test_rows_that_finish_early_leave_the_guard_with_their_text(looping, monkeypatch):
    """A batch where the middle row ends at once: the rows that stay keep their own readings (the
    guard's texts leave the batch with their rows), in torch and in the package runtime."""
    from pipeline.export.runtime import OnnxPackage

    _, model, _ = looping
    eos, amp, x, vocab = model.eos_id, model.encode_text("&")[1], model.encode_text("x")[1], model.vocab_size
    want = ["&&x&&x&&x&&", "", "&&x&&x&&x&&"]
    memory = torch.zeros(3, 2, 4)
    memory[[0, 2], 0, 0] = 1.0
    monkeypatch.setattr(model, "decode_logits", lambda seqs, mem: torch.from_numpy(
        _row_rule(mem[:, 0, 0].long().numpy(), eos, amp, x, vocab))[:, None, :].expand(-1, seqs.shape[1], -1))
    assert model.generate(memory, 12, encoded=True).texts == want

    class Scripted(OnnxPackage):
        def __init__(self, tokenizer):  # the decoding facts only: no graphs
            self.tokenizer, self.bos, self.eos, self.banned = tokenizer, model.bos_id, eos, [model.pad_id, model.bos_id]
            self.layout_run_cap, self._guard = 2, None

        def _vocab(self):
            return vocab

        def first(self, input_ids, memory):
            return _row_rule(memory[:, 0, 0].astype(int), eos, amp, x, vocab), [], [memory]

        def step(self, input_ids, past, cross):
            return _row_rule(cross[0][:, 0, 0].astype(int), eos, amp, x, vocab), past

    package = Scripted(type("Tok", (), {"decode": staticmethod(model.decode_text)})())
    ids = package.greedy_from_memory(memory.numpy(), 12)
    assert [model.decode_text(i) for i in ids] == want


def test_a_drafter_that_is_always_wrong_still_reads_greedy(looping, tmp_path):
    """Drafts of BOS (banned: greedy never writes it) at every position, the cap on: every draft is
    refused and each call writes the one token a plain step would."""
    import shutil

    from pipeline import drafting
    from pipeline.export.runtime import OnnxPackage

    root, model, images = looping
    pkg = tmp_path / "pkg"
    shutil.copytree(root / "export-ort_cpu", pkg)
    meta = json.loads((pkg / "package.json").read_text())
    meta["layout_run_cap"] = 2
    (pkg / "package.json").write_text(json.dumps(meta))
    table = {(i,): model.bos_id for i in range(model.vocab_size)}
    drafting.save(drafting.NgramDrafter(1, table), pkg / "drafter.json", 4, {"test": "always wrong"})
    fast, plain = OnnxPackage(pkg, threads=1), OnnxPackage(pkg, threads=1, speculative=False)
    got = fast.generate(images.numpy(), 12, batch_size=1)
    assert got.texts == ["&&x&&x&&x&&"] * 2
    assert got.token_ids == plain.generate(images.numpy(), 12, batch_size=1).token_ids
    stats = fast.spec_stats.as_dict()
    assert stats["accepted"] == 0 and stats["drafted"] > 0 and got.calls == got.steps


def test_bad_drafter_settings_are_one_clear_error(looping, tmp_path):
    from pipeline.errors import PipelineError
    from pipeline.export.runtime import OnnxPackage
    from pipeline.stages import export

    root, _, _ = looping
    for override, needle in (("export.draft_len=0", r"export\.draft_len must be >= 1, got 0"),
                             ("export.draft_len=9", r"export\.draft_len must be <= 8 .*got 9"),
                             ("export.min_speculative_identical=1.5",
                              r"export\.min_speculative_identical must be in \[0, 1\], got 1\.5"),
                             ("export.ngram_self_lookup=13", r"export\.ngram_self_lookup must be 0 \(off\) or "
                                                             r"1\.\.export\.ngram_order \(12\), got 13"),
                             ("export.ngram_tail=-1", r"export\.ngram_tail must be >= 0, got -1")):
        ctx = fake_ctx(tmp_path, [override])
        with pytest.raises(PipelineError, match=needle):
            export.run(OmegaConf.to_object(ctx.cfg.export), ctx)
    assert not list(tmp_path.glob("export-*"))
    import shutil

    pkg = tmp_path / "broken"
    shutil.copytree(root / "export-ort_cpu", pkg)
    (pkg / "drafter.json").write_text("{}")
    with pytest.raises(PipelineError, match=r"drafter .*drafter\.json: not a 'formula-compress drafter v1' file"):
        OnnxPackage(pkg, threads=1)
