"""Stage export's steps for one package, in order: what the chain hands over and the artifact's key
(:func:`plan_package`), the graphs built, held to the runtime's rules and written (:func:`write_graphs`),
the parity on ONNX Runtime CPU (:func:`parity`), the speculative check with a drafter
(:func:`speculative_check`), TensorRT's engines (:func:`engines`) and the parity report
(:func:`write_parity`). ``cfg`` is the stage's ExportConfig, ``ctx`` its StageContext."""
from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from pipeline.artifacts import atomic_write_dir
from pipeline.context import ModelLimits, file_hash
from pipeline.data.render import render_inputs
from pipeline.errors import PipelineError
from pipeline.export import drafter as spec
from pipeline.export import tensorrt as trt_build
from pipeline.export import triton
from pipeline.export.build import BuiltGraphs, build_graphs
from pipeline.export.package import write_package
from pipeline.export.parity import TokenParity, check_tolerances, reused_reference, tensor_parity, token_parity
from pipeline.export.report import write_report
from pipeline.export.runtime import OnnxPackage
from pipeline.export.targets import Target, resolve_target
from pipeline.export.validator import check_triton_repository
from pipeline.files import read_formulas
from pipeline.names import DECODER_VERIFY, INT8_DECODERS_BY_TARGET, MANIFEST, QDQ_ENCODERS

log = logging.getLogger(__name__)

# parity tolerances by the least precise graph in the package (export.min_* override them)
TOLERANCES = {
    "fp32": {"min_cosine": 0.9999, "min_snr_db": 40.0, "min_identical": 0.95},
    "fp16": {"min_cosine": 0.999, "min_snr_db": 25.0, "min_identical": 0.9},
    "int8": {"min_cosine": 0.98, "min_snr_db": 12.0, "min_identical": 0.6},
}

# what a failed export keeps, outside the (discarded) package folder: <artifacts>/failed/<name>/
FAILED_DIR = "failed"
FAILED_FILES = ("parity.json", "parity_rows.jsonl", "report.md", "op_histogram.png")


def formulas(cfg, ctx) -> tuple[list, list, dict[str, str]]:
    """(id, latex) pairs for the tensor parity (calib) and the token parity (eval), and their hash."""
    if cfg.formulas:
        path = Path(cfg.formulas)
        pairs = [(f"line{i}", ln) for i, ln in read_formulas(path, "export.formulas")]
        return pairs, pairs, {"formulas": file_hash(path)}
    calib = [(f.id, f.latex) for f in ctx.split("calib")]
    evals = [(f.id, f.latex) for f in ctx.split("eval")]
    return calib, evals, {"corpus": ctx.split_hash("eval")}


def chain(cfg, ctx, target: str) -> tuple[str, Optional[Path], dict[str, Path], str]:
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
        folder = by_name if (by_name / MANIFEST).is_file() else Path(cfg.quantized)
    if not (folder / MANIFEST).is_file():
        if cfg.quantized != "auto":
            raise PipelineError(f"export.quantized={cfg.quantized}: no quantize artifact there (run stage=quantize)")
        model = ctx.chain_model(cfg.model, ctx.chain_upstream())
        return model, None, {}, f"no quantize artifact: a float package of {model}" if cfg.model == "auto" else ""
    manifest = json.loads((folder / MANIFEST).read_text())
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


def finetuned(qdq_encoder: Optional[Path]) -> bool:
    """Whether the quantize artifact holding ``qdq_encoder`` finetuned its encoder quantization-aware
    (its manifest's metrics say how many steps ran); a QDQ encoder from elsewhere: not known, no."""
    manifest = qdq_encoder.parent / MANIFEST if qdq_encoder is not None else None
    if manifest is None or not manifest.is_file():
        return False
    qat = json.loads(manifest.read_text()).get("metrics", {}).get("qat") or {}
    return int(qat.get("steps", 0) or 0) > 0


@dataclass
class PackageJob:
    """One package before any work: its target and name, the model and graphs the chain hands over, the
    parity formulas, and the config and inputs that key its artifact."""
    target: Target
    name: str
    model_ref: str
    qdq_path: Optional[Path]
    int8_decoders: dict[str, Path]
    adapter: Any
    calib: list
    evals: list
    inputs: dict
    config: dict
    triton_kind: Optional[str]     # the Triton repository's instance kind; None: no repository
    trt_max_batch: Optional[int]   # a TensorRT package's Triton batches are bounded by its engines' profiles
    limits: ModelLimits


