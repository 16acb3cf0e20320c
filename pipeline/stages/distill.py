"""Stage distill: a decoder that speaks the formula BPE, so a formula costs fewer decode steps.

``python -m pipeline stage=distill`` takes the char model the chain hands over (prune's when its
artifact exists, else the original; ``distill.model`` overrides) and the tokenizer stage's BPE, and
builds a student with the BPE vocabulary: every block copied, each BPE token's embedding and output
row made from the char pieces it is spelled with (``pipeline/adapters/junia_student.py``). The
encoder is frozen: its outputs for the rendered train-split formulas plus the templated generator
and the varied grammar (``pipeline/data/templates.py``) are computed once and cached (fp16 on disk, ``<artifacts>/cache/``), and the decoder learns the
plain formula (normalized, no display wrapper) in BPE ids from them. Training is bounded
(``distill.steps``, and ``distill.minutes`` of wall time) and resumable (atomic checkpoints every
``distill.checkpoint_every`` steps under ``<artifacts>/.resume/``). Writes ``<artifacts>/distill/``:
the student model (``model/``, carrying the BPE ``tokenizer.json``, which export puts in the
package), the learning curve (PNG + table: exact match and CER of the first ``distill.eval_images``
eval formulas against training minutes, beside the char model on the same formulas) and the report.
The whole-split comparison in the ORT package is ``stage=export export.model=distill`` then the
benchmark (docs/distill.md).
"""
from __future__ import annotations

import logging
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from pipeline.artifacts import sha256_json
from pipeline.choices import choices
from pipeline.context import StageContext, file_hash
from pipeline.data.templates import templated_formulas, varied_formulas
from pipeline.device import placed
from pipeline.distillation import memory, report, targets
from pipeline.distillation.targets import TARGETS, kd_target  # noqa: F401 (kd_target: tests import the rule from here)
from pipeline.distillation.train import Schedule, train_decoder
from pipeline.errors import PipelineError
from pipeline.names import TOKENIZER
from pipeline.tokenization.atoms import normalize_formula

log = logging.getLogger(__name__)
NAME = "distill"
CONFIG_KEY = "distill"

Targets = choices("Targets", TARGETS, __name__)  # distill.targets: truth | teacher
TOKENIZER_FILE = TOKENIZER  # stage tokenizer's BPE


@dataclass
class DistillConfig:
    model: str = "auto"              # the char model: auto = prune's when its artifact exists, else the original
    tokenizer: str = "tokenizer"     # the BPE: a tokenizer stage's folder name, a folder or a tokenizer.json
    train_images: Optional[int] = None  # train-split formulas rendered (null = all of them) ...
    templated: int = 512             # ... plus this many from the templated generator ...
    # ... plus this many random formulas from the varied grammar (pipeline/data/templates.py: the
    # notation docstring formulas use, in combinations none suggests): with 4000 the student read
    # 0.561 of the eval split and 0.327 of the shift split, without them 0.502 and 0.277
    # (docs/distill.md); 8000 read the calib split the same (0.585 vs 0.583). Their encoder outputs
    # cost ~0.5 GB of cache and ~3 minutes a 1000 formulas, once
    varied: int = 4000
    steps: int = 5000                # optimizer steps: the run is a function of these and the seed ...
    minutes: float = 40.0            # ... unless this wall-clock cap on the training steps comes first
    batch: int = 16
    lr: float = 5e-4                 # AdamW, linear warm-up then cosine decay to a tenth
    warmup: int = 50
    weight_decay: float = 0.01
    # what the student learns to write for each training image: truth = the formula it was rendered
    # from; teacher = the char model's own greedy reading of the image (display wrapper stripped)
    # wherever it differs from the formula and did not run to the cap (sequence-level distillation:
    # the student is not asked for what the frozen encoder's outputs did not let the char model read)
    targets: Targets = Targets.truth
    # the decoder's attention over the encoder output (and its norms) left as the char model learnt
    # it: the student learns which tokens to write, not how to read the image anew
    freeze_cross_attention: bool = False
    # decay of an exponential moving average of the decoder's weights, which the curve reads and the
    # stage saves (0 = the last step's weights); 0.999 read calib 0.585 (off: 0.583), eval and shift
    # lower (docs/distill.md)
    ema: float = 0.0
    block_lr_scale: float = 1.0      # lr factor for the decoder weights copied from the char model (the new
                                     # embedding and output rows always get distill.lr)
    checkpoint_every: int = 100      # steps between resume checkpoints
    eval_every: int = 500            # steps between learning-curve points
    eval_images: int = 32            # first eval-split formulas read at each point (and by the char model)
    # quantize and export take this stage's model in the chain (and stage=all runs it) only when
    # true: off until the BPE decoder meets issue 14's bar on the whole eval split (docs/distill.md)
    in_chain: bool = False
    name: Optional[str] = None       # artifact folder; default "distill" (+ the job's tag in a multirun)


