"""Stage distill on the tiny model (issue 14): a resumed training run equals an uninterrupted one, the
stage writes a BPE student that loads, exports and decodes, and the package round-trips BPE ids."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from pipeline.tokenization.atoms import normalize_formula
from pipeline.adapters.latex_ocr_junia import char_vocabulary as model_char_vocabulary
from pipeline.tokenization.train import SPECIALS, train_formula_bpe
from tiny_model import FORMULAS, build_tiny, fake_ctx


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory):
    char = model_char_vocabulary()
    extra = [t for t in char.token_to_id if t not in SPECIALS]
    tok = train_formula_bpe([normalize_formula(f) for f in FORMULAS * 3], 400, extra_atoms=extra).tokenizer
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return path


def _student(bpe_file):
    student = build_tiny().with_bpe(bpe_file)
    for m in student.model.modules():  # the tiny model has no dropout: give it some, so the RNG matters
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.2
    return student


def test_batch_order_and_learning_rate_depend_on_the_step_only():
    from pipeline.distillation.train import Schedule, batch_indices, learning_rate

    first_epoch = [i for s in range(5) for i in batch_indices(10, 2, s, seed=3)]
    assert sorted(first_epoch) == list(range(10))  # one epoch sees every image once
    assert batch_indices(10, 2, 7, seed=3) == batch_indices(10, 2, 7, seed=3) != batch_indices(10, 2, 7, seed=4)
    s = Schedule(steps=100, minutes=1, batch=2, lr=1e-3, warmup=10)
    assert learning_rate(s, 0) == pytest.approx(1e-4) and learning_rate(s, 9) == pytest.approx(1e-3)
    assert learning_rate(s, 99) == pytest.approx(1e-4, rel=0.01)
    assert 1e-4 < learning_rate(s, 50) < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("ema", [0.0, 0.9])
def test_a_killed_run_resumes_to_the_weights_of_an_uninterrupted_one(bpe_file, tmp_path, ema):
    from pipeline.distillation.train import Schedule, train_decoder

    torch.manual_seed(0)
    memory = torch.randn(6, 32, 32).half()
    ref = _student(bpe_file)
    targets = [ref.tokenizer.encode(normalize_formula(f), max_length=24) for f in FORMULAS[:6]]
    s = Schedule(steps=8, minutes=10, batch=3, lr=1e-3, warmup=2, seed=1, checkpoint_every=2, eval_every=3, ema=ema)
    calls = []

    def evaluate():
        calls.append(1)
        return {"exact_match": 0.0, "cer": 1.0, "steps_per_formula": 1.0}

    torch.manual_seed(5)
    whole = train_decoder(ref, memory, targets, s, evaluate, tmp_path / "a" / "state.pt")
    assert whole["steps"] == 8 and whole["stopped_by"] == "steps"
    assert [p["step"] for p in whole["curve"]] == [0, 3, 6, 8]

    def killed():  # the run dies at its second curve point (step 3; the last checkpoint is step 2)
        if len(calls) == 1:  # step 0 was read
            raise KeyboardInterrupt
        return evaluate()

    calls.clear()
    student = _student(bpe_file)
    torch.manual_seed(5)
    with pytest.raises(KeyboardInterrupt):
        train_decoder(student, memory, targets, s, killed, tmp_path / "b" / "state.pt")
    assert torch.load(tmp_path / "b" / "state.pt", weights_only=True)["step"] == 2
    fresh = _student(bpe_file)  # a new process: fresh weights, then the checkpoint
    torch.manual_seed(123)  # whatever the RNG holds now, the checkpoint's state is restored
    resumed = train_decoder(fresh, memory, targets, s, evaluate, tmp_path / "b" / "state.pt")
    assert resumed["resumed_at"] == 2 and resumed["steps"] == 8
    assert [p["step"] for p in resumed["curve"]] == [0, 3, 6, 8]
    for k, v in ref.model.state_dict().items():
        assert torch.equal(v, fresh.model.state_dict()[k]), k
    assert resumed["losses"] == whole["losses"]


@pytest.mark.slow
def test_the_moving_average_is_what_the_run_returns_and_what_its_curve_reads(bpe_file):
    from pipeline.distillation.train import Schedule, train_decoder

    torch.manual_seed(0)
    memory = torch.randn(6, 32, 32).half()
    runs = {}
    for ema in (0.0, 0.5):
        student = _student(bpe_file)
        start = {k: v.clone() for k, v in student.model.state_dict().items()}
        targets = [student.tokenizer.encode(normalize_formula(f), max_length=24) for f in FORMULAS[:6]]
        seen = []  # the decoder's output layer as each curve point saw it
        torch.manual_seed(5)
        out = train_decoder(student, memory, targets, Schedule(steps=6, minutes=10, batch=3, lr=1e-2, warmup=1,
                                                               eval_every=3, ema=ema),
                            lambda: seen.append(student.model.lm_head.weight.detach().clone()) or {"cer": 0.0})
        runs[ema] = (out, student.model.state_dict(), start, seen)
    (plain, w0, start, seen0), (avg, w1, _, seen1) = runs[0.0], runs[0.5]
    assert plain["losses"] == avg["losses"]  # the average does not change the training itself
    assert torch.equal(seen1[-1], w1["lm_head.weight"]) and torch.equal(seen0[-1], w0["lm_head.weight"])
    moved = [k for k in w0 if not torch.equal(w0[k], start[k])]
    assert moved and all(not torch.equal(w0[k], w1[k]) for k in moved)  # averaged weights, not the last step's
    assert all(torch.equal(w1[k], start[k]) for k in w0 if k not in moved)
    with pytest.raises(ValueError, match="ema must be in"):
        train_decoder(_student(bpe_file), memory, targets, Schedule(steps=1, minutes=1, batch=3, lr=1e-3, ema=1.0))


SMALL = ["model.max_length=24", "model.batch_size=4", "distill.steps=4", "distill.batch=4", "distill.templated=4",
         "distill.varied=3",
         "distill.eval_images=4", "distill.eval_every=2", "distill.checkpoint_every=2", "distill.warmup=1"]


@pytest.mark.slow
def test_stage_writes_a_student_that_exports_and_decodes_bpe(bpe_file, tmp_path):
    from pipeline.adapters.latex_ocr_junia import LatexOcrJuniaAdapter
    from pipeline.data.render import render_formula
    from pipeline.export.runtime import OnnxPackage
    from pipeline.stages import distill, export
    from pipeline.tokenization.bpe import BpeTokenizer

    build_tiny().save(tmp_path / "tiny")
    ctx = fake_ctx(tmp_path, [f"distill.model={tmp_path / 'tiny'}", f"distill.tokenizer={bpe_file}", *SMALL])
    manifest = distill.run(OmegaConf.to_object(ctx.cfg.distill), ctx)
    folder = tmp_path / "distill"
    m = manifest["metrics"]
    assert m["steps"] == 4 and m["stopped_by"] == "steps" and [p["step"] for p in m["curve"]] == [0, 2, 4]
    assert m["train_images"] == 16 + 4 + 3 and m["train_from_split"] == 16  # tiny train split + templated + varied
    assert m["train_varied"] == 3 and list((tmp_path / "cache").glob("distill-memory-varied-*"))
    assert (folder / "learning_curve.png").stat().st_size > 0 and "Learning curve" in (folder / "report.md").read_text()
    assert not list((tmp_path / ".resume").glob("distill-*"))  # checkpoints go once the artifact is complete
    assert (folder / "model" / "tokenizer.json").read_bytes() == bpe_file.read_bytes()

    student = LatexOcrJuniaAdapter.load(str(folder / "model"))
    assert isinstance(student.tokenizer, BpeTokenizer) and student.vocab_size == m["vocab_size"] != 166
    assert student.model.lm_head.out_features == student.vocab_size

    import shutil

    from pipeline.errors import PipelineError

    wrong = tmp_path / "wrong-vocabulary"  # a BPE of another size beside the weights: one clear error
    shutil.copytree(folder / "model", wrong)
    char = model_char_vocabulary()
    extra = [t for t in char.token_to_id if t not in SPECIALS]
    train_formula_bpe([normalize_formula(f) for f in FORMULAS], 300, extra_atoms=extra).tokenizer.save(
        str(wrong / "tokenizer.json"))
    with pytest.raises(PipelineError, match="entries; the model's output layer has"):
        LatexOcrJuniaAdapter.load(str(wrong))

    again = distill.run(OmegaConf.to_object(ctx.cfg.distill), ctx)  # unchanged: reused
    assert again["key"] == manifest["key"]

    (tmp_path / "formulas.txt").write_text("\n".join(FORMULAS[:3]) + "\n")
    ctx = fake_ctx(tmp_path, [f"export.model={folder / 'model'}", "export.quantized=none", "export.targets=[ort_cpu]",
                              f"export.formulas={tmp_path / 'formulas.txt'}", "export.parity_limit=3",
                              "export.parity_images=1", "model.max_length=24"])
    export.run(OmegaConf.to_object(ctx.cfg.export), ctx)
    pkg = OnnxPackage(tmp_path / "export-ort_cpu", threads=1)
    assert isinstance(pkg.tokenizer, BpeTokenizer) and pkg.meta["tokenizer"]["kind"] == "bpe"
    # the package round-trips BPE ids to LaTeX: what the tokenizer writes, the package reads back
    for f in FORMULAS:
        ids = student.tokenizer.encode(normalize_formula(f))
        assert ids[0] == pkg.bos and ids[-1] == pkg.eos
        assert pkg.tokenizer.decode(ids[1:]) == normalize_formula(f)
    images = np.stack([student.preprocess(render_formula(f)).numpy() for f in FORMULAS[:3]])
    got = pkg.generate(images, 24, batch_size=3)
    want = student.generate(torch.from_numpy(images), 24, batch_size=3, use_cache=True)
    assert got.token_ids == want.token_ids and got.texts == want.texts
    assert max(max(ids, default=0) for ids in got.token_ids) < student.vocab_size

    # stage infer reads with the package alone, stage evaluate with the student model: both decode BPE
    from pipeline.stages import evaluate, infer

    render_formula(FORMULAS[0]).save(tmp_path / "one.png")
    ctx = fake_ctx(tmp_path, ["infer.package=export-ort_cpu", f"infer.image={tmp_path / 'one.png'}",
                              "infer.threads=1"])
    read = infer.run(OmegaConf.to_object(ctx.cfg.infer), ctx)
    assert read["predictions"] == {"one.png": got.texts[0]}
    ctx = fake_ctx(tmp_path, [f"eval.model={folder / 'model'}", f"eval.formulas={tmp_path / 'formulas.txt'}",
                              "model.max_length=24", "eval.latency_samples=0", "eval.image_match=false"])
    evaluated = evaluate.run(OmegaConf.to_object(ctx.cfg.eval), ctx)
    rows = [json.loads(line) for line in (tmp_path / "evaluate-model" / "predictions.jsonl").read_text().splitlines()]
    assert [r["pred"] for r in rows] == want.texts and evaluated["metrics"]["n"] == 3


@pytest.mark.slow
def test_a_student_drafter_reads_the_image_first_and_the_package_still_writes_greedy(bpe_file, tmp_path):
    """export.drafter=student: the student's two decoder graphs go into the char model's package; its
    reading of the package's encoder output, spelled in characters, is the guide; the speculative
    readings are greedy's on the verify graph."""
    from pipeline.errors import PipelineError
    from pipeline.export.runtime import OnnxPackage
    from pipeline.stages import export

    build_tiny().save(tmp_path / "tiny")
    student = build_tiny().with_bpe(bpe_file)  # the same encoder: it reads the same memory
    student.save(tmp_path / "student")
    (tmp_path / "formulas.txt").write_text("\n".join(FORMULAS[:3]) + "\n")
    common = [f"export.model={tmp_path / 'tiny'}", "export.quantized=none", f"export.formulas={tmp_path / 'formulas.txt'}",
              "export.parity_limit=3", "export.parity_images=1", "model.max_length=24", "export.drafter=student"]
    with pytest.raises(PipelineError, match="no model"):  # no student: one line, before the work
        export.run(OmegaConf.to_object(fake_ctx(tmp_path, [*common, f"export.draft_model={tmp_path / 'none'}"]).cfg.export),
                   fake_ctx(tmp_path, common))
    ctx = fake_ctx(tmp_path, [*common, f"export.draft_model={tmp_path / 'tiny'}"])
    with pytest.raises(PipelineError, match="not a formula BPE student"):  # a char model is no student
        export.run(OmegaConf.to_object(ctx.cfg.export), ctx)
    assert not (tmp_path / "export-ort_cpu").exists()
    ctx = fake_ctx(tmp_path, [*common, f"export.draft_model={tmp_path / 'student'}", "export.targets=[ort_cpu,metax]"])
    export.run(OmegaConf.to_object(ctx.cfg.export), ctx)
    folder = tmp_path / "export-ort_cpu"
    drafter = json.loads((folder / "drafter.json").read_text())
    assert drafter["kind"] == "student" and drafter["source"]["student"] == str(tmp_path / "student")
    assert (folder / drafter["student"]["first"]).is_file() and (folder / drafter["student"]["step"]).is_file()
    assert drafter["student"]["precision"] == "int8 dynamic"  # a CPU target: export.draft_int8
    assert json.loads((tmp_path / "export-metax" / "drafter.json").read_text())["student"]["precision"] == "fp16"
    parity = json.loads((folder / "parity.json").read_text())["speculative"]
    assert parity["identical_verify_greedy"] == 1.0 and parity["drafter_calls_per_reading"] >= 1

    from pipeline.data.render import render_formula

    images = np.stack([student.preprocess(render_formula(f)).numpy() for f in FORMULAS[:4]])
    pkg = OnnxPackage(folder, threads=1)
    got = pkg.generate(images, 24, batch_size=1)
    assert got.token_ids == pkg.verify_greedy(images, 24).token_ids
    assert pkg.spec_stats.drafter_calls >= 4
    # the guide is the student's own greedy reading of the image, in the package's characters (its float
    # graphs: export.draft_int8=false)
    ctx = fake_ctx(tmp_path, [*common, f"export.draft_model={tmp_path / 'student'}", "export.draft_int8=false",
                              "export.name=float-student"])
    export.run(OmegaConf.to_object(ctx.cfg.export), ctx)
    pkg = OnnxPackage(tmp_path / "float-student", threads=1)
    assert json.loads((tmp_path / "float-student" / "drafter.json").read_text())["student"]["precision"] == "fp32"
    texts = [pkg.tokenizer.decode([i]) for i in range(pkg._vocab())]
    want = student.generate(torch.from_numpy(images), 24, batch_size=1, use_cache=True).texts
    for image, text in zip(images, want):
        guide, calls = pkg.drafter.reader(pkg.encode(image[None]))
        assert "".join(texts[i] for i in guide) == text[:23] and calls >= 1

    # the Metax package (FP16, opset <= 17) with its student graphs decodes on ONNX Runtime 1.12.1 (MacaRT's
    # base) speculatively, token for token as plain greedy there
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import macart_env

    metax = tmp_path / "export-metax"
    assert json.loads((metax / "drafter.json").read_text())["kind"] == "student"
    np.save(tmp_path / "images.npy", images)
    plain = macart_env.decode(metax, tmp_path / "images.npy", tmp_path / "plain.json")
    fast = macart_env.decode(metax, tmp_path / "images.npy", tmp_path / "fast.json", speculative=True)
    assert fast["sequences"] == plain["sequences"] and fast["onnxruntime"].startswith("1.12")
    assert fast["speculative"]["drafter_calls"] >= len(images)  # the student read every image


