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

import json
import logging
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from pipeline.artifacts import atomic_write_dir
from pipeline.context import StageContext, file_hash
from pipeline.data.render import render_inputs
from pipeline.errors import PipelineError, optional_part
from pipeline.files import read_formulas
from pipeline.names import (FLOAT_BASELINE, FLOAT_CHAIN, INT8_DECODERS_BY_TARGET, INT8_ORIGINAL, QDQ_ENCODERS,
                            QUANTIZE_ORIGINAL)
from pipeline.export import drafter as spec
from pipeline.export.graphs import VERIFY_WIDTH
from pipeline.export import tensorrt as trt_build
from pipeline.export import triton
from pipeline.export.build import build_graphs
from pipeline.export.package import write_package
from pipeline.export.parity import check_tolerances, reused_reference, tensor_parity, token_parity
from pipeline.export.report import write_report
from pipeline.export.runtime import OnnxPackage
from pipeline.export.targets import KNOWN, resolve_target, target_config, target_configs
from pipeline.export.triton import TritonConfig
from pipeline.export.validator import check_triton_repository

log = logging.getLogger(__name__)

NAME = "export"
CONFIG_KEY = "export"

# parity tolerances by the least precise graph in the package (export.min_* override them)
TOLERANCES = {
    "fp32": {"min_cosine": 0.9999, "min_snr_db": 40.0, "min_identical": 0.95},
    "fp16": {"min_cosine": 0.999, "min_snr_db": 25.0, "min_identical": 0.9},
    "int8": {"min_cosine": 0.98, "min_snr_db": 12.0, "min_identical": 0.6},
}


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
    targets: list[str] = field(default_factory=list)  # several packages in one run (stage=all: every target);
                                         # empty = the `target` group
    baselines: bool = False              # also the ort_cpu packages the benchmark sets beside the chain's: the
                                         # original and the chain's model in float (export-ort_cpu-float-original,
                                         # -float-chain), the original with the chain's plan (-int8-original, from
                                         # quantize.original's artifact when it exists); stage=all: on
    chain_baseline: bool = True          # with baselines: also the chain's model in float (-float-chain: what
                                         # quantization alone changes); stage=all: off (a comparison), thorough: on
    # speculative decoding (docs/export.md): the package's drafter, checked against its plain greedy readings
    drafter: str = "none"                # none: plain greedy (every package still holds decoder_verify) | ngram
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
    # against 256: 3.10x instead of 2.90x fewer calls on calib, benchmarks/speculative.py, 2026-12-05)
    draft_images: Optional[int] = None
    # the ngram settings: the least decoder time on calib (benchmarks/speculative.py, 2026-12-05: 256 train
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
                                         # flip (whole splits, 2026-12-04: 97.0 % eval, 95.5 % shift identical)
    speculative_tie_margin: float = 0.25  # ... and a reading that differs must first differ where the package's
                                         # step logits put the two tokens within this (logits; the flips seen:
                                         # 0.003-0.08): a wider one is a broken verify graph, cache or loop
    # the Triton Inference Server model repository (triton/) of the targets that name an instance kind
    # (target.triton_instance_kind: ort_cpu, tensorrt): batch size, dynamic batching, instances (docs/triton.md)
    triton: TritonConfig = field(default_factory=TritonConfig)


Config = ExportConfig


def _formulas(cfg: ExportConfig, ctx: StageContext) -> tuple[list, list, dict[str, str]]:
    """(id, latex) pairs for the tensor parity (calib) and the token parity (eval), and their hash."""
    if cfg.formulas:
        path = Path(cfg.formulas)
        pairs = [(f"line{i}", ln) for i, ln in read_formulas(path, "export.formulas")]
        return pairs, pairs, {"formulas": file_hash(path)}
    calib = [(f.id, f.latex) for f in ctx.split("calib")]
    evals = [(f.id, f.latex) for f in ctx.split("eval")]
    return calib, evals, {"corpus": ctx.upstream("corpus")["outputs"]["formulas.jsonl"]}


