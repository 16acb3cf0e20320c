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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
from tqdm import tqdm

from pipeline.benchmarking import measure, summary
from pipeline.benchmarking.variants import (PACKAGE, TORCH, TORCH_KV, Variant, package_variant, resolve_packages,
                                            torch_variant)
from pipeline import files
from pipeline.context import StageContext, file_hash
from pipeline.data.render import render_inputs
from pipeline.errors import PipelineError
from pipeline.names import DEPLOYABLE, FLOAT_BASELINE, FLOAT_CHAIN, INT8_ORIGINAL
from pipeline.reports import Phases, markdown_table

NAME = "benchmark"
CONFIG_KEY = "benchmark"
log = logging.getLogger(__name__)

# label -> export stage name: benchmarked when they exist (all but the first: export.baselines=true). The
# deployable package and the chain's baselines are a sweep job's own (name + the job's tag); the
# original model in float is one for every job
DEFAULT_PACKAGES = {"deployable": DEPLOYABLE, "float-original": FLOAT_BASELINE, "float-chain": FLOAT_CHAIN,
                    "int8-original": INT8_ORIGINAL}
SHARED_PACKAGES = ("float-original",)
BASELINE_LABEL = "float-original"  # the speculative check times it in the same turn (what a user has today)
# the comparison rows stage=all leaves out, and what makes them (preset=thorough sets both)
COMPARISONS = {"float-chain": "export.chain_baseline=true", "int8-original": "quantize.original=true"}


@dataclass
class BenchmarkConfig:
    model: str = "original"          # the shipped torch model every ratio is against (a stage, a folder)
    packages: Dict[str, str] = field(default_factory=dict)  # label -> package folder or export stage name
    default_packages: bool = True    # also the DEFAULT_PACKAGES that exist (missing ones are skipped)
    serve: str = "deployable"        # the package label the serving test runs on (else the first package)
    split: str = "eval"              # corpus split the formulas come from ...
    formulas: Optional[str] = None   # ... or a file, one LaTeX formula per line
    # more corpus splits the packages also read (exact match and CER only, the table's last columns;
    # the original model's reading there is its float package's): formulas from sources training never saw
    extra_splits: List[str] = field(default_factory=lambda: ["shift"])
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
    return own if (own / "manifest.json").is_file() or ctx.job_overrides("export") else ctx.artifacts_dir / ref