def plan_package(cfg, ctx, tcfg) -> PackageJob:
    """The package for target config ``tcfg``: checked, its model loaded, its artifact's key."""
    target = resolve_target(tcfg)
    trt_max_batch = cfg.trt_max_batch if target.name == "tensorrt" else None
    triton_kind = target.triton_instance_kind if cfg.triton.enabled else None
    if triton_kind:
        cfg.triton.check(trt_max_batch)
    limits = ctx.limits
    name = ctx.artifact_name(f"export-{target.name}", cfg.name, stage="export")
    model_ref, qdq_path, int8_decoders, handed = chain(cfg, ctx, target.name)
    if handed:
        log.info(f"[export] {handed}")
    adapter = ctx.load_model(model_ref)
    calib, evals, inputs = formulas(cfg, ctx)
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
              "target": OmegaConf.to_container(tcfg, resolve=True), "max_length": limits.max_length,
              **ctx.decoding_key(), "batch_size": limits.batch_size, "model_ref": model_ref}
    return PackageJob(target, name, model_ref, qdq_path, int8_decoders, adapter, calib, evals, inputs, config,
                      triton_kind, trt_max_batch, limits)


def write_graphs(cfg, job: PackageJob, folder: Path, progress: bool) -> tuple[BuiltGraphs, dict]:
    """The package's graphs built for its target, held to its runtime's rules and written into ``folder``
    with its metadata (and its Triton repository, held to its contract); returns them and the metadata."""
    bar = tqdm(total=4, desc=f"export {job.target.name}", disable=not progress)
    built = build_graphs(job.adapter, job.target, cfg.simplify, job.qdq_path, lambda _: bar.update(),
                         job.inputs["model"], job.int8_decoders)
    bar.close()
    if built.violations:
        shown = "; ".join(str(v) for v in built.violations[:5])
        more = f" (+{len(built.violations) - 5} more)" if len(built.violations) > 5 else ""
        raise PipelineError(f"the {job.target.name} package breaks its runtime's rules: {shown}{more}")
    meta = write_package(folder, job.adapter, built, job.target, job.limits.max_length, job.limits.flush_denormals)
    if job.triton_kind:  # the repository is held to its contract like the graphs to their rules
        meta["triton"] = triton.write_repository(folder, cfg.triton, job.triton_kind, job.target.name)
        problems = check_triton_repository(folder, meta, job.triton_kind, job.trt_max_batch)
        if problems:
            raise PipelineError(f"the {job.target.name} package's Triton repository breaks its contract: "
                                + "; ".join(problems[:5]))
    return built, meta


def tolerances(cfg, precision: dict[str, str]) -> tuple[str, dict[str, float]]:
    """The package's tolerance level (its least precise graph) and its tolerances, ``export.min_*`` first."""
    level = "int8" if any("int8" in p for p in precision.values()) else \
        ("fp16" if any("fp16" in p for p in precision.values()) else "fp32")
    return level, {k: (getattr(cfg, k) if getattr(cfg, k) is not None else v) for k, v in TOLERANCES[level].items()}


@dataclass
class Parity:
    """The package's readings against torch's: its tensors on calib formulas, its greedy tokens on eval
    formulas, and what fails it."""
    package: OnnxPackage
    calib_items: list
    eval_items: list
    level: str
    tol: dict[str, float]
    tensors: dict
    tokens: TokenParity
    finetuned: bool
    failures: list[str]


def parity(cfg, ctx, job: PackageJob, folder: Path, meta: dict, references: Optional[dict]) -> Parity:
    """Parity on ONNX Runtime CPU, the reference runtime for every target: the tensors first (a package
    beyond them fails before the costly greedy decoding), then the greedy tokens; torch's reading is
    taken from ``references`` when another package of the same model already decoded the formulas."""
    package = OnnxPackage(folder, threads=job.limits.threads, provider="CPUExecutionProvider")
    calib_items = render_inputs(job.calib, job.adapter.preprocess, cfg.parity_images, ctx.progress, "export calib")
    eval_items = render_inputs(job.evals, job.adapter.preprocess, cfg.parity_limit, ctx.progress, "export eval")
    if not calib_items or not eval_items:
        raise PipelineError("no parity formula could be rendered")
    truth_ids = [job.adapter.encode_text(latex)[:job.limits.max_length] for _, latex, _ in calib_items]
    tensors = tensor_parity(job.adapter, package, torch.stack([x[2] for x in calib_items]), truth_ids)
    level, tol = tolerances(cfg, meta["precision"])
    failures = check_tolerances(tensors, None, **tol)
    if failures:  # fail before the costly greedy decoding; the numbers stay readable
        (folder / "parity.json").write_text(json.dumps(
            {"target": job.target.name, "precision": meta["precision"], "tolerances": tol, "tolerance_level": level,
             "tensors": tensors, "failures": failures}, indent=2) + "\n")
        raise parity_failed(ctx, folder, job.name, job.target.name, failures)
    key = (job.inputs["model"], tuple(x[0] for x in eval_items), job.limits.max_length, job.limits.batch_size)
    references = {} if references is None else references
    tokens = token_parity(job.adapter, package, torch.stack([x[2] for x in eval_items]),
                          [x[1] for x in eval_items], [x[0] for x in eval_items], job.limits.max_length,
                          job.limits.batch_size, progress=ctx.progress, reference=reused_reference(references, key))
    references[key] = tokens.reference
    qat = finetuned(job.qdq_path)
    failures = check_tolerances(tensors, tokens, **tol, finetuned=qat)
    return Parity(package, calib_items, eval_items, level, tol, tensors, tokens, qat, failures)


