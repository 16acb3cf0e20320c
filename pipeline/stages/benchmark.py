"""Stage benchmark: every variant of the model on the same images, one run, and the run's summary.

``python -m pipeline stage=benchmark`` compares the shipped torch model (full-prefix decoder), the
same model with the KV cache, and every exported ONNX Runtime package in ``benchmark.packages``
(label -> package folder or export stage name; by default the packages that exist among
``export-ort_cpu``, the chain's deployable one, ``export-ort_cpu-float-original``,
``export-ort_cpu-float-chain``, the chain's model in float, and ``export-ort_cpu-int8-original``, the
original model quantized with the chain's plan). For each:
exact match and CER, identical greedy tokens vs the shipped model, p50/p95 latency at batch 1 (images
interleaved across variants), images/s at batch 8, peak resident memory (a fresh process each), size
on disk, and the ratio to the shipped model. Plus the serving test (concurrent clients sharing one
package's sessions) and a Pareto plot. Writes ``<artifacts>/summary.md`` and ``summary.json`` with the
table and a link to every stage's report. Ratios are printed and reported, never asserted.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from pipeline.benchmarking import measure, passes, report, rows, summary
from pipeline.benchmarking.variants import (PACKAGE, TORCH, TORCH_KV, Lineup, package_variant, resolve_packages,
                                            torch_variant, with_greedy_twins)
from pipeline import files
from pipeline.adapters.base import ModelAdapter
from pipeline.context import StageContext, file_hash
from pipeline.data.corpus import Split, check_splits
from pipeline.data.render import render_inputs
from pipeline.errors import PipelineError
from pipeline.names import DEPLOYABLE, FLOAT_BASELINE, FLOAT_CHAIN, INT8_ORIGINAL, MANIFEST
from pipeline.reports import Phases

NAME = "benchmark"
CONFIG_KEY = "benchmark"
log = logging.getLogger(__name__)

# label -> export stage name: benchmarked when they exist (all but the first: export.baselines=true). The
# deployable package and the chain's baselines are a sweep job's own (name + the job's tag); the
# original model in float is one for every job
DEFAULT_PACKAGES = {"deployable": DEPLOYABLE, "float-original": FLOAT_BASELINE, "float-chain": FLOAT_CHAIN,
                    "int8-original": INT8_ORIGINAL}
SHARED_PACKAGES = ("float-original",)
BASELINE_LABEL = "float-original"  # the speculative check times it in the same turn (the deployable's session options)
# the same package as users ran it before this project flushed denormals: ONNX Runtime's plain sessions
PLAIN_BASELINE_LABEL = "float-original (plain ORT)"
# the comparison rows stage=all leaves out, and what makes them (preset=thorough sets both)
COMPARISONS = {"float-chain": "export.chain_baseline=true", "int8-original": "quantize.original=true"}


@dataclass
class BenchmarkConfig:
    model: str = "original"          # the shipped torch model every ratio is against (a stage, a folder)
    packages: Dict[str, str] = field(default_factory=dict)  # label -> package folder or export stage name
    default_packages: bool = True    # also the DEFAULT_PACKAGES that exist (missing ones are skipped)
    serve: str = "deployable"        # the package label the serving test runs on (else the first package)
    split: Split = Split.eval        # corpus split the formulas come from ...
    formulas: Optional[str] = None   # ... or a file, one LaTeX formula per line
    # more corpus splits the packages also read (exact match and CER only, the table's last columns;
    # the original model's reading there is its float package's): formulas from sources training never saw
    extra_splits: List[Split] = field(default_factory=lambda: [Split.shift])
    eval_limit: Optional[int] = None  # formulas read for exact match / CER; null = all of them
    full_prefix_limit: int = 8       # the full-prefix decoder is slow (2-7 s a formula): its accuracy on the first N
    torch_limit: Optional[int] = 64  # the KV-cached torch model (~2 s a formula at 1 thread) reads the first N;
                                     # null = all. Identical tokens and Δ points compare on the formulas both read
    samples: int = 8                 # images timed at batch 1, per variant
    warmup: int = 1                  # untimed images first (session and allocator warm-up)
    batch_size: int = 8              # batch of the accuracy and timing passes (images/s)
    threads: int = 1                 # torch and ONNX Runtime intra-op threads (same for every variant)
    clients: int = 4                 # serving test: concurrent clients ...
    requests: int = 8                # ... each sending this many batch-1 requests
    workers: int = 2                 # threads the packages' passes share (each package's images cut into this many
                                     # runs of whole batches); > 1: images/s and ms per formula from a quiet pass ...
    timing_images: int = 64          # ... on the first N images, one package at a time
    memory: bool = True              # peak resident memory, one fresh process per variant
    memory_images: int = 8           # images that process reads (one batch)
    greedy_rows: bool = True         # a package that decodes speculatively at batch 1 (it has a drafter) also as
                                     # "<label> (greedy)": the same package, plain greedy (infer.speculative=false)
    speculative_limit: Optional[int] = None  # formulas per split of the speculative check (batch 1: identical to
                                     # greedy? decoder calls and ms; end-to-end ms against the float-original
                                     # package read in the same turn); null = every formula of each split
    plain_baseline: bool = True      # float-original also as users ran it before (ONNX Runtime's plain sessions,
                                     # denormals not flushed): "float-original (plain ORT)"
    summary: bool = True             # write <artifacts>/summary.md and summary.json
    name: Optional[str] = None       # artifact folder; default "benchmark" (+ the job's tag in a multirun)


Config = BenchmarkConfig


def validate(cfg: BenchmarkConfig) -> None:
    for key in ("full_prefix_limit", "samples", "batch_size", "threads", "clients", "requests", "memory_images",
                "workers", "timing_images"):
        if getattr(cfg, key) < 1:
            raise PipelineError(f"benchmark.{key} must be >= 1, got {getattr(cfg, key)}")
    if cfg.warmup < 0:
        raise PipelineError(f"benchmark.warmup must be >= 0, got {cfg.warmup}")
    if not cfg.formulas:
        check_splits("benchmark.split", cfg.split)
    check_splits("benchmark.extra_splits", cfg.extra_splits)
    if cfg.split in cfg.extra_splits or len(set(cfg.extra_splits)) != len(cfg.extra_splits):
        raise PipelineError(f"benchmark.extra_splits={list(cfg.extra_splits)}: each split once, and not the "
                            f"benchmark's own split {cfg.split!r}")
    for key in ("eval_limit", "torch_limit", "speculative_limit"):
        if getattr(cfg, key) is not None and getattr(cfg, key) < 1:
            raise PipelineError(f"benchmark.{key} must be >= 1 or null, got {getattr(cfg, key)}")


def _formulas(cfg: BenchmarkConfig, ctx: StageContext) -> tuple[list[str], dict[str, list[str]], dict[str, str]]:
    """The formulas of the benchmark, those of each extra split (none with a formulas file), input hashes."""
    if cfg.formulas:
        path = Path(cfg.formulas)
        return [ln for _, ln in files.read_formulas(path, "benchmark.formulas")], {}, {"formulas": file_hash(path)}
    extra = {name: [f.latex for f in ctx.split(name)] for name in cfg.extra_splits}
    return ([f.latex for f in ctx.split(cfg.split)], extra,
            {"corpus": ctx.split_hash(cfg.split), **{f"split:{n}": ctx.split_hash(n) for n in extra}})


def _render(adapter, formulas: list[str], limit: Optional[int], progress: bool) -> tuple[np.ndarray, list[str]]:
    items = render_inputs([(f"formula {i + 1}", latex) for i, latex in enumerate(formulas)],
                          lambda image: adapter.preprocess(image).numpy(), limit, progress, "benchmark")
    if not items:
        raise PipelineError("no benchmark formula could be rendered")
    return np.stack([t for _, _, t in items]).astype(np.float32), [latex for _, latex, _ in items]


def _default_folder(ctx: StageContext, label: str, ref: str) -> Path:
    """Where a default package is for this run: a sweep job that overrides chain keys reads its own
    or none (a missing default is skipped), never a shared one made without its overrides."""
    if label in SHARED_PACKAGES:
        return ctx.artifacts_dir / ref
    own = ctx.artifacts_dir / ctx.artifact_name(ref, stage="export")
    return own if (own / MANIFEST).is_file() or ctx.job_overrides("export") else ctx.artifacts_dir / ref


def run(cfg: BenchmarkConfig, ctx: StageContext) -> dict:
    validate(cfg)
    # a sweep job's own packages (export-ort_cpu-<job tag>); outside a sweep, or for a job that overrides
    # no chain key, the shared ones
    defaults = {label: str(_default_folder(ctx, label, ref)) for label, ref in DEFAULT_PACKAGES.items()} \
        if cfg.default_packages else {}
    folders, notes = resolve_packages(dict(cfg.packages), defaults, ctx.artifacts_dir, COMPARISONS)
    for note in notes:
        log.info(f"[benchmark] {note}")
    max_length = ctx.limits.max_length
    formulas, extra, inputs = _formulas(cfg, ctx)
    inputs["model"] = ctx.model_hash(cfg.model)
    inputs.update({f"package:{label}": file_hash(folder) for label, folder in folders.items()})
    evaluated = _evaluate_note(ctx, cfg.model, max_length)
    if evaluated:
        inputs["evaluate"] = evaluated[0]
        notes.append(evaluated[1])
    config = {**asdict(cfg), "max_length": max_length, **ctx.decoding_key(), "packages_resolved": {k: str(v) for k, v in folders.items()}}
    with ctx.output(ctx.artifact_name("benchmark", cfg.name), config, inputs) as out:
        if out.reused:
            log.info(f"[benchmark] unchanged, reused {out.path}")
        else:
            out.metrics.update(_measure(cfg, ctx, folders, formulas, extra, max_length, notes, out.path))
    metrics = out.metrics
    if cfg.summary and ctx.job_tag("benchmark") is not None:  # one job of a sweep: no run summary (the jobs would race)
        log.info("[benchmark] a sweep job writes no artifacts/summary.md; collect the sweep's packages in one "
                 "benchmark: stage=benchmark '+benchmark.packages.sweep=export-ort_cpu-*'")
    elif cfg.summary:
        md, _ = summary.write_summary(ctx.artifacts_dir, out.path, metrics)
        log.info(f"[benchmark] summary: {md}")
    _print_summary(metrics)
    return out.manifest


def _measure(cfg: BenchmarkConfig, ctx: StageContext, folders: dict[str, Path], formulas: list[str],
             extra: dict[str, list[str]], max_length: int, notes: list[str], folder: Path) -> dict:
    """Every variant on the same images, phase by phase (each phase's seconds reported), then the rows
    and the artifacts."""
    torch.set_num_threads(int(cfg.threads))
    phases = Phases()  # where the stage's minutes go, reported per phase
    adapter = ctx.load_model(cfg.model)
    images, truths = _render(adapter, formulas, cfg.eval_limit, ctx.progress)
    phases.lap("load and render")
    lineup = _lineup(cfg, ctx, adapter, folders, notes)
    main = passes.SplitReading(images, truths, _accuracy(cfg, ctx, lineup, images, truths, max_length, notes,
                                                         phases.lap))
    other = _other_splits(cfg, ctx, adapter, lineup, extra, max_length, notes)
    if other:
        phases.lap("other splits")
    split_images = {cfg.split if not cfg.formulas else "formulas": images, **{n: s.images for n, s in other.items()}}
    spec = passes.speculative_check(lineup, split_images, max_length, cfg.speculative_limit, BASELINE_LABEL,
                                    ctx.progress)
    if spec:
        phases.lap("speculative check")
    notes += _limit_notes(lineup, main)
    notes += [n for n in [rows.twin_note(main.reads, BASELINE_LABEL, PLAIN_BASELINE_LABEL,
                                         "denormals flushed to zero (model.flush_denormals)")] if n]
    latency = _latency(cfg, ctx, lineup, images, max_length, notes)
    phases.lap("latency")
    serving = _serving(cfg, lineup, images, max_length, notes)
    phases.lap("serving")
    memory = passes.peak_memories(lineup.variants, images[:cfg.memory_images], max_length, cfg.batch_size,
                                  int(cfg.threads), cfg.workers, ctx.progress) if cfg.memory else {}
    phases.lap("peak memory")
    table, table_notes = rows.table(lineup, adapter, main.reads, {n: s.reads for n, s in other.items()}, latency,
                                    memory, images)
    notes += table_notes
    source = f"file {cfg.formulas}" if cfg.formulas else f"corpus split '{cfg.split}'"
    metrics = {"shipped": lineup.shipped.label, "reference": lineup.reference.label, "n_formulas": len(truths),
               "source": source, "max_length": max_length, "threads": int(cfg.threads), "batch_size": cfg.batch_size,
               "latency_images": latency[lineup.shipped.label]["n"], "extra_splits": list(other), "variants": table,
               "serving": serving, "notes": notes, "speculative": spec, "phase_seconds": phases.seconds,
               "machine": summary.machine()}
    report.write_artifacts(folder, metrics, main, other, lineup.sharing, BASELINE_LABEL)
    return metrics


def _lineup(cfg: BenchmarkConfig, ctx: StageContext, adapter: ModelAdapter, folders: dict[str, Path],
            notes: list[str]) -> Lineup:
    """The shipped torch model, the same with the KV cache (where its family has one), every package,
    and (benchmark.greedy_rows) each speculative package's plain greedy twin."""
    family, trust = str(ctx.cfg.model.adapter), bool(ctx.cfg.model.trust_checkpoint)
    source = ctx.model_source(cfg.model)
    name = Path(cfg.model).name
    variants = [torch_variant(f"torch {name}", adapter, cfg.model, source, family, use_cache=False,
                              trust_checkpoint=trust, device=ctx.device)]
    if adapter.cached_decoder() is not None:
        variants.append(torch_variant(f"torch {name} + KV cache", adapter, cfg.model, source, family,
                                      use_cache=True, trust_checkpoint=trust, device=ctx.device))
    else:
        notes.append(f"model family {family!r} has no KV-cached torch decoder: that variant is left out")
    variants += [package_variant(label, f, int(cfg.threads)) for label, f in folders.items()]
    if BASELINE_LABEL in folders and cfg.plain_baseline and ctx.limits.flush_denormals:
        # what a flag did, apart from what compression did: float-original twice, with and without it
        variants.append(package_variant(PLAIN_BASELINE_LABEL, folders[BASELINE_LABEL], int(cfg.threads),
                                        flush_denormals=False))
    if cfg.greedy_rows:
        return with_greedy_twins(variants, int(cfg.threads))
    fast = [v.label for v in variants if v.package is not None and v.package.speculative]
    if fast:  # the check reads each against its greedy twin
        notes.append(f"benchmark.greedy_rows=false: no speculative check of {', '.join(fast)} (it reads each "
                     f"against its plain greedy twin)")
        log.warning(f"[benchmark] {notes[-1]}")
    return Lineup(variants)


def _accuracy(cfg: BenchmarkConfig, ctx: StageContext, lineup: Lineup, images: np.ndarray, truths: list[str],
              max_length: int, notes: list[str], lap: Callable[[str], None]) -> dict[str, dict]:
    """Accuracy and images/s, one batched pass each (phases "accuracy", then "timing" where the packages
    read side by side); the torch decoders are slow: they read the first full_prefix_limit / torch_limit."""
    limits = {TORCH: cfg.full_prefix_limit, TORCH_KV: cfg.torch_limit}
    reads, together = passes.read_accuracy(lineup, images, truths, max_length, cfg.batch_size, cfg.workers, limits,
                                           ctx.progress)
    lap("accuracy")
    if together:
        k = passes.time_quietly(together, reads, images, cfg.timing_images, max_length, cfg.batch_size)
        notes.append(f"the packages read the split {cfg.workers} at a time (benchmark.workers); their images/s and "
                     f"encoder / decoder ms per formula come from a second pass on the first {k} images, one "
                     f"package at a time")
        lap("timing")
    passes.share_with_twins(reads, lineup.sharing)
    if lineup.sharing:
        twins = lineup.sharing
        notes.append(f"{', '.join(twins)}: the same package{'s' if len(twins) > 1 else ''} decoding plain greedy at "
                     f"batch 1 (benchmark.greedy_rows); batched passes decode greedy in both rows: the accuracy, "
                     f"images/s and batched ms are the speculative row's")
    own = [label for label in lineup.twins if label not in lineup.sharing]
    if own:
        notes.append(f"{', '.join(own)}: the same package{'s' if len(own) > 1 else ''} decoding plain greedy, "
                     f"batches in greedy steps (benchmark.greedy_rows); the speculative row reads a batch image by "
                     f"image speculatively (package.json: speculative_batches, its target's): the accuracy, "
                     f"images/s and batched ms of each row are its own")
    return reads


def _other_splits(cfg: BenchmarkConfig, ctx: StageContext, adapter: ModelAdapter, lineup: Lineup,
                  extra: dict[str, list[str]], max_length: int, notes: list[str]) -> dict[str, passes.SplitReading]:
    """The packages' readings of each of benchmark.extra_splits (rendered here)."""
    other = {}
    for name, split_formulas in extra.items():
        images, truths = _render(adapter, split_formulas, cfg.eval_limit, ctx.progress)
        other[name] = passes.read_split(lineup, name, images, truths, max_length, cfg.batch_size, cfg.workers,
                                        ctx.progress)
    if other:
        notes.append(f"split(s) {', '.join(other)}: the packages only (exact match and CER); the original model's "
                     f"reading there is its float package's (token-identical to torch in export's parity check)")
    return other


def _limit_notes(lineup: Lineup, main: passes.SplitReading) -> list[str]:
    """Which torch variants read fewer formulas than the rest, and what the comparisons then cover."""
    notes, n = [], len(main.truths)
    for v in lineup.variants[:2]:
        if main.reads[v.label]["n"] < n:
            key = "full_prefix_limit" if v.kind == TORCH else "torch_limit"
            notes.append(f"{v.label} read the first {main.reads[v.label]['n']} of {n} formulas (benchmark.{key})")
    reference = main.reads[lineup.reference.label]
    if reference["n"] < n:
        notes.append(f"identical tokens and Δ points compare each variant with {reference['n']} formulas of the "
                     f"reference at most (the ones both read)")
    return notes


def _latency(cfg: BenchmarkConfig, ctx: StageContext, lineup: Lineup, images: np.ndarray, max_length: int,
             notes: list[str]) -> dict[str, dict]:
    """Batch-1 latency, benchmark.samples images after benchmark.warmup untimed ones."""
    if len(images) < cfg.samples + cfg.warmup:
        notes.append(f"latency on {len(images) - cfg.warmup} images: only {len(images)} rendered")
    return passes.latency(lineup.variants, images, cfg.samples, cfg.warmup, max_length, ctx.progress)


def _serving(cfg: BenchmarkConfig, lineup: Lineup, images: np.ndarray, max_length: int,
             notes: list[str]) -> Optional[dict]:
    """The serving test on the package labelled benchmark.serve, else on the first; None without one."""
    serving = None
    packages = [v for v in lineup.variants if v.kind == PACKAGE]
    if packages:
        target = next((v for v in packages if v.label == cfg.serve), packages[0])
        if target.label != cfg.serve:
            notes.append(f"no package labelled {cfg.serve!r} (benchmark.serve): the serving test ran on "
                         f"{target.label!r}")
        serving = {"label": target.label, **measure.serve(target.decode, images, max_length, cfg.clients,
                                                          cfg.requests)}
    else:
        notes.append("no exported package: no serving test")
    return serving


def _evaluate_note(ctx: StageContext, model: str, max_length: int) -> Optional[tuple[str, str]]:
    """(manifest key, a line) of stage evaluate's reading of the same model at the same cap, if any:
    the shipped model's accuracy on its whole source, beside the benchmark's subset."""
    path = ctx.artifacts_dir / "evaluate" / MANIFEST
    if model not in ("original", "package") or not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        m, c = manifest["metrics"], manifest["config"]
    except (json.JSONDecodeError, OSError, KeyError):
        return None
    if c.get("model") not in ("original", "package") or int(c.get("max_length", -1)) != max_length:
        return None
    decoder = "KV-cached decoding (the same tokens as the full prefix)" if m.get("kv_cache") else "full-prefix decoding"
    return manifest.get("key", ""), (f"stage evaluate ({m.get('source')}, n={m.get('n')}, {decoder}): the shipped "
                                     f"model's exact match {m.get('exact_match', 0):.3f}, CER {m.get('cer', 0):.3f}")


def _print_summary(m: dict) -> None:
    log.info(f"[benchmark] {m['n_formulas']} formulas, cap {m['max_length']}, {m['threads']} thread(s); "
             f"ratios vs {m['shipped']}:")
    log.info(summary.table(m["variants"]))
    s = m.get("serving")
    if s:
        log.info(f"[benchmark] serving {s['label']}: {s['clients']} clients x {s['requests_per_client']} requests: "
                 f"mean {s['mean_ms']:.0f} ms, p50 {s['p50_ms']:.0f} ms, p95 {s['p95_ms']:.0f} ms, "
                 f"{s['requests_per_s']:.2f} requests/s")