def run(cfg: BenchmarkConfig, ctx: StageContext) -> dict:
    validate(cfg)
    # a sweep job's own packages (export-ort_cpu-<job tag>); outside a sweep, or for a job that overrides
    # no chain key, the shared ones
    defaults = {label: str(_default_folder(ctx, label, ref)) for label, ref in DEFAULT_PACKAGES.items()} \
        if cfg.default_packages else {}
    folders, notes = resolve_packages(dict(cfg.packages), defaults, ctx.artifacts_dir, COMPARISONS)
    for note in notes:
        log.info(f"[benchmark] {note}")
    max_length = int(ctx.cfg.model.max_length)
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
    threads = int(cfg.threads)
    torch.set_num_threads(threads)
    phases = Phases()  # where the stage's minutes go, reported per phase
    lap = phases.lap

    adapter = ctx.load_model(cfg.model)
    images, truths = _render(adapter, formulas, cfg.eval_limit, ctx.progress)
    lap("load and render")
    family, trust = str(ctx.cfg.model.adapter), bool(ctx.cfg.model.trust_checkpoint)
    model_folder = ctx.model_folder(cfg.model)
    source = "package" if model_folder is None else str(model_folder)
    shipped = torch_variant(f"torch {Path(cfg.model).name}", adapter, cfg.model, source, family, use_cache=False,
                            trust_checkpoint=trust, device=ctx.device)
    variants: list[Variant] = [shipped]
    if adapter.cached_decoder() is not None:
        variants.append(torch_variant(f"torch {Path(cfg.model).name} + KV cache", adapter, cfg.model, source, family,
                                      use_cache=True, trust_checkpoint=trust, device=ctx.device))
    else:
        notes.append(f"model family {family!r} has no KV-cached torch decoder: that variant is left out")
    variants += [package_variant(label, f, threads) for label, f in folders.items()]
    # the same package decoding plain greedy at batch 1: its batched passes are the speculative row's own
    # (batches of more than one image decode greedy in both), so it shares that row's accuracy reading
    twins = {f"{v.label} (greedy)": v for v in variants if v.package is not None and v.package.speculative} \
        if cfg.greedy_rows else {}
    variants += [package_variant(label, Path(v.location), threads, speculative=False) for label, v in twins.items()]

    # accuracy + images/s: one batched pass each; the torch decoders are slow, so they read the first
    # full_prefix_limit / torch_limit images (the KV-cached one gives the full prefix's tokens)
    limits = {TORCH: cfg.full_prefix_limit, TORCH_KV: cfg.torch_limit}
    reads = {}
    bar = tqdm(total=len(variants), desc="accuracy", disable=not ctx.progress)
    packages = [v for v in variants if v.kind == PACKAGE and v.label not in twins]
    together = packages if cfg.workers > 1 and len(packages) > 1 else []
    for v in variants:  # the torch variants (and every variant with workers=1): alone on the machine
        if v not in together and v.label not in twins:
            k = min(limits.get(v.kind) or len(truths), len(truths))
            reads[v.label] = measure.accuracy(v, images[:k], truths[:k], max_length, cfg.batch_size)
            bar.update()
    if together:  # the packages' whole-split passes side by side, then their timing again, quietly
        reads.update(measure.accuracy_parallel(together, images, truths, max_length, cfg.batch_size, cfg.workers,
                                               bar.update))
        lap("accuracy")
        k = min(cfg.timing_images, len(images))
        for v in together:
            reads[v.label].update(measure.timing(v, images[:k], max_length, cfg.batch_size))
        notes.append(f"the packages read the split {cfg.workers} at a time (benchmark.workers); their images/s and "
                     f"encoder / decoder ms per formula come from a second pass on the first {k} images, one "
                     f"package at a time")
        lap("timing")
    else:
        lap("accuracy")
    bar.close()
    for label, v in twins.items():
        reads[label] = reads[v.label]
    if twins:
        notes.append(f"{', '.join(twins)}: the same package{'s' if len(twins) > 1 else ''} decoding plain greedy at "
                     f"batch 1 (benchmark.greedy_rows); batched passes decode greedy in both rows: the accuracy, "
                     f"images/s and batched ms are the speculative row's")
    other = {}  # split -> label -> reading: the packages only (the torch variants read the main split)
    other_truths: dict[str, list[str]] = {}
    split_images = {cfg.split if not cfg.formulas else "formulas": images}
    for name, split_formulas in extra.items():
        x_images, x_truths = _render(adapter, split_formulas, cfg.eval_limit, ctx.progress)
        other_truths[name] = x_truths
        split_images[name] = x_images
        bar = tqdm(total=len(packages), desc=f"accuracy ({name})", disable=not ctx.progress)
        other[name] = measure.accuracy_parallel(packages, x_images, x_truths, max_length, cfg.batch_size,
                                                cfg.workers, bar.update)
        bar.close()
    if other:
        for name, r2 in other.items():
            for label, v in twins.items():
                r2[label] = r2[v.label]
        notes.append(f"split(s) {', '.join(other)}: the packages only (exact match and CER); the original model's "
                     f"reading there is its float package's (token-identical to torch in export's parity check)")
        lap("other splits")
    spec = _speculative(cfg, ctx, twins, variants, split_images, max_length)
    if spec:
        lap("speculative check")
    reference = reads[variants[1].label] if len(variants) > 1 and variants[1].kind == TORCH_KV else reads[shipped.label]
    for v in variants[:2]:
        if reads[v.label]["n"] < len(truths):
            key = "full_prefix_limit" if v.kind == TORCH else "torch_limit"
            notes.append(f"{v.label} read the first {reads[v.label]['n']} of {len(truths)} formulas (benchmark.{key})")
    if reference["n"] < len(truths):
        notes.append(f"identical tokens and Δ points compare each variant with {reference['n']} formulas of the "
                     f"reference at most (the ones both read)")

    need = cfg.samples + cfg.warmup
    if len(images) < need:
        notes.append(f"latency on {len(images) - cfg.warmup} images: only {len(images)} rendered")
    lat_images = images[:need] if len(images) > cfg.warmup else images[:1].repeat(cfg.warmup + 1, axis=0)
    bar = tqdm(total=len(lat_images) - cfg.warmup, desc="latency batch 1", disable=not ctx.progress)
    lat = measure.latency(variants, lat_images, max_length, cfg.warmup, progress=bar.update)
    bar.close()
    lap("latency")

    serving = None
    pkgs = [v for v in variants if v.kind == PACKAGE]
    if pkgs:
        target = next((v for v in pkgs if v.label == cfg.serve), pkgs[0])
        if target.label != cfg.serve:
            notes.append(f"no package labelled {cfg.serve!r} (benchmark.serve): the serving test ran on {target.label!r}")
        serving = {"label": target.label, **measure.serve(target.decode, images, max_length, cfg.clients,
                                                          cfg.requests)}
    else:
        notes.append("no exported package: no serving test")
    lap("serving")

    memory = {}
    if cfg.memory:
        mem_images = images[:cfg.memory_images]
        # one fresh process per variant, `workers` at a time: a process's own peak does not depend on its neighbour
        with ThreadPoolExecutor(max_workers=cfg.workers) as pool:
            futures = {v.label: pool.submit(measure.peak_memory, v.spec, mem_images, max_length, cfg.batch_size,
                                            threads) for v in variants}
            for label, future in tqdm(futures.items(), desc="peak memory", disable=not ctx.progress):
                memory[label] = future.result()
    lap("peak memory")

    reference_label = next(v.label for v in variants if reads[v.label] is reference)
    caps = {v.label: (v.package.layout_run_cap if v.package is not None else adapter.layout_run_cap) for v in variants}
    if len(set(caps.values())) > 1:  # a package decodes with the cap it was exported with
        notes.append("the variants decode with different layout-run caps (package.json: layout_run_cap; "
                     "0 = none, a package exported before the cap): "
                     + ", ".join(f"{label} {cap}" for label, cap in caps.items()))
    vocabulary = {v.label: _vocabulary(v, adapter) for v in variants}
    other_vocabulary = [v.label for v in variants if vocabulary[v.label] != vocabulary[reference_label]]
    if other_vocabulary:
        notes.append(f"identical tokens: – for {', '.join(other_vocabulary)}, whose decoder speaks another "
                     f"vocabulary ({vocabulary[other_vocabulary[0]]}) than the reference's "
                     f"({vocabulary[reference_label]}): their token ids cannot be compared")
    rows = []
    for v in variants:
        r = reads[v.label]
        both = min(r["n"], reference["n"])
        same_ids = vocabulary[v.label] == vocabulary[reference_label]
        row = {"label": v.label, "kind": v.kind, "location": v.location, "exact_match": r["exact_match"],
               "cer": r["cer"], "accuracy_n": r["n"], "hit_cap_share": r["hit_cap_share"],
               "steps_per_formula": r["steps_per_formula"], "encoder_ms_per_formula": r["encoder_ms_per_formula"],
               "decoder_ms_per_formula": r["decoder_ms_per_formula"],
               "accuracy_seconds": r["seconds"],
               "identical_tokens": (measure.identical_share(r["token_ids"][:both], reference["token_ids"][:both])
                                    if same_ids else None),
               "compared_n": both,
               "exact_match_points_vs_reference": 100 * (_subset_em(r, both) - _subset_em(reference, both)),
               "images_per_s": r["images_per_s"], "timed_n": r.get("timed_n", r["n"]), "batch_size": r["batch_size"],
               "latency": lat[v.label],
               "splits": {name: {"exact_match": r2[v.label]["exact_match"], "cer": r2[v.label]["cer"],
                                 "n": r2[v.label]["n"]} for name, r2 in other.items() if v.label in r2},
               "size_mb": v.size_bytes / 2**20, "peak_mb": memory.get(v.label, {}).get("peak_mb"),
               "base_mb": memory.get(v.label, {}).get("base_mb")}
        if v.package is not None:
            row["precision"] = v.package.meta.get("precision")
            row["model"] = _package_model(Path(v.location))
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["ratios"] = {
            "speedup_p50": base["latency"]["p50_ms"] / row["latency"]["p50_ms"],
            "speedup_p95": base["latency"]["p95_ms"] / row["latency"]["p95_ms"],
            "throughput": row["images_per_s"] / base["images_per_s"],
            "size": row["size_mb"] / base["size_mb"],
            "memory": (row["peak_mb"] / base["peak_mb"]) if row["peak_mb"] and base["peak_mb"] else None,
            "exact_match_points_vs_reference": row["exact_match_points_vs_reference"],
        }
    metrics = {"shipped": shipped.label, "reference": reference_label,
               "n_formulas": len(truths), "source": f"file {cfg.formulas}" if cfg.formulas else f"corpus split '{cfg.split}'",
               "max_length": max_length, "threads": threads, "batch_size": cfg.batch_size,
               "latency_images": lat[shipped.label]["n"], "extra_splits": list(other), "variants": rows, "serving": serving, "notes": notes,
               "speculative": spec,
               "phase_seconds": phases.seconds}
    (folder / "benchmark.json").write_text(json.dumps(metrics, indent=2) + "\n")
    with open(folder / "predictions.jsonl", "w", encoding="utf-8") as f:
        for i, truth in enumerate(truths):
            f.write(json.dumps({"truth": truth, **{v.label: reads[v.label]["texts"][i] for v in variants
                                                   if i < reads[v.label]["n"] and v.label not in twins}},
                               ensure_ascii=False) + "\n")
    for name, readings in other.items():  # the other splits' readings too: paired comparisons need them
        with open(folder / f"predictions-{name}.jsonl", "w", encoding="utf-8") as f:
            for i, truth in enumerate(other_truths[name]):
                f.write(json.dumps({"truth": truth, **{label: r["texts"][i] for label, r in readings.items()
                                                       if label not in twins}},
                                   ensure_ascii=False) + "\n")
    summary.pareto_plot(folder / "pareto.png", rows, f"{len(truths)} formulas, {threads} thread(s), "
                                                     f"cap {max_length}: images/s vs exact match")
    _write_report(folder, metrics)
    return metrics