Config = DistillConfig


def validate(cfg: DistillConfig) -> None:
    for key in ("steps", "batch", "eval_images"):
        if getattr(cfg, key) < 1:
            raise PipelineError(f"distill.{key} must be >= 1, got {getattr(cfg, key)}")
    for key in ("templated", "varied", "warmup", "checkpoint_every", "eval_every"):
        if getattr(cfg, key) < 0:
            raise PipelineError(f"distill.{key} must be >= 0, got {getattr(cfg, key)}")
    if cfg.train_images is not None and cfg.train_images < 0:
        raise PipelineError(f"distill.train_images must be >= 0 or null, got {cfg.train_images}")
    if not cfg.minutes > 0:
        raise PipelineError(f"distill.minutes must be > 0, got {cfg.minutes}")
    if not 0 <= cfg.ema < 1:
        raise PipelineError(f"distill.ema must be in [0, 1), got {cfg.ema}")
    if not (cfg.lr > 0 and cfg.weight_decay >= 0 and cfg.block_lr_scale >= 0):
        raise PipelineError("distill.lr must be > 0, distill.weight_decay and distill.block_lr_scale >= 0")
    if cfg.targets not in TARGETS:
        raise PipelineError(f"distill.targets must be one of {', '.join(TARGETS)}, got {cfg.targets!r}")
    if cfg.name is not None and not re.fullmatch(r"[A-Za-z0-9_.,=+-]+", cfg.name):
        raise PipelineError(f"distill.name must be a plain folder name, got {cfg.name!r}")


def _tokenizer_file(ref: str, ctx: StageContext) -> Path:
    for path in (ctx.artifacts_dir / ref / TOKENIZER_FILE, Path(ref) / TOKENIZER_FILE, Path(ref)):
        if path.is_file():
            return path
    raise PipelineError(f"distill.tokenizer={ref}: no {TOKENIZER_FILE} there (run stage=tokenizer, or give "
                        f"a folder or file)")