def test_stage_all_skips_distill_unless_it_is_in_the_chain_and_a_missing_tokenizer_is_named(tmp_path):
    from pipeline.errors import PipelineError
    from pipeline.stages import distill

    ctx = fake_ctx(tmp_path, [*SMALL])
    assert ctx.chain_upstream() == ("prune",)
    assert fake_ctx(tmp_path, ["distill.in_chain=true"]).chain_upstream() == ("prune", "distill")
    with pytest.raises(PipelineError, match="distill.tokenizer=tokenizer: no tokenizer.json"):
        distill.run(OmegaConf.to_object(ctx.cfg.distill), ctx)
    assert not (tmp_path / "distill").exists()
    with pytest.raises(PipelineError, match="distill.steps must be >= 1"):
        distill.run(OmegaConf.to_object(fake_ctx(tmp_path, ["distill.steps=0"]).cfg.distill), ctx)
    with pytest.raises(PipelineError, match=r"distill.ema must be in \[0, 1\), got 1.0"):
        distill.run(OmegaConf.to_object(fake_ctx(tmp_path, ["distill.ema=1.0"]).cfg.distill), ctx)


def _train_three_steps(bpe_file, **schedule):
    """A tiny student trained 3 steps with ``schedule``'s options -> (student, names of the weights that changed)."""
    from pipeline.distillation.train import Schedule, train_decoder

    torch.manual_seed(0)
    student = _student(bpe_file)
    before = {k: v.clone() for k, v in student.model.state_dict().items()}
    targets = [student.tokenizer.encode(normalize_formula(f), max_length=24) for f in FORMULAS[:4]]
    s = Schedule(steps=3, minutes=10, batch=2, lr=1e-2, warmup=1, weight_decay=0.0, eval_every=0, **schedule)
    train_decoder(student, torch.randn(4, 32, 32), targets, s)
    return student, {k for k, v in student.model.state_dict().items() if not torch.equal(v, before[k])}


