"""Stage quantize: INT8 where it is safe, float where it is not, chosen by per-layer sensitivity.

``python -m pipeline stage=quantize`` takes the model the chain hands over (the pruned model when the
prune stage's artifact exists, else the original; ``quantize.model=`` overrides), exports its
encoder to float ONNX with the export stage's graph code, and with the calibrate stage's set:

1. compares calibration methods (ORT's MinMax, moving-average MinMax, Percentile, Entropy) on the
   same INT8 graph: encoder SNR, exact match and CER of greedy readings, calibration time;
2. measures every matrix-multiply group's sensitivity both ways (only it INT8; all but it INT8);
3. returns the most sensitive groups to float until the exact-match loss against the float model,
   read on calibration-split formulas, is within ``quantize.budget`` (binary search over the ranking);
4. writes the plan (``plan.json``, editable, ``quantize.plan=FILE`` applies one), the QDQ encoders
   (``encoder.qdq.onnx``: plain ops for TensorRT / Metax; ``encoder.ort_cpu.qdq.onnx``: ONNX Runtime
   fusions + the same plan), and the report with its sensitivity bar chart and heat map;
5. checks the result on eval-split formulas next to the anchors (float, ``quantize_dynamic``,
   ``quantize_static`` defaults, ModelOpt INT8) in one table.

Scheme: symmetric INT8, per-channel weights, per-tensor activations, explicit Q/DQ. The ort_cpu decoder
graphs (first, step, verify) get 8-bit weights (``MatMulNBits``) node by node as the budget allows
(``quantize.decoder``, on by default), then decoder_first's cross-attention K/V projections in
dynamic INT8 where the budget still holds (``quantize.decoder_cross_kv``); the other targets'
decoders stay float (export casts them to FP16 for TensorRT / Metax).
"""
from __future__ import annotations

import logging
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

from calibration import sensitivity
from calibration.calibrators import METHODS, load_calib_set
from pipeline.choices import choices
from pipeline.context import StageContext, file_hash
from pipeline.data.corpus import Split, check_splits
from pipeline.errors import PipelineError, optional_part
from pipeline.names import MANIFEST, QUANTIZE_ORIGINAL
from pipeline.pruning.recover import PRECISION_SETTINGS
from pipeline.quantization import qdq, steps
from pipeline.quantization.check import check_on_eval
from pipeline.quantization.report import summary_line
from pipeline.reports import Phases

NAME = "quantize"
CONFIG_KEY = "quantize"
log = logging.getLogger(__name__)

# the options that take one of a few values (the libraries' lists)
Method = choices("Method", METHODS, __name__)
MethodOrAuto = choices("MethodOrAuto", ("auto", *METHODS), __name__)
SensitivityMetric = choices("SensitivityMetric", sensitivity.METRICS, __name__)
Activations = choices("Activations", qdq.ACTIVATIONS, __name__)
Precision = choices("Precision", PRECISION_SETTINGS, __name__)


