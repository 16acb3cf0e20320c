"""Stage distill: a decoder that speaks the formula BPE, so a formula costs fewer decode steps.

``python -m pipeline stage=distill`` takes the char model the chain hands over (prune's when its
artifact exists, else the original; ``distill.model`` overrides) and the tokenizer stage's BPE, and
builds a student with the BPE vocabulary: every block copied, each BPE token's embedding and output
row made from the char pieces it is spelled with (``pipeline/distillation/student.py``). The
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

import json
import logging
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from pipeline import metrics as M
from pipeline.artifacts import sha256_json
from pipeline.context import StageContext, file_hash
from pipeline.data.render import render_inputs
from pipeline.data.templates import templated_formulas, varied_formulas
from pipeline.device import placed
from pipeline.distillation.train import Schedule, train_decoder
from pipeline.errors import PipelineError
from pipeline.reports import markdown_table, savefig
from pipeline.tokenization.atoms import normalize_formula

log = logging.getLogger(__name__)
NAME = "distill"
CONFIG_KEY = "distill"
TOKENIZER_FILE = "tokenizer.json"
TARGETS = ("truth", "teacher")
VARIED_CHUNK = 1000  # varied-grammar formulas per encoder-output cache file


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
    targets: str = "truth"
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


# ---- encoder outputs, computed once ------------------------------------------------------------
@torch.no_grad()
def _encode(adapter, pairs: list[tuple[str, str]], batch: int, progress: bool, desc: str
            ) -> tuple[torch.Tensor, list[tuple[str, str]]]:
    items = render_inputs(pairs, adapter.preprocess, None, progress, f"render {desc}")
    if not items:
        raise PipelineError(f"distill: no {desc} formula could be rendered")
    out = []
    bar = tqdm(total=len(items), desc=f"encode {desc}", disable=not progress)
    for i in range(0, len(items), batch):
        out.append(adapter.encode(torch.stack([x for _, _, x in items[i:i + batch]])).half())
        bar.update(len(items[i:i + batch]))
    bar.close()
    return torch.cat(out), [(fid, latex) for fid, latex, _ in items]


def _cached_memory(ctx: StageContext, adapter, model_hash: str, name: str, pairs: list[tuple[str, str]],
                   batch: int) -> tuple[torch.Tensor, list[tuple[str, str]], float, bool]:
    """Encoder outputs of ``pairs`` (fp16) from ``<artifacts>/cache/<name>-<key>``, computed when missing."""
    config = {"formulas": sha256_json(pairs)}
    with ctx.cache_output(f"distill-memory-{name}-{sha256_json([config, model_hash])[:12]}", config,
                          {"model": model_hash}) as out:
        t0 = time.perf_counter()
        if not out.reused:
            memory, kept = _encode(adapter, pairs, batch, ctx.progress, name)
            save_file({"memory": memory.contiguous()}, str(out.path / "memory.safetensors"))
            (out.path / "formulas.json").write_text(json.dumps(kept, ensure_ascii=False))
            out.metrics.update({"images": len(kept), "seconds": time.perf_counter() - t0})
    memory = load_file(str(out.path / "memory.safetensors"))["memory"]
    kept = [tuple(p) for p in json.loads((out.path / "formulas.json").read_text())]
    return memory, kept, float(out.metrics.get("seconds", 0.0)), out.reused


_STYLES = re.compile(r"\\(?:displaystyle|textstyle|scriptstyle|scriptscriptstyle)(?![a-zA-Z])")


def kd_target(truth: str, reading: str, capped: bool) -> str:
    """What the student learns for one image under ``distill.targets=teacher``: the formula when the
    char model read it right (metric-equal) or ran to the cap (a runaway reading teaches nothing),
    else the char model's reading without its display wrapper, line breaks and style switches (what
    every metric strips; the truth targets have none of them)."""
    if capped or M.exact_match(reading, truth):
        return truth
    stripped = " ".join(_STYLES.sub(" ", M.strip_display(reading)).split())
    return stripped or truth


def _teacher_readings(ctx: StageContext, teacher, model_hash: str, memory: torch.Tensor,
                      kept: list[tuple[str, str]], max_length: int, batch: int) -> tuple[list[str], list[bool]]:
    """The char model's greedy readings of the training images (from their cached encoder outputs),
    cached under ``<artifacts>/cache/`` like the outputs themselves."""
    config = {"formulas": sha256_json(kept), "max_length": max_length, **ctx.decoding_key()}
    with ctx.cache_output(f"distill-teacher-{sha256_json([config, model_hash])[:12]}", config,
                          {"model": model_hash}) as out:
        if not out.reused:
            t0 = time.perf_counter()
            bar = tqdm(total=len(kept), desc="teacher readings", disable=not ctx.progress)
            with placed(ctx.device, teacher):
                result = teacher.generate(memory, max_length, batch_size=batch, use_cache=True, encoded=True,
                                          progress=bar.update)
            bar.close()
            (out.path / "readings.json").write_text(json.dumps(
                {"texts": result.texts, "capped": [bool(c) for c in result.hit_cap]}, ensure_ascii=False))
            out.metrics.update({"images": len(kept), "seconds": time.perf_counter() - t0})
    payload = json.loads((out.path / "readings.json").read_text())
    return payload["texts"], payload["capped"]


def _read(adapter, memory: torch.Tensor, truths: list[str], max_length: int, batch: int) -> dict:
    result = adapter.generate(memory, max_length, batch_size=batch, use_cache=True, encoded=True)
    n = len(truths)
    return {"exact_match": sum(M.exact_match(p, t) for p, t in zip(result.texts, truths)) / n,
            "cer": M.corpus_cer(result.texts, truths), "steps_per_formula": sum(result.steps) / n,
            "hit_cap_share": sum(result.hit_cap) / n, "decoder_seconds": result.decoder_seconds,
            "texts": result.texts}


# ---- the stage ----------------------------------------------------------------------------------
def run(cfg: DistillConfig, ctx: StageContext) -> dict:
    validate(cfg)
    max_length, batch_size = int(ctx.cfg.model.max_length), int(ctx.cfg.model.batch_size)
    model_ref = ctx.chain_model(cfg.model, upstream=("prune",))
    tok_file = _tokenizer_file(cfg.tokenizer, ctx)
    name = ctx.artifact_name("distill", cfg.name)
    model_hash = ctx.model_hash(model_ref)
    config = {**asdict(cfg), "model_ref": model_ref, "max_length": max_length, **ctx.decoding_key(), "seed": ctx.seed}
    config.pop("in_chain")  # where the chain takes the model from, not how it is made
    if not cfg.ema:
        config.pop("ema")  # off: the key of the artifacts made before it existed
    train = [(f.id, f.latex) for f in ctx.split("train")][:cfg.train_images]
    train += [(f"templated-{i}", t) for i, t in enumerate(templated_formulas(cfg.templated, seed=ctx.seed))]
    varied = [(f"varied-{i}", t) for i, t in enumerate(varied_formulas(cfg.varied, seed=ctx.seed))]
    if not train and not varied:
        raise PipelineError("distill: no training formulas (distill.train_images=0, distill.templated=0 and "
                            "distill.varied=0)")
    evals = [(f.id, f.latex) for f in ctx.split("eval")][:cfg.eval_images]
    inputs = {"model": model_hash, "tokenizer": file_hash(tok_file), "train": sha256_json(train + varied),
              "eval": sha256_json(evals)}
    with ctx.output(name, config, inputs) as out:
        if out.reused:
            log.info(f"[distill] unchanged, reused {out.path}")
            _print_summary(out.metrics)
            return out.manifest
        t_start = time.perf_counter()
        teacher = ctx.load_model(model_ref)
        log.info(f"[distill] student of {model_ref} with the BPE {tok_file}")
        student = teacher.with_bpe(tok_file)
        mem_train, kept, enc_train_s, train_reused = _cached_memory(ctx, teacher, model_hash, "train", train,
                                                                     batch_size)
        # the varied grammar's outputs are cached on their own, VARIED_CHUNK formulas a file: the split's
        # cache stays valid, and a larger distill.varied (the grammar's draws are a prefix of any larger
        # one's with the same seed) reuses every chunk already computed
        parts = [mem_train]
        for i in range(0, len(varied), VARIED_CHUNK):
            mem_chunk, kept_chunk, chunk_s, _ = _cached_memory(ctx, teacher, model_hash, "varied",
                                                               varied[i:i + VARIED_CHUNK], batch_size)
            parts.append(mem_chunk)
            kept += kept_chunk
            enc_train_s += chunk_s
        mem_train = torch.cat(parts) if len(parts) > 1 else mem_train
        del parts
        mem_eval, kept_eval, enc_eval_s, _ = _cached_memory(ctx, teacher, model_hash, "eval", evals, batch_size)
        from_teacher = 0
        texts = [latex for _, latex in kept]
        if cfg.targets == "teacher":
            readings, capped = _teacher_readings(ctx, teacher, model_hash, mem_train, kept, max_length, batch_size)
            texts = [kd_target(t, r, c) for t, r, c in zip(texts, readings, capped)]
            from_teacher = sum(t != latex for t, (_, latex) in zip(texts, kept))
        targets = [student.tokenizer.encode(normalize_formula(t), max_length=max_length) for t in texts]
        truths = [latex for _, latex in kept_eval]
        char_row = _read(teacher, mem_eval, truths, max_length, batch_size)
        del teacher

        schedule = Schedule(steps=cfg.steps, minutes=cfg.minutes, batch=cfg.batch, lr=cfg.lr,
                            weight_decay=cfg.weight_decay, warmup=cfg.warmup, seed=ctx.seed,
                            checkpoint_every=cfg.checkpoint_every, eval_every=cfg.eval_every,
                            block_lr_scale=cfg.block_lr_scale, freeze_cross_attention=cfg.freeze_cross_attention,
                            ema=cfg.ema)
        torch.manual_seed(ctx.seed)  # dropout
        resume = ctx.artifacts_dir / ".resume" / f"{name}-{sha256_json([config, inputs])[:12]}"
        evaluate = lambda: {k: v for k, v in _read(student, mem_eval, truths, max_length, batch_size).items()  # noqa: E731
                            if k != "texts"}
        with placed(ctx.device, student):  # model.device: the decoder trains and reads there
            trained = train_decoder(student, mem_train, targets, schedule, evaluate, resume / "student.pt",
                                    ctx.progress)
            final = _read(student, mem_eval, truths, max_length, batch_size)
        student.save(out.path / "model")  # with the BPE tokenizer.json, byte for byte

        curve = trained["curve"]
        _plot_curve(out.path / "learning_curve.png", curve, char_row, len(truths))
        with open(out.path / "predictions.jsonl", "w", encoding="utf-8") as f:
            for (fid, truth), c, s in zip(kept_eval, char_row["texts"], final["texts"]):
                f.write(json.dumps({"id": fid, "truth": truth, "char": c, "bpe": s}, ensure_ascii=False) + "\n")
        char = {k: v for k, v in char_row.items() if k != "texts"}
        bpe = {k: v for k, v in final.items() if k != "texts"}
        out.metrics.update({
            "model": model_ref, "tokenizer": str(tok_file), "vocab_size": student.vocab_size,
            "targets": cfg.targets, "targets_from_teacher": from_teacher,
            "train_images": len(kept),
            "train_from_split": len([k for k in kept if not k[0].startswith(("templated-", "varied-"))]),
            "train_varied": len([k for k in kept if k[0].startswith("varied-")]),
            "eval_images": len(truths), "encoder_cache_seconds": enc_train_s + enc_eval_s,
            "encoder_cache_reused": train_reused,
            "steps": trained["steps"], "steps_planned": cfg.steps, "stopped_by": trained["stopped_by"],
            "training_minutes": trained["minutes"], "resumed_at": trained["resumed_at"],
            "final_loss": trained["losses"][-1] if trained["losses"] else None,
            "char": char, "bpe": bpe,
            "steps_ratio": char["steps_per_formula"] / max(bpe["steps_per_formula"], 1e-9),
            "decoder_time_ratio": char["decoder_seconds"] / max(bpe["decoder_seconds"], 1e-9),
            "exact_match_points": 100 * (bpe["exact_match"] - char["exact_match"]),
            "curve": curve, "stage_minutes": (time.perf_counter() - t_start) / 60,
        })
        _write_report(out.path, out.metrics, config)
    shutil.rmtree(resume, ignore_errors=True)
    _print_summary(out.metrics)
    return out.manifest


def _plot_curve(path: Path, curve: list[dict], char: dict, n: int) -> None:
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    minutes = [p["minutes"] for p in curve]
    a.plot(minutes, [p["exact_match"] for p in curve], "o-", label="BPE student")
    a.axhline(char["exact_match"], color="grey", ls="--", label="char model")
    a.set_xlabel("training minutes")
    a.set_ylabel("exact match")
    a.legend()
    b.plot(minutes, [p["cer"] for p in curve], "o-", label="BPE student")
    b.axhline(char["cer"], color="grey", ls="--", label="char model")
    b.set_xlabel("training minutes")
    b.set_ylabel("CER")
    fig.suptitle(f"first {n} eval formulas, greedy, KV cache")
    savefig(fig, path)


def _write_report(folder: Path, m: dict, config: dict) -> None:
    c, s = m["char"], m["bpe"]
    rows = [["char model", f"{c['exact_match']:.3f}", f"{c['cer']:.3f}", f"{c['steps_per_formula']:.1f}",
             f"{c['hit_cap_share']:.2f}", f"{c['decoder_seconds']:.2f}"],
            ["BPE student", f"{s['exact_match']:.3f}", f"{s['cer']:.3f}", f"{s['steps_per_formula']:.1f}",
             f"{s['hit_cap_share']:.2f}", f"{s['decoder_seconds']:.2f}"]]
    curve = [[p["step"], f"{p['minutes']:.1f}", "" if p["loss"] is None else f"{p['loss']:.3f}",
              f"{p['exact_match']:.3f}", f"{p['cer']:.3f}", f"{p['steps_per_formula']:.1f}"] for p in m["curve"]]
    resumed = f" (resumed from the checkpoint at step {m['resumed_at']})" if m["resumed_at"] else ""
    stop = "the step budget" if m["stopped_by"] == "steps" else \
        f"the {config['minutes']} min cap (the weights then depend on the machine's speed)"
    text = [
        "# Stage distill: a BPE decoder from the char model", "",
        f"Student of `{m['model']}` with the BPE `{m['tokenizer']}` ({m['vocab_size']} entries). Trained on "
        f"{m['train_images']} rendered formulas ({m['train_from_split']} from the train split, "
        f"{m['train_images'] - m['train_from_split'] - m.get('train_varied', 0)} templated, "
        f"{m.get('train_varied', 0)} from the varied grammar), encoder "
        f"frozen (outputs cached fp16: {m['encoder_cache_seconds']:.0f} s"
        f"{', reused' if m['encoder_cache_reused'] else ''}), {m['steps']} of {m['steps_planned']} steps in "
        f"{m['training_minutes']:.1f} training minutes, stopped by {stop}{resumed}; this process took "
        f"{m['stage_minutes']:.1f} min. Targets: "
        + ("the formulas." if m.get("targets", "truth") == "truth" else
           f"the char model's readings where they differ from the formula ({m['targets_from_teacher']} of "
           f"{m['train_images']} images; elsewhere the formula)."), "",
        f"## First {m['eval_images']} eval formulas (torch, KV cache, greedy)", "",
        markdown_table(["decoder", "exact match", "CER", "steps / formula", "stopped at cap", "decoder s (all)"], rows),
        "",
        f"{m['steps_ratio']:.1f}x fewer decoder steps, {m['decoder_time_ratio']:.1f}x less torch decoder time, "
        f"{m['exact_match_points']:+.1f} points exact match on these {m['eval_images']} formulas. The whole "
        "eval split in the ORT package: `stage=export export.model=distill`, then the benchmark (docs/distill.md).",
        "", "## Learning curve", "", "![learning curve](learning_curve.png)", "",
        markdown_table(["step", "minutes", "loss", "exact match", "CER", "steps / formula"], curve), "",
        "`predictions.jsonl`: both decoders' readings of these formulas.", "",
    ]
    (folder / "report.md").write_text("\n".join(text))


def _print_summary(m: dict) -> None:
    if not m:
        return
    print(f"distill: {m['steps']} steps in {m['training_minutes']:.1f} min; on {m['eval_images']} eval formulas "
          f"BPE EM {m['bpe']['exact_match']:.3f} CER {m['bpe']['cer']:.3f} in "
          f"{m['bpe']['steps_per_formula']:.1f} steps vs char EM {m['char']['exact_match']:.3f} "
          f"in {m['char']['steps_per_formula']:.1f} ({m['steps_ratio']:.1f}x fewer steps)")