def test_block_lr_scale_zero_trains_only_the_new_vocabulary_rows(bpe_file):
    _, changed = _train_three_steps(bpe_file, block_lr_scale=0.0)
    assert changed == {"decoder_embed.token_emb.weight", "lm_head.weight", "lm_head.bias"}


def test_frozen_cross_attention_keeps_the_char_models_reading_of_the_image(bpe_file):
    student, changed = _train_three_steps(bpe_file, freeze_cross_attention=True)
    state = student.model.state_dict()
    cross = {k for k in state if ".cross_attn." in k or ".cross_norm." in k}
    assert cross and not changed & cross  # frozen
    assert {k for k in state if k.startswith("decoder_blocks.") and k not in cross} <= changed  # the rest trained
    assert all(p.requires_grad for p in student.model.parameters())  # given back afterwards


def test_teacher_targets_replace_only_readable_misreadings():
    from pipeline.stages.distill import kd_target

    wrapped = r"\begin{equation*}\begin{array}{c}\scriptstyle \frac{a}{c}\end{array}\end{equation*}"
    assert kd_target(r"\frac{a}{b}", wrapped, capped=False) == r"\frac{a}{c}"  # misread: the reading, unwrapped
    assert kd_target(r"\frac{a}{c}", wrapped, capped=False) == r"\frac{a}{c}"  # read right: the formula itself
    assert kd_target("x^{2}", r"\begin{equation*}x^2\end{equation*}", capped=False) == "x^{2}"
    assert kd_target("x_i", "x_i x_i x_i x_i", capped=True) == "x_i"  # ran to the cap: the formula
    assert kd_target("x_i", r"\begin{equation*}\end{equation*}", capped=False) == "x_i"  # empty reading


