"""Stage export: an ONNX package per target (encoder + KV-cached decoder), validated and parity-checked.

``python -m pipeline stage=export target=<ort_cpu|tensorrt|metax>`` writes
``<artifacts>/export-<target>/``: ``encoder.onnx``, ``decoder_first.onnx``, ``decoder_step.onnx``,
``decoder_verify.onnx``, ``tokenizer.json``, ``preprocess.json``, ``package.json``,
``provider_options.json``, the parity report, with a drafter (``export.drafter``) ``drafter.json`` (and the
student's two graphs for ``student``), for TensorRT ``build_engines.sh`` (+ engines where ``tensorrt``
imports), and for ort_cpu and TensorRT a Triton Inference Server model repository, ``triton/``
(``export.triton``; docs/triton.md).
"""
from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field, replace
from typing import Optional

from pipeline.choices import choices
from pipeline.context import StageContext
from pipeline.errors import PipelineError, optional_part
from pipeline.names import FLOAT_BASELINE, FLOAT_CHAIN, INT8_ORIGINAL, MANIFEST, QUANTIZE_ORIGINAL
from pipeline.export import drafter as spec
from pipeline.export import steps
from pipeline.export.graphs import VERIFY_WIDTH
from pipeline.export.targets import KNOWN, TargetName, target_config, target_configs
from pipeline.export.triton import TritonConfig

log = logging.getLogger(__name__)

NAME = "export"
CONFIG_KEY = "export"

Drafter = choices("Drafter", spec.KINDS, __name__)  # export.drafter: none | the drafters pipeline/drafting.py knows