def _chain(cfg: ExportConfig, ctx: StageContext, target: str) -> tuple[str, Optional[Path], dict[str, Path], str]:
    """(model reference, QDQ encoder or None, INT8 decoders, what was handed over):
    prune -> quantize -> export."""
    if cfg.qdq_encoder:
        return ctx.chain_model(cfg.model, ctx.chain_upstream()), Path(cfg.qdq_encoder), {}, ""
    if cfg.quantized == "none":
        return ctx.chain_model(cfg.model, ctx.chain_upstream()), None, {}, ""
    if cfg.quantized == "auto":
        folder = ctx.stage_folder("quantize")
    else:  # a quantize artifact's name under the artifacts root (like export.model), or a folder
        by_name = ctx.artifacts_dir / cfg.quantized
        folder = by_name if (by_name / "manifest.json").is_file() else Path(cfg.quantized)
    if not (folder / "manifest.json").is_file():
        if cfg.quantized != "auto":
            raise PipelineError(f"export.quantized={cfg.quantized}: no quantize artifact there (run stage=quantize)")
        model = ctx.chain_model(cfg.model, ctx.chain_upstream())
        return model, None, {}, f"no quantize artifact: a float package of {model}" if cfg.model == "auto" else ""
    manifest = json.loads((folder / "manifest.json").read_text())
    quantized_model = manifest["config"]["model_ref"]
    model = quantized_model if cfg.model == "auto" else cfg.model
    if ctx.model_hash(model) != manifest["inputs"]["model"]:
        if cfg.quantized == "auto":
            return model, None, {}, f"quantize's artifact was made from another model ({quantized_model}): float package"
        raise PipelineError(f"export.quantized={cfg.quantized} was made from model {quantized_model!r}, "
                            f"not export.model={model!r}")
    decoders = {g: folder / f for g, f in INT8_DECODERS_BY_TARGET.get(target, {}).items() if (folder / f).is_file()}
    took = "INT8 encoder" + (" and decoders" if decoders else "")
    return model, folder / QDQ_ENCODERS[target], decoders, f"took {model}'s {took} from {folder}"