@dataclass
class QuantizeConfig:
    model: str = "auto"               # auto = the prune stage's model when it exists, else original | a stage | a folder
    calibration: str = "calibrate"    # the calibrate stage's artifact (name under artifacts, or a folder)
    methods: list[Method] = field(default_factory=lambda: ["minmax", "minmax_ema", "percentile_99.99",
                                                        "percentile", "entropy"])
    method: MethodOrAuto = MethodOrAuto.auto  # auto = the best of the comparison | one of calibration.calibrators.METHODS
    calib_images: int = 32            # calibration-set rows the ranges come from
    # the next rows (with their formulas): accuracy during the search; at 96 one formula was 1 point,
    # twice the budget, and the binary search followed single-formula noise (docs/quantize.md)
    search_images: int = 256
    # where the search formulas come from: null = calibration-set rows calib_images.. (as many as
    # search_images) | a corpus split (train: 1,779 formulas, paired SE ~0.3-0.4 point where 256
    # calibration rows give ~1), its first search_images formulas that render. Never an eval split:
    # the check would read the formulas the plan was chosen on. The ranges, the sensitivity images
    # and the decoder's records stay calibration rows
    search_split: Optional[Split] = None
    # a search reading stops once its candidate is clearly over the budget (loss minus 3 paired standard
    # errors above it), checked after every this many formulas; candidates within or near the budget are
    # read whole, so the decision is the whole set's where it could go either way. 0 = read every one whole
    search_chunk: int = 128
    sensitivity_images: int = 8       # rows whose encoder output scores each group
    metric: SensitivityMetric = SensitivityMetric.snr_db  # sensitivity metric: snr_db | cosine
    budget: float = 0.005             # allowed exact-match loss vs the float model (0.005 = 0.5 point)
    plan: Optional[str] = None        # apply this plan file (JSON) instead of searching
    eval_limit: int = 64              # formulas of each split for the final check and the anchors
    eval_splits: list[Split] = field(default_factory=lambda: [Split.eval, Split.shift])  # the first one: latency, identical tokens
    workers: int = 2                  # session sets a search-set reading is split over, 1 thread each
                                      # (1: one session set with model.threads)
    decoder: bool = True              # ort_cpu decoder weights in 8 bits, node by node, as the budget allows
    # then decoder_first's cross-attention K/V projections of the encoder output (1,024 rows a formula;
    # FP32: 10 of its 14 ms) in dynamic INT8 (half the time), kept where the budget still holds
    decoder_cross_kv: bool = True
    decoder_search_images: int = 256  # calibration rows from calib_images on: the decoder's search set
    check: bool = True                # float vs ours on eval_limit formulas of each split, with latency (stage=all:
                                      # off; export's parity and the benchmark read the packages there)
    anchors: bool = True              # quantize_dynamic, quantize_static defaults, ModelOpt INT8 and NNCF's
                                      # accuracy control (when installed: the compare extra) beside ours
    latency_images: int = 6           # images timed at batch 1 (1 thread) per variant
    # SmoothQuant alpha (pipeline/quantization/smooth.py): folded into a copy of the model, from the
    # activations of the calib_images rows, before its graphs are exported; null = off. A plan file
    # carries its own (quantize.plan wins). Off by default: alpha 0.8 let every ort_cpu projection go
    # INT8 at no loss on the search set, and the package read 1.72-1.78x faster than the float one, but
    # the whole eval split lost 0.9-1.2 points against it, over the 0.5-point budget (docs/quantize.md)
    smoothquant: Optional[float] = None
    # the ort_cpu encoder's activations: uint8 = asymmetric (zero point fitted to the range; ONNX
    # Runtime CPU runs U8S8 at the speed of S8S8) | int8 = symmetric, zero point 0. The plain graph
    # (TensorRT, Metax) is symmetric int8 regardless. A plan file carries its own (quantize.plan wins)
    ort_cpu_activations: Activations = Activations.uint8
    # quantization-aware finetune of the encoder before its graphs are made (pipeline/quantization/qat.py):
    # this many AdamW steps with ModelOpt's INT8 fake quantizers on every encoder projection, distilled
    # from the float model on its own greedy readings of the first qat_images calibration rows; the
    # graphs are then made and quantized from the finetuned weights, and every loss is still measured
    # against the float model handed over. 0 = off. A plan file carries its own (quantize.plan wins)
    qat_steps: int = 0
    qat_lr: float = 2e-5
    qat_images: int = 512             # calibration-set rows (from row 0) it trains on
    qat_minutes: float = 60.0         # wall-clock bound on the steps
    qat_precision: Precision = Precision.fp32  # fp32 | bf16: the student's forward and backward under bf16 autocast
                                      # (2.1x a step on an AVX512-BF16 CPU; slower than fp32 where it is
                                      # emulated) | auto: bf16 where the device computes it natively, else fp32
    # also the original model's graphs with this plan applied, no search (artifact quantize-original;
    # export.baselines packages it): what quantization does without pruning, beside the chain's model.
    # stage=all: off (a comparison; preset=thorough: on). Its plan check reads the first original_search_images
    # rows of the search set
    original: bool = False
    original_search_images: int = 64
    name: Optional[str] = None        # artifact folder; default "quantize" (+ the job's tag in a multirun)


Config = QuantizeConfig