@dataclass
class ExportConfig:
    model: str = "auto"                  # auto = the model the chain hands over (quantize's, else prune's, else
                                         # the original) | original | a stage with a model | a model folder
    quantized: str = "auto"              # auto = stage quantize's INT8 encoder when its artifact exists for this
                                         # model | none (a float package) | a quantize artifact (name under
                                         # the artifacts root, or a folder)
    name: Optional[str] = None           # package folder under artifacts; default export-<target>
    qdq_encoder: Optional[str] = None    # a QDQ encoder ONNX (images -> memory) used instead of the float one
    simplify: bool = True                # onnxsim on the float graphs
    formulas: Optional[str] = None       # parity formulas from a file (one per line) instead of calib/eval
    parity_images: int = 8               # calibration images for the tensor parity
    parity_limit: Optional[int] = 64     # eval formulas greedily decoded by torch and ONNX; null = whole split
    baseline_parity_limit: Optional[int] = None  # the same for the baselines' packages; null = parity_limit
                                         # (stage=all: 16; the benchmark reads them against torch on 64)
    min_cosine: Optional[float] = None   # tolerances; null = the default for the package's precision
    min_snr_db: Optional[float] = None
    min_identical: Optional[float] = None  # share of formulas with identical greedy tokens
    trt_max_batch: int = 16              # TensorRT profile: batch 1 .. trt_max_batch
    trt_opt_length: int = 48             # TensorRT profile: optimal decoded length
    trt_build: bool = True               # build engines where tensorrt imports
    targets: list[TargetName] = field(default_factory=list)  # several packages in one run (stage=all: every target);
                                         # empty = the `target` group
    baselines: bool = False              # also the ort_cpu packages the benchmark sets beside the chain's: the
                                         # original and the chain's model in float (export-ort_cpu-float-original,
                                         # -float-chain), the original with the chain's plan (-int8-original, from
                                         # quantize.original's artifact when it exists); stage=all: on
    chain_baseline: bool = True          # with baselines: also the chain's model in float (-float-chain: what
                                         # quantization alone changes); stage=all: off (a comparison), thorough: on
    # speculative decoding (docs/export.md): the package's drafter, checked against its plain greedy readings
    drafter: Drafter = Drafter.none      # none: plain greedy (every package still holds decoder_verify) | ngram
                                         # (the package's own readings of train formulas) | bpe (stage tokenizer's
                                         # formula BPE) | student (stage distill's BPE student reads the image
                                         # first, its reading guides the drafts; the ngram table where it does not
                                         # match; 3.8x / 3.5x fewer package calls but +13 / +21 student calls:
                                         # 0.97x / 0.94x decoder ms, docs/export.md). stage=all: ngram (whole
                                         # eval / shift splits: 3.36x / 2.95x fewer calls, 1.37x / 1.30x decoder
                                         # ms, end to end 2.30x / 2.22x float-original against greedy's 2.00x /
                                         # 1.96x; ~4 minutes of the chain: it reads the train split); off alone
                                         # (a package from export.formulas has no train split to draft from)
    draft_model: str = "distill"         # export.drafter=student: the BPE student (a stage with a model, a folder)
    student_min_match: int = 2           # ... the last tokens written must occur in its guide this long or longer
    draft_int8: bool = True              # ... its graphs in dynamic INT8 on a CPU target (float: fp32 / fp16 elsewhere)
    draft_len: int = 8                   # drafted tokens a decoder_verify call checks (besides the last written);
                                         # at most the graph's width - 1 (export/graphs.py: VERIFY_WIDTH)
    # train formulas the package reads to build the ngram drafter (null: the whole split; 1,779 readings
    # against 256: 3.10x instead of 2.90x fewer calls on calib, benchmarks/speculative.py)
    draft_images: Optional[int] = None
    # the ngram settings: the least decoder time on calib (benchmarks/speculative.py: 256 train
    # readings build it, 256 calib readings judge it; est. 1.61x less decoder time, 2.90x fewer calls)
    ngram_order: int = 12                # longest context (tokens) the ngram drafter keys on
    ngram_min_count: int = 2             # a context must be seen this often to propose
    ngram_self_lookup: int = 3           # >0: the reading itself is a table too, contexts of this many tokens
                                         # or more (0: off)
    ngram_min_confidence: Optional[float] = None  # drafts stop before the product of their contexts' shares
                                         # falls below this (0: up to draft_len always); null: the target's
                                         # draft_min_confidence (a CPU 0.7, a GPU 0: conf/target/*.yaml)
    ngram_tail: Optional[int] = None     # guesses drafted after the confident ones; null: the target's draft_tail
                                         # (a CPU 1: the least decoder time on calib; a GPU 0)
    min_speculative_identical: float = 0.8   # share of the parity formulas whose speculative reading must equal the
                                         # package's greedy one: the verify graph's attention (several rows)
                                         # rounds unlike the step's (one row), so an INT8 package's near-ties can
                                         # flip (whole splits: 97.0 % eval, 95.5 % shift identical)
    speculative_tie_margin: float = 1.0  # ... and a reading that differs must first differ where the package's
                                         # step logits put the two tokens within this (logits). The verify graph's
                                         # rounding moves the step's top-2 gap by up to 0.47 (p99 0.19; 26,000
                                         # positions of five INT8 deployables: benchmarks/verify_deviation.py), and
                                         # 0.25 stopped a chain on a 0.283 flip; a wider one is a broken verify
                                         # graph, cache or loop
    # the Triton Inference Server model repository (triton/) of the targets that name an instance kind
    # (target.triton_instance_kind: ort_cpu, tensorrt): batch size, dynamic batching, instances (docs/triton.md)
    triton: TritonConfig = field(default_factory=TritonConfig)


Config = ExportConfig


# FLOAT_BASELINE, FLOAT_CHAIN, INT8_ORIGINAL (pipeline.names): the packages the benchmark compares the
# chain's with; QUANTIZE_ORIGINAL: where stage quantize writes the original model's graphs with the
# chain's plan (quantize.original). The names are the contract: stages never import each other