# ---- the stage ----------------------------------------------------------------------------------
def run(cfg: DistillConfig, ctx: StageContext) -> dict:
    validate(cfg)
    max_length, batch_size = ctx.limits.max_length, ctx.limits.batch_size
    model_ref = ctx.chain_model(cfg.model, upstream=("prune",))
    tok_file = _tokenizer_file(cfg.tokenizer, ctx)
    name = ctx.artifact_name("distill", cfg.name)
    model_hash = ctx.model_hash(model_ref)
    config = _artifact_config(cfg, ctx, model_ref, max_length)
    train, varied, evals = _formulas(cfg, ctx)
    inputs = {"model": model_hash, "tokenizer": file_hash(tok_file), **_formulas_hash(train, varied, evals)}
    with ctx.output(name, config, inputs) as out:
        if out.reused:
            log.info(f"[distill] unchanged, reused {out.path}")
            _print_summary(out.metrics)
            return out.manifest
        t_start, teacher = time.perf_counter(), ctx.load_model(model_ref)
        log.info(f"[distill] student of {model_ref} with the BPE {tok_file}")
        student = teacher.with_bpe(tok_file)
        mem = memory.training_memory(ctx, teacher, model_hash, train, varied, evals, batch_size)
        texts, from_teacher = targets.training_texts(ctx, cfg.targets, teacher, model_hash, mem.train, mem.kept,
                                                     max_length, batch_size)
        bpe_targets = [student.tokenizer.encode(normalize_formula(t), max_length=max_length) for t in texts]
        truths = [latex for _, latex in mem.kept_eval]
        char_row = report.read(teacher, mem.eval, truths, max_length, batch_size)
        del teacher
        torch.manual_seed(ctx.seed)  # dropout
        resume = ctx.artifacts_dir / ".resume" / f"{name}-{sha256_json([config, inputs])[:12]}"
        with placed(ctx.device, student):  # model.device: the decoder trains and reads there
            trained = train_decoder(student, mem.train, bpe_targets, _schedule(cfg, ctx.seed),
                                    lambda: report.read(student, mem.eval, truths, max_length, batch_size, texts=False),
                                    resume / "student.pt", ctx.progress)
            final = report.read(student, mem.eval, truths, max_length, batch_size)
        student.save(out.path / "model")  # with the BPE tokenizer.json, byte for byte
        m = {"model": model_ref, "tokenizer": str(tok_file), "vocab_size": student.vocab_size,
             "targets": cfg.targets, "targets_from_teacher": from_teacher}
        out.metrics.update(report.stage_metrics(m, trained, char_row, final, mem, cfg.steps, t_start))
        report.write_outputs(out.path, out.metrics, config, mem.kept_eval, char_row, final)
    shutil.rmtree(resume, ignore_errors=True)
    _print_summary(out.metrics)
    return out.manifest


def _artifact_config(cfg: DistillConfig, ctx: StageContext, model_ref: str, max_length: int) -> dict:
    config = {**asdict(cfg), "model_ref": model_ref, "max_length": max_length, **ctx.decoding_key(), "seed": ctx.seed}
    config.pop("in_chain")  # where the chain takes the model from, not how it is made
    if not cfg.ema:
        config.pop("ema")  # off: the key of the artifacts made before it existed
    return config


def _formulas(cfg: DistillConfig, ctx: StageContext) -> tuple[list, list, list]:
    """(id, LaTeX) pairs: training (train split + templated), varied grammar, the first eval formulas."""
    train = [(f.id, f.latex) for f in ctx.split("train")][:cfg.train_images]
    train += [(f"templated-{i}", t) for i, t in enumerate(templated_formulas(cfg.templated, seed=ctx.seed))]
    varied = [(f"varied-{i}", t) for i, t in enumerate(varied_formulas(cfg.varied, seed=ctx.seed))]
    if not train and not varied:
        raise PipelineError("distill: no training formulas (distill.train_images=0, distill.templated=0 and "
                            "distill.varied=0)")
    return train, varied, [(f.id, f.latex) for f in ctx.split("eval")][:cfg.eval_images]


def _formulas_hash(train: list, varied: list, evals: list) -> dict:
    return {"train": sha256_json(train + varied), "eval": sha256_json(evals)}


def _schedule(cfg: DistillConfig, seed: int) -> Schedule:
    return Schedule(steps=cfg.steps, minutes=cfg.minutes, batch=cfg.batch, lr=cfg.lr, weight_decay=cfg.weight_decay,
                    warmup=cfg.warmup, seed=seed, checkpoint_every=cfg.checkpoint_every, eval_every=cfg.eval_every,
                    block_lr_scale=cfg.block_lr_scale, freeze_cross_attention=cfg.freeze_cross_attention, ema=cfg.ema)


def _print_summary(m: dict) -> None:
    if not m:
        return
    print(f"distill: {m['steps']} steps in {m['training_minutes']:.1f} min; on {m['eval_images']} eval formulas "
          f"BPE EM {m['bpe']['exact_match']:.3f} CER {m['bpe']['cer']:.3f} in "
          f"{m['bpe']['steps_per_formula']:.1f} steps vs char EM {m['char']['exact_match']:.3f} "
          f"in {m['char']['steps_per_formula']:.1f} ({m['steps_ratio']:.1f}x fewer steps)")