def validate(cfg: QuantizeConfig) -> None:
    if cfg.search_chunk < 0:
        raise PipelineError(f"quantize.search_chunk must be >= 0 (0: read every candidate whole), got {cfg.search_chunk}")
    for key in ("calib_images", "search_images", "sensitivity_images", "eval_limit", "latency_images",
                "decoder_search_images", "workers", "original_search_images"):
        if getattr(cfg, key) < 1:
            raise PipelineError(f"quantize.{key} must be >= 1, got {getattr(cfg, key)}")
    if cfg.qat_steps < 0 or cfg.qat_images < 1 or not cfg.qat_lr > 0 or not cfg.qat_minutes > 0:
        raise PipelineError(f"quantize.qat_steps must be >= 0, qat_images >= 1, qat_lr and qat_minutes > 0; got "
                            f"{cfg.qat_steps}, {cfg.qat_images}, {cfg.qat_lr}, {cfg.qat_minutes}")
    if cfg.qat_precision not in PRECISION_SETTINGS:
        raise PipelineError(f"quantize.qat_precision must be one of {', '.join(PRECISION_SETTINGS)}, "
                            f"got {cfg.qat_precision!r}")
    if not 0.0 <= cfg.budget < 1.0:
        raise PipelineError(f"quantize.budget must be in [0, 1) (a share of exact match), got {cfg.budget}")
    unknown = [m for m in cfg.methods if m not in METHODS]
    if unknown or not cfg.methods:
        raise PipelineError(f"quantize.methods: unknown {unknown or '[]'}; known: {', '.join(METHODS)}")
    if cfg.method != "auto" and cfg.method not in METHODS:
        raise PipelineError(f"quantize.method={cfg.method!r}; known: auto, {', '.join(METHODS)}")
    sensitivity.metric(cfg.metric)
    if cfg.smoothquant is not None and not 0.0 < cfg.smoothquant <= 1.0:
        raise PipelineError(f"quantize.smoothquant must be in (0, 1] (SmoothQuant's alpha) or null, got {cfg.smoothquant}")
    if cfg.ort_cpu_activations not in qdq.ACTIVATIONS:
        raise PipelineError(f"quantize.ort_cpu_activations must be one of {', '.join(qdq.ACTIVATIONS)}, "
                            f"got {cfg.ort_cpu_activations!r}")
    if not cfg.eval_splits or len(set(cfg.eval_splits)) != len(cfg.eval_splits):
        raise PipelineError(f"quantize.eval_splits must name at least one split, each once, got {list(cfg.eval_splits)}")
    check_splits("quantize.eval_splits", cfg.eval_splits)
    if cfg.search_split is not None:
        check_splits("quantize.search_split", cfg.search_split)
    if cfg.search_split is not None and cfg.search_split in cfg.eval_splits:
        raise PipelineError(f"quantize.search_split={cfg.search_split} is one of quantize.eval_splits: the check would "
                            f"read the formulas the plan was chosen on (search on train or calib)")


def _calib_folder(cfg: QuantizeConfig, ctx: StageContext) -> Path:
    for cand in (ctx.artifacts_dir / cfg.calibration, Path(cfg.calibration)):
        if (cand / "calib_set").is_dir():
            return cand
    raise PipelineError(f"quantize.calibration={cfg.calibration}: no calibration set there; "
                        f"run stage=calibrate first")


def run(cfg: QuantizeConfig, ctx: StageContext) -> dict:
    """The chain model's plan and graphs; with ``quantize.original`` (and a chain model that a stage
    made) also the graphs of the model it was made from, with that plan applied."""
    validate(cfg)
    cfg = replace(cfg, qat_precision=ctx.training_precision("quantize.qat_precision", cfg.qat_precision))
    manifest = _run_one(cfg, ctx)
    origin = ctx.chain_origin(manifest["config"]["model_ref"]) if cfg.original else None
    if origin is None or origin == manifest["config"]["model_ref"]:
        return manifest
    plan = ctx.artifacts_dir / ctx.artifact_name("quantize", cfg.name) / "plan.json"
    name = f"{cfg.name}-original" if cfg.name else ctx.artifact_name(QUANTIZE_ORIGINAL, stage="quantize")
    applied = replace(cfg, model=origin, plan=str(plan), original=False, name=name, check=False, anchors=False,
                      search_images=min(cfg.search_images, cfg.original_search_images),
                      decoder_search_images=min(cfg.decoder_search_images, cfg.original_search_images))
    log.info(f"[quantize] {origin}, the model {manifest['config']['model_ref']} was made from, with its plan "
             f"(quantize.original)")
    with optional_part("quantize.original (the model the chain's was made from, with its plan: a comparison)",
                       "quantize.original=false"):
        _run_one(applied, ctx)
    return manifest