def run(cfg: ExportConfig, ctx: StageContext) -> dict:
    """One package for the ``target`` group, or one per name in ``export.targets``; with
    ``export.baselines`` also the ort_cpu packages the benchmark compares them with."""
    validate(cfg)
    references: dict = {}  # torch's parity reading per (model, formulas, cap, batch): once for all targets
    drafts: dict = {}      # the drafter's readings per (model, formulas, cap): once for all targets
    if not cfg.targets:
        manifests = {str(ctx.cfg.target.name): _run_one(replace(cfg, baselines=False), ctx, ctx.cfg.target, references,
                                                   drafts)}
    else:
        manifests = {}
        for name, tcfg in target_configs(cfg.targets, ctx.cfg.target).items():
            one = replace(cfg, targets=[], baselines=False, name=f"{cfg.name}-{name}" if cfg.name else None)
            others = [t for t in cfg.targets if t != name]
            with optional_part(f"export target {name}", f"export.targets=[{','.join(others)}]"):
                manifests[str(name)] = _run_one(one, ctx, tcfg, references, drafts)
    if cfg.baselines:
        with optional_part("export.baselines (the packages the benchmark compares with)", "export.baselines=false"):
            manifests.update(_baselines(cfg, ctx, references))
    return manifests if len(manifests) > 1 else next(iter(manifests.values()))


def _baselines(cfg: ExportConfig, ctx: StageContext, references: dict) -> dict:
    """The float ort_cpu package of the original model (the one the chain's model was made from);
    when the chain has a model of its own (pruned ...), that model in float (what quantization alone
    changes) and, when stage quantize wrote it (``quantize.original``), the original model with the
    chain's plan (what pruning adds)."""
    limit = cfg.parity_limit if cfg.baseline_parity_limit is None else cfg.baseline_parity_limit

    def one(model: str, quantized: str, name: str) -> dict:
        # the baselines decode plain greedy (no drafter): the packages a user has without this tool
        return _run_one(replace(cfg, model=model, quantized=quantized, qdq_encoder=None, name=name, targets=[],
                                baselines=False, parity_limit=limit, drafter="none"), ctx, target_config("ort_cpu"),
                        references)

    chain_model = ctx.chain_model(cfg.model, ctx.chain_upstream())
    origin = ctx.chain_origin(chain_model)  # the model prune started from: the shipped one by default
    made = {FLOAT_BASELINE: one(origin, "none", FLOAT_BASELINE)}
    if chain_model != origin:
        if cfg.chain_baseline:
            made[FLOAT_CHAIN] = one(chain_model, "none", ctx.artifact_name(FLOAT_CHAIN, stage="export"))
        # this job's own (a sweep job's name carries its tag): a shared one was made with another plan
        quantized = ctx.artifacts_dir / ctx.artifact_name(QUANTIZE_ORIGINAL, stage="quantize")
        if (quantized / MANIFEST).is_file():
            made[INT8_ORIGINAL] = one(origin, str(quantized), ctx.artifact_name(INT8_ORIGINAL, stage="export"))
    return made