def _finetuned(qdq_encoder: Optional[Path]) -> bool:
    """Whether the quantize artifact holding ``qdq_encoder`` finetuned its encoder quantization-aware
    (its manifest's metrics say how many steps ran); a QDQ encoder from elsewhere: not known, no."""
    manifest = qdq_encoder.parent / "manifest.json" if qdq_encoder is not None else None
    if manifest is None or not manifest.is_file():
        return False
    qat = json.loads(manifest.read_text()).get("metrics", {}).get("qat") or {}
    return int(qat.get("steps", 0) or 0) > 0


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
        manifests = {ctx.cfg.target.name: _run_one(replace(cfg, baselines=False), ctx, ctx.cfg.target, references,
                                                   drafts)}
    else:
        manifests = {}
        for name, tcfg in target_configs(cfg.targets, ctx.cfg.target).items():
            one = replace(cfg, targets=[], baselines=False, name=f"{cfg.name}-{name}" if cfg.name else None)
            others = [t for t in cfg.targets if t != name]
            with optional_part(f"export target {name}", f"export.targets=[{','.join(others)}]"):
                manifests[name] = _run_one(one, ctx, tcfg, references, drafts)
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
        if (quantized / "manifest.json").is_file():
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
    target = resolve_target(tcfg)
    # a TensorRT package's Triton batches are bounded by its engines' profiles
    trt_max_batch = cfg.trt_max_batch if target.name == "tensorrt" else None
    triton_kind = target.triton_instance_kind if cfg.triton.enabled else None
    if triton_kind:
        cfg.triton.check(trt_max_batch)
    mcfg = ctx.cfg.model
    max_length, batch_size = int(mcfg.max_length), int(mcfg.batch_size)
    name = ctx.artifact_name(f"export-{target.name}", cfg.name, stage="export")
    model_ref, qdq_path, int8_decoders, handed = _chain(cfg, ctx, target.name)
    if handed:
        log.info(f"[export] {handed}")
    adapter = ctx.load_model(model_ref)
    calib, evals, inputs = _formulas(cfg, ctx)
    inputs["model"] = ctx.model_hash(model_ref)
    if qdq_path is not None:
        if not qdq_path.is_file():
            raise PipelineError(f"export.qdq_encoder: no such file {qdq_path}")
        inputs["qdq_encoder"] = file_hash(qdq_path)
    for g, path in int8_decoders.items():
        inputs[f"int8_{g}"] = file_hash(path)
    if cfg.drafter == "student":  # the student's weights make the drafter; a missing one: before the work
        inputs["draft_model"] = ctx.model_hash(cfg.draft_model)
        spec.check_student(ctx.model_folder(cfg.draft_model), cfg.draft_model)
    # one package: which others the run also makes (targets, baselines) is not part of its config
    # (the Triton settings only where the package gets a repository: a Metax package's stays unchanged)
    left_out = ("targets", "baselines", "baseline_parity_limit", *(() if triton_kind else ("triton",)))
    config = {**{k: v for k, v in asdict(cfg).items() if k not in left_out},
              "target": OmegaConf.to_container(tcfg, resolve=True), "max_length": max_length, **ctx.decoding_key(),
              "batch_size": batch_size, "model_ref": model_ref}
    with ctx.output(name, config, inputs) as out:
        if out.reused:
            log.info(f"[export] unchanged, reused {out.path}")
            _print_summary(out.metrics, name, model_ref)
            return out.manifest
        bar = tqdm(total=4, desc=f"export {target.name}", disable=not ctx.progress)
        built = build_graphs(adapter, target, cfg.simplify, qdq_path, lambda _: bar.update(), inputs["model"],
                             int8_decoders)
        bar.close()
        if built.violations:
            shown = "; ".join(str(v) for v in built.violations[:5])
            more = f" (+{len(built.violations) - 5} more)" if len(built.violations) > 5 else ""
            raise PipelineError(f"the {target.name} package breaks its runtime's rules: {shown}{more}")
        meta = write_package(out.path, adapter, built, target, max_length, bool(mcfg.flush_denormals))
        if triton_kind:  # the repository is held to its contract like the graphs to their rules
            meta["triton"] = triton.write_repository(out.path, cfg.triton, triton_kind, target.name)
            problems = check_triton_repository(out.path, meta, triton_kind, trt_max_batch)
            if problems:
                raise PipelineError(f"the {target.name} package's Triton repository breaks its contract: "
                                    + "; ".join(problems[:5]))

        # parity on ONNX Runtime CPU, the reference runtime for every target
        package = OnnxPackage(out.path, threads=int(mcfg.threads or 0), provider="CPUExecutionProvider")
        calib_items = render_inputs(calib, adapter.preprocess, cfg.parity_images, ctx.progress, "export calib")
        eval_items = render_inputs(evals, adapter.preprocess, cfg.parity_limit, ctx.progress, "export eval")
        if not calib_items or not eval_items:
            raise PipelineError("no parity formula could be rendered")
        truth_ids = [adapter.encode_text(latex)[:max_length] for _, latex, _ in calib_items]
        tensors = tensor_parity(adapter, package, torch.stack([x[2] for x in calib_items]), truth_ids)
        level = "int8" if any("int8" in p for p in meta["precision"].values()) else \
            ("fp16" if any("fp16" in p for p in meta["precision"].values()) else "fp32")
        tol = {k: (getattr(cfg, k) if getattr(cfg, k) is not None else v) for k, v in TOLERANCES[level].items()}
        failures = check_tolerances(tensors, None, **tol)
        if failures:  # fail before the costly greedy decoding; the numbers stay readable
            (out.path / "parity.json").write_text(json.dumps(
                {"target": target.name, "precision": meta["precision"], "tolerances": tol, "tolerance_level": level,
                 "tensors": tensors, "failures": failures}, indent=2) + "\n")
            raise _parity_failed(ctx, out.path, name, target.name, failures)
        key = (inputs["model"], tuple(x[0] for x in eval_items), max_length, batch_size)
        references = {} if references is None else references
        tokens = token_parity(adapter, package, torch.stack([x[2] for x in eval_items]),
                              [x[1] for x in eval_items], [x[0] for x in eval_items], max_length, batch_size,
                              progress=ctx.progress, reference=reused_reference(references, key))
        references[key] = tokens.reference
        finetuned = _finetuned(qdq_path)
        failures = check_tolerances(tensors, tokens, **tol, finetuned=finetuned)
        speculative = None
        if cfg.drafter != "none" and "decoder_verify" not in meta["graphs"]:
            log.warning(f"[export] {name}: no speculative decoding: stage quantize's INT8 decoders predate the "
                        f"verify graph (run stage=quantize again for it)")
        elif cfg.drafter != "none" and not failures:
            source = spec.make(cfg, ctx, adapter, package, out.path, name, inputs["model"],
                               {} if drafts is None else drafts, target, calib_items[0][2].numpy(),
                               inputs.get("draft_model"))
            speculative = {"drafter": cfg.drafter, "draft_len": cfg.draft_len, "source": source,
                           **spec.check(out.path, torch.stack([x[2] for x in eval_items]).numpy(), tokens.package_ids,
                                        max_length, int(mcfg.threads or 0))}
            failures += spec.verdict(speculative, cfg.min_speculative_identical, cfg.speculative_tie_margin)
        # engines only for a package that passed parity (a build takes minutes and ships what failed)
        engines = None
        if target.name == "tensorrt":
            engines = ({"built": False, "reason": "parity failed"} if failures
                       else trt_build.engines(out.path, meta, built.models, cfg.trt_max_batch, cfg.trt_opt_length,
                                              cfg.trt_build))
        eval_source = f"file {cfg.formulas}" if cfg.formulas else "corpus split 'eval'"
        metrics = {"target": target.name, "precision": meta["precision"], "tolerances": tol,
                   "tolerance_level": level, "tensors": tensors, "qat_finetuned": finetuned,
                   "tokens": tokens.as_dict(), "eval_source": eval_source,
                   "parity_limit": cfg.parity_limit, "eval_available": len(evals), "max_length": max_length,
                   "node_counts": {g: sum(h[list(h)[-1]].values()) for g, h in built.histograms.items()},
                   "tensorrt": engines, "speculative": speculative}
        (out.path / "parity.json").write_text(json.dumps(metrics, indent=2) + "\n")
        with open(out.path / "parity_rows.jsonl", "w", encoding="utf-8") as f:
            for row in tokens.rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        write_report(out.path, meta, built.histograms, metrics, tokens.rows, failures)
        if failures:
            raise _parity_failed(ctx, out.path, name, target.name, failures)
        out.metrics.update(metrics)
    shutil.rmtree(_failed_folder(ctx, name), ignore_errors=True)  # a stale report of an earlier failure
    _print_summary(metrics, name, model_ref)
    return out.manifest


