"""A package's drafter for speculative decoding (``pipeline/drafting.py``): built from the package's
own greedy readings of train formulas (or the formula BPE of stage tokenizer; the BPE student of
stage distill adds its two decoder graphs), written into the package, and checked: the package's
speculative readings must be its plain greedy readings."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import onnx

from pipeline import drafting
from pipeline.context import file_hash
from pipeline.decoding import StudentReader
from pipeline.data.render import render_inputs
from pipeline.errors import PipelineError
from pipeline.export.runtime import PACKAGE_META, OnnxPackage
from pipeline.names import DECODER_FIRST, DECODER_STEP, TOKENIZER

log = logging.getLogger(__name__)

DRAFTER_FILE = "drafter.json"
KINDS = ("none", *drafting.DRAFTERS)
# the student's graphs in the package (export.drafter=student)
STUDENT_GRAPHS = {"first": "drafter_first.onnx", "step": "drafter_step.onnx"}


def bpe_pieces(tokenizer_json: Path) -> list[str]:
    """The pieces of a formula BPE (HF ``tokenizers`` JSON), most frequent first: each merge's result
    in merge order (the trainer merges the most frequent pair first)."""
    try:
        model = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))["model"]
        merges = model["merges"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise PipelineError(f"export.drafter=bpe: {tokenizer_json} is not a BPE tokenizer file ({exc})") from None
    return ["".join(m.split(" ", 1) if isinstance(m, str) else m) for m in merges]


def token_texts(package: OnnxPackage) -> list[str]:
    return [package.tokenizer.decode([i]) for i in range(package._vocab())]


def build(kind: str, package: OnnxPackage, readings: Sequence[Sequence[int]] | None, order: int, min_count: int,
          pieces: Sequence[str] | None, self_lookup: int = 0, min_confidence: float = 0.0, tail: int = 0):
    if kind == "ngram":
        return drafting.NgramDrafter.build(readings or [], package.bos, order=order, min_count=min_count,
                                           self_lookup=self_lookup, min_confidence=min_confidence, tail=tail)
    if kind == "bpe":
        return drafting.BpeDrafter.build(pieces or [], token_texts(package))
    raise PipelineError(f"export.drafter: unknown {kind!r}; known: {', '.join(KINDS)}")


def spell(texts: Sequence[str], into: Sequence[str]) -> list[list[int]]:
    """Each of ``texts`` (what a student's BPE id writes) as token ids of the vocabulary ``into`` (what
    each package token writes: single characters); a character the package cannot write is left out
    (the guide only proposes: the verify call decides)."""
    ids = {t: i for i, t in enumerate(into) if t}
    return [[ids[ch] for ch in text if ch in ids] for text in texts]


def check_student(folder: Path | None, ref: str) -> None:
    """A student drafter's model: a saved model folder whose tokenizer is a formula BPE (stage distill's)."""
    from pipeline.tokenization.bpe import is_bpe_file

    if folder is None or not is_bpe_file(Path(folder) / TOKENIZER):
        raise PipelineError(f"export.drafter=student: export.draft_model={ref} is not a formula BPE student "
                            f"(run stage=distill, or name its model folder)")


def student_graphs(student, target, simplify: bool, model_key: str, package: OnnxPackage, folder: Path,
                   probe: np.ndarray, int8: bool = False, progress=lambda _: None) -> dict:
    """The student's ``decoder_first`` and ``decoder_step`` for ``target``, written into the package
    ``folder`` (:data:`STUDENT_GRAPHS`), and the ``student`` entry of its ``drafter.json``. ``int8``: every
    weighted MatMul of both in ONNX Runtime's dynamic INT8 (per-channel symmetric weights, activations
    per tensor at run time; a drafter proposes, it need not read as the float student). ``probe`` (one
    preprocessed image) checks that the student's decoder reads the package's encoder output."""
    from pipeline.export.build import build_graphs

    if student.tokenizer_kind() != "bpe":
        raise PipelineError(f"export.drafter=student: the student model reads with a {student.tokenizer_kind()!r} "
                            f"vocabulary, not a formula BPE (run stage=distill, or name its model folder)")
    built = build_graphs(student, target, simplify, None, progress, model_key, only=(DECODER_FIRST, DECODER_STEP))
    if built.violations:
        shown = "; ".join(str(v) for v in built.violations[:3])
        raise PipelineError(f"export.drafter=student: the student's graphs break the {target.name} rules: {shown}")
    for key, graph in (("first", DECODER_FIRST), ("step", DECODER_STEP)):
        if int8:
            _dynamic_int8(built.models[graph], folder / STUDENT_GRAPHS[key])
        else:
            onnx.save(built.models[graph], str(folder / STUDENT_GRAPHS[key]))
    num_layers = sum(1 for i in built.models[DECODER_STEP].graph.input if i.name.startswith("past_key_"))
    bpe_texts = [student.tokenizer.decode([i]) for i in range(student.vocab_size)]
    entry = {**STUDENT_GRAPHS, "precision": "int8 dynamic" if int8 else built.precision[DECODER_STEP],
             "step_inputs": [i.name for i in built.models[DECODER_STEP].graph.input],
             "num_layers": num_layers, "bos": student.bos_id, "eos": student.eos_id,
             "banned": list(student.banned_token_ids()), "max_tokens": package.max_length - 1,
             "pieces": spell(bpe_texts, token_texts(package))}
    reader = StudentReader.from_entry(entry, package.drafter_graph)  # a graph it cannot load: its own line
    try:
        reader(package.encode(probe[None]))
    except Exception as exc:  # onnxruntime's own exception types: a memory of another shape
        raise PipelineError(f"export.drafter=student: the student's decoder does not read this package's encoder "
                            f"output ({str(exc).splitlines()[0]})") from None
    return entry


def _dynamic_int8(model: onnx.ModelProto, out: Path) -> None:
    import tempfile

    from pipeline.quantization.decoder import quantize_cross_kv, to_matmul, weight_nodes

    model = to_matmul(model)
    with tempfile.TemporaryDirectory(prefix="student-") as tmp:
        src = Path(tmp) / out.name
        onnx.save(model, str(src))
        quantize_cross_kv(src, out, list(weight_nodes(model)))


def guided(ngram: drafting.NgramDrafter, student: dict, min_match: int) -> drafting.StudentDrafter:
    """The student drafter: ``ngram``'s table where the guide does not match; ``student``: its
    :func:`student_graphs` entry."""
    return drafting.StudentDrafter.from_ngram(ngram, student, min_match)


def make(cfg, ctx, adapter, package: OnnxPackage, folder: Path, name: str, model_key: str, drafts: dict, target,
         probe: np.ndarray, student_key: str | None = None) -> dict:
    """Build the drafter ``cfg.drafter`` (stage export's settings) for ``package``, write it into ``folder``
    (package ``name`` once published); returns where it came from. ``drafts``: the package readings of
    train formulas per (model, formulas, cap), kept for the next target of the same model;
    ``student_key``: the student model's hash when the caller has it."""
    max_length = ctx.limits.max_length
    if cfg.drafter == "bpe":
        tok = ctx.stage_folder("tokenizer") / TOKENIZER
        if not tok.is_file():
            raise PipelineError(f"export.drafter=bpe needs stage tokenizer's formula BPE ({tok}): run stage=tokenizer")
        drafter = build("bpe", package, None, cfg.ngram_order, cfg.ngram_min_count, bpe_pieces(tok))
        source = {"pieces": str(tok), "sha256": file_hash(tok), "completions": len(drafter.completions)}
    else:
        train = [(f.id, f.latex) for f in ctx.split("train")]
        key = (model_key, tuple(i for i, _ in train[:cfg.draft_images]), max_length)
        if key not in drafts:  # the package's own plain greedy readings; the next target of the model reuses them
            items = render_inputs(train, adapter.preprocess, cfg.draft_images, ctx.progress, "export drafter")
            if not items:
                raise PipelineError("export.drafter=ngram: no train formula could be rendered")
            images = np.stack([np.asarray(x[2]) for x in items])
            workers = ctx.limits.threads or os.cpu_count() or 1
            log.info(f"[export] the drafter: {len(images)} train formulas read by the package, {workers} "
                     f"single-thread sessions side by side")
            # image by image: greedy's readings as the speculative loop meets them (batch 1), and on a CPU
            # sooner than in batches (2 sessions, 160 train formulas: 63 against 74 ms a formula at batch 16)
            drafts[key] = (read(folder, images, max_length, 1, workers), name)
        readings, read_by = drafts[key]
        confidence = target.draft_min_confidence if cfg.ngram_min_confidence is None else cfg.ngram_min_confidence
        tail = target.draft_tail if cfg.ngram_tail is None else cfg.ngram_tail
        drafter = build("ngram", package, readings, cfg.ngram_order, cfg.ngram_min_count, None,
                        cfg.ngram_self_lookup, confidence, tail)
        source = {"readings": f"greedy readings of {len(readings)} train formulas by package {read_by}",
                  "order": cfg.ngram_order, "min_count": cfg.ngram_min_count, "self_lookup": cfg.ngram_self_lookup,
                  "min_confidence": confidence, "tail": tail, "contexts": len(drafter.table)}
        if cfg.drafter == "student":
            student = ctx.load_model(cfg.draft_model)
            entry = student_graphs(student, target, cfg.simplify, student_key or ctx.model_hash(cfg.draft_model),
                                   package, folder, probe,
                                   int8=cfg.draft_int8 and target.provider == "CPUExecutionProvider")
            drafter = guided(drafter, entry, cfg.student_min_match)
            source.update({"student": cfg.draft_model, "min_match": cfg.student_min_match})
    install(folder, drafter, cfg.draft_len, {"kind": cfg.drafter, **source}, target.speculative_batches)
    return source


def read(folder: Path, images: np.ndarray, max_length: int, batch_size: int, workers: int) -> list[list[int]]:
    """The package's plain greedy readings of ``images`` (in order): ``workers`` sessions of one thread,
    each reading a run of whole batches side by side (:func:`pipeline.quantization.measure.read`); at
    these sizes a session's second thread adds little to a decoder step (2 cores: 69 ms a formula
    against 95 for one session of two threads)."""
    from pipeline.quantization.measure import read as read_side_by_side

    packages = [OnnxPackage(folder, threads=1, provider="CPUExecutionProvider", speculative=False)
                for _ in range(max(1, workers))]
    reading = read_side_by_side(packages, None, images, [""] * len(images), max_length, batch_size)
    return [list(map(int, ids)) for ids in reading.token_ids]


def verdict(speculative: dict, min_identical: float, tie_margin: float) -> list[str]:
    """What fails a package in its speculative check (:func:`check`'s result): a reading that is not
    greedy decoding's on the verify graph (the loop must write those token for token), fewer than
    ``min_identical`` readings identical to the step graph's greedy ones, or one that leaves them where
    the two tokens are more than ``tie_margin`` logits apart (not a near-tie)."""
    failures = []
    if speculative["verify_greedy_differing"]:
        failures.append(f"speculative decoding: {len(speculative['verify_greedy_differing'])} of "
                        f"{speculative['n']} readings differ from greedy decoding on the verify graph, "
                        f"which the loop must write token for token (formulas "
                        f"{speculative['verify_greedy_differing'][:5]}): a broken drafter loop or cache")
    if speculative["identical"] < min_identical:
        failures.append(f"speculative decoding: identical to the package's greedy readings on "
                        f"{speculative['identical']:.3f} of {speculative['n']} formulas < "
                        f"export.min_speculative_identical={min_identical} (export.drafter=none ships plain greedy)")
    if speculative["max_tie_margin"] > tie_margin:
        failures.append(f"speculative decoding: a reading leaves the package's greedy one where the step "
                        f"logits put the two tokens {speculative['max_tie_margin']:.3f} apart > "
                        f"export.speculative_tie_margin={tie_margin} (not a near-tie; export.drafter=none ships "
                        f"plain greedy)")
    return failures


def install(folder: Path, drafter, draft_len: int, source: dict, batches: bool = False) -> None:
    """Write ``drafter.json`` into the package and name it in ``package.json``; ``batches``: a batch of
    several images decodes speculatively too, each image on its own (the target's ``speculative_batches``)."""
    drafting.save(drafter, folder / DRAFTER_FILE, draft_len, source)
    meta_path = folder / PACKAGE_META
    meta = json.loads(meta_path.read_text())
    meta["drafter"] = DRAFTER_FILE
    meta["decoding_speculative"] = (
        "batch 1 with a drafter: decoder_verify checks the last written token and up to draft_len drafted "
        "tokens in one call (logits after each); greedy's choice (bans, layout cap) is taken at every "
        "position, drafts are accepted while they equal it, the first that differs is written too, and the "
        "present K/V is cut to the tokens written: greedy's reading token for token, up to near-ties the verify "
        "graph rounds unlike the step")
    meta["speculative_batches"] = bool(batches)
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")


def tie_margin(package: OnnxPackage, image: np.ndarray, greedy_ids: Sequence[int], other_ids: Sequence[int]) -> float:
    """Where ``other_ids`` first leaves the package's greedy reading ``greedy_ids`` of ``image``: how far
    apart the package's own step logits there put greedy's token and the other one (0: a tie). A
    speculative reading may leave greedy's only at a near-tie (the verify graph rounds unlike the step,
    docs/export.md); a wide margin there is a broken verify graph, cache or drafter loop."""
    at = next((i for i, (a, b) in enumerate(zip(greedy_ids, other_ids)) if a != b), None)
    if at is None:  # one is a prefix of the other: the shorter one stopped where the longer went on
        at = min(len(greedy_ids), len(other_ids))
        if at >= max(len(greedy_ids), len(other_ids)):
            return 0.0
    mine = [*greedy_ids, package.eos][at]
    theirs = [*other_ids, package.eos][at]
    logits, past, cross = package.first(np.full((1, 1), package.bos, dtype=np.int64), package.encode(image[None]))
    for tok in greedy_ids[:at]:
        logits, past = package.step(np.full((1, 1), tok, dtype=np.int64), past, cross)
    row = logits[0]
    return float(abs(row[mine] - row[theirs]))


def check(folder: Path, images: np.ndarray, plain_ids: Sequence[Sequence[int]], max_length: int, threads: int
          ) -> dict:
    """The package's speculative readings of ``images`` (batch 1) against its plain greedy ones: the
    share identical, and for each reading that differs the step logits' margin where it first leaves
    greedy's (:func:`tie_margin`); against greedy decoding on the verify graph
    (:meth:`OnnxPackage.verify_greedy`, the same arithmetic: they must all be identical,
    ``verify_greedy_differing`` names any that is not); decoder calls and tokens per reading, accepted
    drafts per call."""
    package = OnnxPackage(folder, threads=threads, provider="CPUExecutionProvider")
    if not package.speculative:
        raise PipelineError(f"package {folder}: no drafter to check")
    started = time.perf_counter()
    got = package.generate(images, max_length=max_length, batch_size=1)
    same = [list(a) == list(b) for a, b in zip(got.token_ids, plain_ids)]
    stats = package.spec_stats.as_dict()
    differing = [i for i, s in enumerate(same) if not s]
    margins = [round(tie_margin(package, images[i], plain_ids[i], got.token_ids[i]), 4) for i in differing]
    exact = package.verify_greedy(images, max_length).token_ids
    apart = [i for i, (a, b) in enumerate(zip(got.token_ids, exact)) if list(a) != list(b)]
    return {"n": len(same), "identical": float(np.mean(same)) if same else 1.0,
            "identical_verify_greedy": 1.0 - len(apart) / max(1, len(same)), "verify_greedy_differing": apart,
            "differing": differing, "tie_margins": margins, "max_tie_margin": max(margins, default=0.0),
            "seconds": round(time.perf_counter() - started, 1),
            **{k: stats[k] for k in ("calls_per_reading", "tokens_per_reading", "tokens_per_call",
                                     "accepted_per_verify", "acceptance", "drafter_calls_per_reading")}}