@pytest.mark.slow
def test_more_varied_formulas_reuse_the_encoder_outputs_already_cached(bpe_file, tmp_path, monkeypatch):
    from pipeline.distillation import memory
    from pipeline.stages import distill

    monkeypatch.setattr(memory, "VARIED_CHUNK", 2)
    build_tiny().save(tmp_path / "tiny")
    base = [f"distill.model={tmp_path / 'tiny'}", f"distill.tokenizer={bpe_file}", *SMALL, "distill.steps=1"]
    ctx = fake_ctx(tmp_path, base)
    m = distill.run(OmegaConf.to_object(ctx.cfg.distill), ctx)["metrics"]
    first = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").glob("distill-memory-varied-*")}
    assert m["train_varied"] == 3 and len(first) == 2  # formulas 0-1, then 2
    more = [*base, "distill.varied=5", "distill.name=distill-more"]
    ctx = fake_ctx(tmp_path, more)
    m = distill.run(OmegaConf.to_object(ctx.cfg.distill), ctx)["metrics"]
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").glob("distill-memory-varied-*")}
    assert m["train_varied"] == 5 and len(after) == 4  # 0-1 reused; 2-3 and 4 are new
    assert all(after[name] == first[name] for name in first)  # nothing computed again
    kept = [f for p in sorted((tmp_path / "cache").glob("distill-memory-varied-*")) if p.name not in first
            for f in json.loads((p / "formulas.json").read_text())]
    assert sorted(i for i, _ in kept) == ["varied-2", "varied-3", "varied-4"]