def _speculative(cfg: BenchmarkConfig, ctx: StageContext, twins: dict[str, Variant], variants: list[Variant],
                 split_images: dict[str, np.ndarray], max_length: int) -> dict:
    """Each package with a drafter, speculative against its own plain greedy at batch 1, on every split."""
    out: dict[str, dict] = {}
    plain = {v.label: v for v in variants}
    baseline = plain.get(BASELINE_LABEL)
    for label, fast in twins.items():
        meta = fast.package.meta
        drafter = json.loads((Path(fast.location) / meta["drafter"]).read_text())
        out[fast.label] = {"drafter": drafter.get("kind"), "draft_len": drafter.get("draft_len"), "splits": {}}
        for split, imgs in split_images.items():
            k = len(imgs) if cfg.speculative_limit is None else min(cfg.speculative_limit, len(imgs))
            bar = tqdm(total=k, desc=f"speculative check {fast.label} ({split})", disable=not ctx.progress)
            out[fast.label]["splits"][split] = measure.speculative(
                fast, plain[label], imgs[:k], max_length, baseline if baseline is not fast else None, bar.update)
            bar.close()
    return out


def _evaluate_note(ctx: StageContext, model: str, max_length: int) -> Optional[tuple[str, str]]:
    """(manifest key, a line) of stage evaluate's reading of the same model at the same cap, if any:
    the shipped model's accuracy on its whole source, beside the benchmark's subset."""
    path = ctx.artifacts_dir / "evaluate" / "manifest.json"
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