def speculative_check(cfg, ctx, job: PackageJob, folder: Path, meta: dict, checked: Parity,
                      drafts: Optional[dict]) -> Optional[dict]:
    """With a drafter (``export.drafter``), on a package that passed its parity: the drafter built into
    ``folder`` and the package's speculative readings of the eval formulas against its greedy ones (what
    fails it joins ``checked.failures``); None without one."""
    if cfg.drafter != "none" and DECODER_VERIFY not in meta["graphs"]:
        log.warning(f"[export] {job.name}: no speculative decoding: stage quantize's INT8 decoders predate the "
                    f"verify graph (run stage=quantize again for it)")
        return None
    if cfg.drafter == "none" or checked.failures:
        return None
    source = spec.make(cfg, ctx, job.adapter, checked.package, folder, job.name, job.inputs["model"],
                       {} if drafts is None else drafts, job.target, checked.calib_items[0][2].numpy(),
                       job.inputs.get("draft_model"))
    speculative = {"drafter": cfg.drafter, "draft_len": cfg.draft_len, "source": source,
                   **spec.check(folder, torch.stack([x[2] for x in checked.eval_items]).numpy(),
                                checked.tokens.package_ids, job.limits.max_length, job.limits.threads)}
    checked.failures += spec.verdict(speculative, cfg.min_speculative_identical, cfg.speculative_tie_margin)
    return speculative


def engines(cfg, job: PackageJob, folder: Path, meta: dict, built: BuiltGraphs, failures: list[str]) -> Optional[dict]:
    """A TensorRT package's engines, only for a package that passed parity (a build takes minutes and
    would ship what failed); None for any other target."""
    if job.target.name != "tensorrt":
        return None
    if failures:
        return {"built": False, "reason": "parity failed"}
    return trt_build.engines(folder, meta, built.models, cfg.trt_max_batch, cfg.trt_opt_length, cfg.trt_build)


def parity_metrics(cfg, job: PackageJob, meta: dict, built: BuiltGraphs, checked: Parity,
                   engines_built: Optional[dict], speculative: Optional[dict]) -> dict:
    """The package's metrics (``parity.json``, the manifest's metrics)."""
    eval_source = f"file {cfg.formulas}" if cfg.formulas else "corpus split 'eval'"
    return {"target": job.target.name, "precision": meta["precision"], "tolerances": checked.tol,
            "tolerance_level": checked.level, "tensors": checked.tensors, "qat_finetuned": checked.finetuned,
            "tokens": checked.tokens.as_dict(), "eval_source": eval_source,
            "parity_limit": cfg.parity_limit, "eval_available": len(job.evals), "max_length": job.limits.max_length,
            "node_counts": {g: sum(h[list(h)[-1]].values()) for g, h in built.histograms.items()},
            "tensorrt": engines_built, "speculative": speculative}


def write_parity(folder: Path, meta: dict, built: BuiltGraphs, metrics: dict, checked: Parity) -> None:
    """``parity.json``, ``parity_rows.jsonl`` (a row per eval formula) and the report."""
    (folder / "parity.json").write_text(json.dumps(metrics, indent=2) + "\n")
    with open(folder / "parity_rows.jsonl", "w", encoding="utf-8") as f:
        for row in checked.tokens.rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    write_report(folder, meta, built.histograms, metrics, checked.tokens.rows, checked.failures)


def failed_folder(ctx, name: str) -> Path:
    return ctx.artifacts_dir / FAILED_DIR / name


def parity_failed(ctx, folder: Path, name: str, target: str, failures: list[str]) -> PipelineError:
    """Copy the parity report of a package that failed to ``failed/<name>/`` (the package folder is
    temporary and goes with the error); the error names where it is."""
    kept = failed_folder(ctx, name)
    with atomic_write_dir(kept) as tmp:
        for f in FAILED_FILES:
            if (folder / f).is_file():
                shutil.copy2(folder / f, tmp / f)
    return PipelineError(f"parity beyond tolerance for {target}: {'; '.join(failures)} (report kept in {kept})")


def log_summary(m: dict, name: str, model_ref: str) -> None:
    """The package's parity in a line or two on the log."""
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