def _run_one(cfg: QuantizeConfig, ctx: StageContext) -> dict:
    model_ref = ctx.chain_model(cfg.model, ctx.chain_upstream())
    calib_folder = _calib_folder(cfg, ctx)
    calib_set = load_calib_set(calib_folder)
    if "text" not in calib_set.column_names:
        raise PipelineError(f"{calib_folder}: the calibration set has no 'text' column; the plan search "
                            f"reads its formulas (build it from a labelled source)")
    need = cfg.calib_images + max(cfg.sensitivity_images,
                                  0 if cfg.search_split else cfg.search_images,
                                  cfg.decoder_search_images if cfg.decoder and not cfg.search_split else 0)
    if len(calib_set) < need:
        what = "sensitivity_images" if cfg.search_split else "search_images (or decoder_search_images)"
        raise PipelineError(f"quantize: calib_images + {what} = {need} > {len(calib_set)} images in "
                            f"{calib_folder}; lower them or build a larger set (calibrate.size)")
    inputs = {"model": ctx.model_hash(model_ref), "calib_set": file_hash(calib_folder / "calib_set"),
              "corpus": ctx.split_hash("eval") if _has_corpus(ctx) else ""}
    if cfg.plan:
        inputs["plan"] = file_hash(Path(cfg.plan)) if Path(cfg.plan).is_file() else "missing"
    if cfg.search_split:
        ctx.split(cfg.search_split)  # an unknown or empty split: one error line before any work
        inputs["search_split"] = ctx.split_hash(cfg.search_split)
    limits = ctx.limits
    # quantize.original makes another artifact: switching it must not redo this one; search_split
    # unset is the search as it was before the option, QAT off the stage as before it (same key)
    config = {**{k: v for k, v in asdict(cfg).items() if k not in ("original", "original_search_images")
                 and not (k == "search_split" and v is None)
                 and not (k.startswith("qat_") and not cfg.qat_steps)},  # QAT off: the key as before it
              "model_ref": model_ref, "max_length": limits.max_length, **ctx.decoding_key(),
              "batch_size": limits.batch_size}
    log.info(f"[quantize] model: {model_ref}"
             + (" (handed over by prune)" if model_ref != "original" and cfg.model == "auto" else ""))
    with ctx.output(ctx.artifact_name("quantize", cfg.name), config, inputs) as out:
        if out.reused:
            log.info(f"[quantize] unchanged, reused {out.path}")
            log.info(summary_line(out.metrics))
            return out.manifest
        metrics = _quantize(cfg, ctx, model_ref, calib_set, out.path)
        out.metrics.update(metrics)
    log.info(summary_line(metrics))
    return out.manifest


def _has_corpus(ctx: StageContext) -> bool:
    return (ctx.artifacts_dir / "corpus" / MANIFEST).is_file()


def _quantize(cfg: QuantizeConfig, ctx: StageContext, model_ref: str, calib_set, folder: Path) -> dict:
    """The steps (pipeline/quantization/steps.py), each timed as a phase of the report."""
    limits = ctx.limits
    scratch = folder / ".work"
    scratch.mkdir()
    r = steps.QuantizeRun(cfg, ctx, model_ref, calib_set, folder, scratch, limits.max_length,
                          limits.batch_size, limits.threads)
    phases = Phases()
    steps.float_graphs(r)                        # SmoothQuant and QAT when asked, then the float graphs
    phases.lap('float graphs')
    steps.float_reading(r)                       # the search set read by the float model
    phases.lap('float reading of the search set')
    steps.calibration_methods(r)                 # 1. calibration methods side by side, the ranges
    phases.lap('calibration methods and ranges')
    steps.group_sensitivity(r)                   # 2. each group's sensitivity, both views
    phases.lap('sensitivity')
    steps.search_plan(r, phases.lap)             # 3. the plan: plain graph, then the ort_cpu graph
    steps.final_encoders(r)                      # 4. both QDQ encoders and their readings
    phases.lap('final encoders and their readings')
    steps.decoder(r)                             # 4b. the ort_cpu decoder's 8-bit weights
    phases.lap('decoder plan')
    steps.save_plan(r)
    # 5. the check on eval formulas, beside the anchors (NNCF's judged by our reading of the search set)
    table = check_on_eval(cfg, ctx, r.adapter, r.graphs, folder, calib_set, r.by_name, r.plan, scratch,
                          r.search_seconds, r.reads.validate, len(r.search_truths), r.reference) \
        if cfg.check or cfg.anchors else []
    phases.lap('check on eval and anchors')
    metrics = steps.stage_metrics(r, table, phases.seconds)
    steps.write_outputs(r, metrics, table)
    shutil.rmtree(scratch)
    return metrics