def _subset_em(reading: dict, n: int) -> float:
    """Exact match of a reading on its first ``n`` formulas (where two readings overlap)."""
    return float(np.mean(reading["exact"][:n])) if n else 0.0


def _vocabulary(v: Variant, adapter) -> str:
    """What a variant's token ids index: the char vocabulary or distill's BPE, and its size (a
    package says which in ``package.json``; the torch variants run the benchmark's model)."""
    from pipeline.tokenization.bpe import BpeTokenizer

    if v.package is not None:
        tok = v.package.tokenizer
        kind = (v.package.meta.get("tokenizer") or {}).get("kind") or ("bpe" if isinstance(tok, BpeTokenizer) else "char")
        size = tok.vocab_size if isinstance(tok, BpeTokenizer) else len(tok.id_to_token)
    else:
        kind = "bpe" if isinstance(getattr(adapter, "tokenizer", None), BpeTokenizer) else "char"
        size = adapter.vocab_size
    return f"{kind}, {size} entries"


def _package_model(folder: Path) -> Optional[str]:
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        return None
    try:
        return json.loads(manifest.read_text()).get("config", {}).get("model_ref")
    except (json.JSONDecodeError, OSError):
        return None


def _write_report(folder: Path, m: dict) -> None:
    lines = [f"# Benchmark: {len(m['variants'])} variants, same images, one run", "",
             f"{m['n_formulas']} formulas from the {m['source']}, decode cap {m['max_length']} (BOS included), "
             f"{m['threads']} intra-op thread(s) for torch and ONNX Runtime alike. Exact match and CER from one "
             f"batched greedy pass (batch {m['batch_size']}). images/s: the wall time of a batched pass with "
             f"nothing else running (the torch variants' accuracy pass; for the packages, the pass on their first "
             f"images when they read the split side by side: see Notes). Latency: batch 1, {m['latency_images']} images, each read by every variant in turn so "
             f"all see the same load. Identical tokens, and Δ points (exact match minus the reference's on "
             f"the same formulas): vs `{m['reference']}`. Peak RSS: a "
             f"fresh process per variant that loads it and reads one batch (includes the interpreter and "
             f"its libraries). Ratios against `{m['shipped']}`; wall-clock numbers on a shared machine: "
             f"compare ratios within one run.", "", summary.table(m["variants"]), "", "![Pareto](pareto.png)", ""]
    if m["serving"]:
        lines += ["## Serving", "", f"{m['serving']['clients']} concurrent clients (threads) x "
                  f"{m['serving']['requests_per_client']} batch-1 requests each against one in-process package "
                  "(the threads share its ONNX Runtime sessions):", "", summary.serving_table(m["serving"]), ""]
    lines += ["## Decoding", "", f"Batch {m['batch_size']}; finished rows leave the batch. Decoder steps per "
              "formula (EOS included) and the share stopped by the cap from the accuracy pass (n); the encoder's "
              "and decoder's milliseconds per formula from the quiet pass that gives images/s (timed n); the "
              "encoder's at batch 1: the median over the latency reads (the p50 column's reads).", "",
              markdown_table(["variant", "n", "steps / formula", "stopped at cap", "timed n", "encoder ms / formula",
                              "decoder ms / formula", "encoder p50 ms, batch 1"],
                             [[v["label"], v["accuracy_n"], f"{v.get('steps_per_formula', 0):.1f}",
                               f"{v['hit_cap_share']:.3f}", v.get("timed_n", v["accuracy_n"]),
                               f"{v.get('encoder_ms_per_formula', 0):.1f}",
                               f"{v.get('decoder_ms_per_formula', 0):.1f}",
                               f"{v['latency']['encoder_p50_ms']:.1f}" if "encoder_p50_ms" in v["latency"] else "–"]
                              for v in m["variants"]]), ""]
    if m.get("speculative"):
        lines += ["## Speculative decoding", "", "Each package with a drafter reads every split at batch 1 twice, "
                  "image by image in turn: speculatively (its drafter proposes, `decoder_verify` checks the drafts "
                  "in one call) and plain greedy (`decoder_step`, one call a token). Identical: the share of "
                  "formulas whose tokens are the same in both (1 up to near-ties: the verify graph rounds unlike the step, docs/export.md). Decoder calls include the "
                  "first; decoder ms per formula from the same reads. End to end: a formula's whole reading "
                  f"(preprocessed image in, tokens out) at batch 1, mean ms, with `{BASELINE_LABEL}` (plain greedy) "
                  "read in the same turn where it is benchmarked.", "",
                  markdown_table(["package", "drafter", "split", "n", "identical", "decoder calls / formula",
                                  "greedy calls / formula", "calls ratio", "accepted / verify call",
                                  "decoder ms / formula", "greedy decoder ms", "decoder ms ratio"],
                                 [[label, f"{s['drafter']} (k={s['draft_len']})", split, r["n"],
                                   f"{r['identical']:.3f}", f"{r['calls_per_formula']:.1f}",
                                   f"{r['greedy_calls_per_formula']:.1f}",
                                   f"{r['greedy_calls_per_formula'] / max(r['calls_per_formula'], 1e-9):.2f}x",
                                   f"{r['accepted_per_verify']:.2f}", f"{r['decoder_ms_per_formula']:.1f}",
                                   f"{r['greedy_decoder_ms_per_formula']:.1f}",
                                   f"{r['greedy_decoder_ms_per_formula'] / max(r['decoder_ms_per_formula'], 1e-9):.2f}x"]
                                  for label, s in m["speculative"].items() for split, r in s["splits"].items()]), "",
                  markdown_table(["package", "split", "n", "end-to-end ms", "greedy end-to-end ms",
                                  f"{BASELINE_LABEL} ms", f"vs {BASELINE_LABEL}", "greedy vs " + BASELINE_LABEL],
                                 [[label, split, r["n"], f"{r['ms_per_formula']:.1f}",
                                   f"{r['greedy_ms_per_formula']:.1f}",
                                   f"{r['baseline_ms_per_formula']:.1f}" if "baseline" in r else "–",
                                   f"{r['baseline_ms_per_formula'] / r['ms_per_formula']:.2f}x" if "baseline" in r
                                   else "–",
                                   f"{r['baseline_ms_per_formula'] / r['greedy_ms_per_formula']:.2f}x"
                                   if "baseline" in r else "–"]
                                  for label, s in m["speculative"].items() for split, r in s["splits"].items()]), ""]
    lines += ["## Where each variant is", "",
              markdown_table(["variant", "kind", "location"], [[v["label"], v["kind"], f"`{v['location']}`"]
                                                                for v in m["variants"]]), ""]
    if m.get("phase_seconds"):
        per = ", ".join(f"{v['label']} {v['accuracy_seconds']:.0f} s" for v in m["variants"])
        lines += ["## Where the time went", "", ", ".join(f"{k} {v:.0f} s" for k, v in m["phase_seconds"].items())
                  + f" (accuracy by variant: {per}).", ""]
    if m["notes"]:
        lines += ["## Notes", ""] + [f"- {n}" for n in m["notes"]] + [""]
    (folder / "report.md").write_text("\n".join(lines))


def _print_summary(m: dict) -> None:
    log.info(f"[benchmark] {m['n_formulas']} formulas, cap {m['max_length']}, {m['threads']} thread(s); "
             f"ratios vs {m['shipped']}:")
    log.info(summary.table(m["variants"]))
    s = m.get("serving")
    if s:
        log.info(f"[benchmark] serving {s['label']}: {s['clients']} clients x {s['requests_per_client']} requests: "
                 f"mean {s['mean_ms']:.0f} ms, p50 {s['p50_ms']:.0f} ms, p95 {s['p95_ms']:.0f} ms, "
                 f"{s['requests_per_s']:.2f} requests/s")