# what a failed export keeps, outside the (discarded) package folder: <artifacts>/failed/<name>/
FAILED_DIR = "failed"
FAILED_FILES = ("parity.json", "parity_rows.jsonl", "report.md", "op_histogram.png")


def _failed_folder(ctx: StageContext, name: str) -> Path:
    return ctx.artifacts_dir / FAILED_DIR / name


def _parity_failed(ctx: StageContext, folder: Path, name: str, target: str, failures: list[str]) -> PipelineError:
    """Copy the parity report of a package that failed to ``failed/<name>/`` (the package folder is
    temporary and goes with the error); the error names where it is."""
    kept = _failed_folder(ctx, name)
    with atomic_write_dir(kept) as tmp:
        for f in FAILED_FILES:
            if (folder / f).is_file():
                shutil.copy2(folder / f, tmp / f)
    return PipelineError(f"parity beyond tolerance for {target}: {'; '.join(failures)} (report kept in {kept})")


def _print_summary(m: dict, name: str, model_ref: str) -> None:
    t = m["tokens"]
    worst_cos = min(s["cosine"] for s in m["tensors"].values())
    worst_snr = min(s["snr_db"] for s in m["tensors"].values())
    log.info(f"[export] {name} (model {model_ref}): identical greedy tokens {t['identical']:.3f} of {t['n']} "
             f"(token agreement {t['token_agreement']:.4f}), exact match torch {t['exact_match_torch']:.3f} / "
             f"onnx {t['exact_match_onnx']:.3f}; worst cosine {worst_cos:.6f}, worst SNR {worst_snr:.1f} dB")
    s = m.get("speculative")
    if s:
        log.info(f"[export] {name}: speculative decoding ({s['drafter']} drafter, {s['draft_len']} drafts a call) "
                 f"identical to greedy on {s['identical']:.3f} of {s['n']} formulas; {s['calls_per_reading']} decoder "
                 f"calls a reading for {s['tokens_per_reading']} tokens ({s['tokens_per_call']} a call)")