@pytest.mark.slow
def test_stage_with_teacher_targets_reads_the_training_images_once(bpe_file, tmp_path, monkeypatch):
    from pipeline.distillation import targets
    from pipeline.stages import distill
    from pipeline.stages.distill import kd_target

    build_tiny().save(tmp_path / "tiny")
    ctx = fake_ctx(tmp_path, [f"distill.model={tmp_path / 'tiny'}", f"distill.tokenizer={bpe_file}",
                              "distill.targets=teacher", *SMALL])
    m = distill.run(OmegaConf.to_object(ctx.cfg.distill), ctx)["metrics"]
    [cache] = list((tmp_path / "cache").glob("distill-teacher-*"))
    readings = json.loads((cache / "readings.json").read_text())
    assert len(readings["texts"]) == len(readings["capped"]) == m["train_images"] == 16 + 4 + 3
    formulas = [f for name in ("train", "varied") for f in json.loads(
        next((tmp_path / "cache").glob(f"distill-memory-{name}-*")).joinpath("formulas.json").read_text())]
    want = sum(kd_target(f, r, c) != f for (_, f), r, c in zip(formulas, readings["texts"], readings["capped"]))
    assert m["targets"] == "teacher" and m["targets_from_teacher"] == want
    assert "Targets: the char model's readings" in (tmp_path / "distill" / "report.md").read_text()
    # the tiny model runs every reading to the cap (so every target is the formula): readings that
    # stopped and misread become targets
    crafted = ([r"\begin{equation*}x_{9}\end{equation*}"] * 3 + readings["texts"][3:], [False] * 3 + readings["capped"][3:])
    monkeypatch.setattr(targets, "teacher_readings", lambda *a, **k: crafted)
    ctx = fake_ctx(tmp_path, [f"distill.model={tmp_path / 'tiny'}", f"distill.tokenizer={bpe_file}",
                              "distill.targets=teacher", "distill.name=distill-kd", *SMALL])
    assert distill.run(OmegaConf.to_object(ctx.cfg.distill), ctx)["metrics"]["targets_from_teacher"] == 3
    with pytest.raises(Exception, match="distill.targets=kd") as refused:  # when Hydra composes
        distill.run(OmegaConf.to_object(fake_ctx(tmp_path, ["distill.targets=kd"]).cfg.distill), ctx)
    assert "Invalid value 'kd', expected one of [truth, teacher]" in str(refused.value.__cause__)