def validate(cfg: ExportConfig) -> None:
    """The stage's keys, before any stage runs (also under stage=all)."""
    unknown = [t for t in cfg.targets if t not in KNOWN]
    if unknown:
        raise PipelineError(f"export.targets: unknown {unknown}; known: {', '.join(KNOWN)}")
    if cfg.parity_images < 1:
        raise PipelineError(f"export.parity_images must be >= 1, got {cfg.parity_images}")
    for key in ("parity_limit", "baseline_parity_limit"):
        if getattr(cfg, key) is not None and getattr(cfg, key) < 1:
            raise PipelineError(f"export.{key} must be >= 1 or null, got {getattr(cfg, key)}")
    for key in ("trt_max_batch", "trt_opt_length"):
        if getattr(cfg, key) < 1:
            raise PipelineError(f"export.{key} must be >= 1, got {getattr(cfg, key)}")
    if cfg.drafter not in spec.KINDS:
        raise PipelineError(f"export.drafter: unknown {cfg.drafter!r}; known: {', '.join(spec.KINDS)}")
    for key in ("draft_len", "draft_images", "ngram_order", "ngram_min_count", "student_min_match"):
        if getattr(cfg, key) is not None and int(getattr(cfg, key)) < 1:
            raise PipelineError(f"export.{key} must be >= 1, got {getattr(cfg, key)}")
    if cfg.ngram_tail is not None and cfg.ngram_tail < 0:
        raise PipelineError(f"export.ngram_tail must be >= 0, got {cfg.ngram_tail}")
    if cfg.speculative_tie_margin < 0:
        raise PipelineError(f"export.speculative_tie_margin must be >= 0, got {cfg.speculative_tie_margin}")
    if not 0.0 <= cfg.min_speculative_identical <= 1.0:
        raise PipelineError(f"export.min_speculative_identical must be in [0, 1], got {cfg.min_speculative_identical}")
    if cfg.ngram_min_confidence is not None and not 0.0 <= cfg.ngram_min_confidence <= 1.0:
        raise PipelineError(f"export.ngram_min_confidence must be in [0, 1], got {cfg.ngram_min_confidence}")
    if not 0 <= cfg.ngram_self_lookup <= cfg.ngram_order:
        raise PipelineError(f"export.ngram_self_lookup must be 0 (off) or 1..export.ngram_order "
                            f"({cfg.ngram_order}), got {cfg.ngram_self_lookup}")
    if cfg.drafter == "student" and cfg.student_min_match > cfg.ngram_order:
        raise PipelineError(f"export.student_min_match must be <= export.ngram_order ({cfg.ngram_order}), "
                            f"got {cfg.student_min_match}")
    # a TensorRT package's Triton batches fit its engines' profiles (the `target` group alone is checked
    # when its package starts, before the work)
    cfg.triton.check(cfg.trt_max_batch if "tensorrt" in cfg.targets else None)
    if cfg.draft_len > VERIFY_WIDTH - 1:
        raise PipelineError(f"export.draft_len must be <= {VERIFY_WIDTH - 1} (the verify graph reads the last "
                            f"written token and {VERIFY_WIDTH - 1} drafts), got {cfg.draft_len}")


def _run_one(cfg: ExportConfig, ctx: StageContext, tcfg, references: Optional[dict] = None,
             drafts: Optional[dict] = None) -> dict:
    """One package for target config ``tcfg``: the model (and INT8 graphs) the chain hands over, built for
    the target and written, then read against torch on ONNX Runtime CPU (tensors, greedy tokens, with a
    drafter its speculative readings); a package that fails keeps its report in ``failed/<name>/``.
    ``references`` / ``drafts``: torch's and the drafter's readings, shared between one run's packages."""
    job = steps.plan_package(cfg, ctx, tcfg)
    with ctx.output(job.name, job.config, job.inputs) as out:
        if out.reused:
            log.info(f"[export] unchanged, reused {out.path}")
            steps.log_summary(out.metrics, job.name, job.model_ref)
            return out.manifest
        built, meta = steps.write_graphs(cfg, job, out.path, ctx.progress)
        checked = steps.parity(cfg, ctx, job, out.path, meta, references)
        speculative = steps.speculative_check(cfg, ctx, job, out.path, meta, checked, drafts)
        engines = steps.engines(cfg, job, out.path, meta, built, checked.failures)
        metrics = steps.parity_metrics(cfg, job, meta, built, checked, engines, speculative)
        steps.write_parity(out.path, meta, built, metrics, checked)
        if checked.failures:
            raise steps.parity_failed(ctx, out.path, job.name, job.target.name, checked.failures)
        out.metrics.update(metrics)
    shutil.rmtree(steps.failed_folder(ctx, job.name), ignore_errors=True)  # a stale report of an earlier failure
    steps.log_summary(metrics, job.name, job.model_ref)
    return out.manifest
