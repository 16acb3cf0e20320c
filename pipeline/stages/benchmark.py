"""Stage benchmark: per-image latency at batch 1, torch model vs exported package, same run.

``python -m pipeline stage=benchmark benchmark.package=export-ort_cpu`` times the torch model
(full-prefix decoder) and the package (ONNX Runtime, KV-cached decoder) on the same rendered
formulas, one image at a time, interleaved so both see the same machine load. Ratios are printed
and reported, never asserted. Where the adapter has a KV-cached torch decoder it is timed too.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from tqdm import tqdm

from pipeline.context import StageContext, file_hash
from pipeline.data.render import RenderError, render_formula
from pipeline.errors import PipelineError
from pipeline.export.runtime import PACKAGE_META, OnnxPackage
from pipeline.reports import markdown_table, plt, savefig

NAME = "benchmark"
CONFIG_KEY = "benchmark"


@dataclass
class BenchmarkConfig:
    package: str = "export-ort_cpu"   # exported package: a folder, or an export stage's name
    model: str = "original"          # the torch reference: original | a stage with a model | a folder
    split: str = "eval"              # corpus split the formulas come from ...
    formulas: Optional[str] = None   # ... or a file, one LaTeX formula per line
    samples: int = 8                 # images timed (batch 1)
    warmup: int = 1                  # untimed runs first (session and allocator warm-up)
    threads: int = 1                 # torch and ONNX Runtime intra-op threads (same for both)
    name: Optional[str] = None       # artifact folder; default benchmark-<package folder name>


Config = BenchmarkConfig


def _package_folder(ref: str, ctx: StageContext) -> Path:
    for cand in (Path(ref), ctx.artifacts_dir / ref):
        if (cand / PACKAGE_META).is_file():
            return cand
    raise PipelineError(f"benchmark.package={ref}: no exported package there (run stage=export first)")


def _formulas(cfg: BenchmarkConfig, ctx: StageContext) -> tuple[list[str], dict[str, str]]:
    if cfg.formulas:
        path = Path(cfg.formulas)
        if not path.is_file():
            raise PipelineError(f"benchmark.formulas: no such file {path}")
        return [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()], \
            {"formulas": file_hash(path)}
    return [f.latex for f in ctx.split(cfg.split)], {"corpus": ctx.split_hash(cfg.split)}


def run(cfg: BenchmarkConfig, ctx: StageContext) -> dict:
    if cfg.samples < 1:
        raise PipelineError(f"benchmark.samples must be >= 1, got {cfg.samples}")
    folder = _package_folder(cfg.package, ctx)
    max_length = int(ctx.cfg.model.max_length)
    adapter = ctx.load_model(cfg.model)
    formulas, inputs = _formulas(cfg, ctx)
    inputs.update({"model": ctx.model_hash(cfg.model), "package": file_hash(folder / PACKAGE_META)})
    name = cfg.name or f"benchmark-{folder.name}"
    config = {**asdict(cfg), "max_length": max_length}
    threads = max(1, int(cfg.threads))
    with ctx.output(name, config, inputs) as out:
        if out.reused:
            print(f"[benchmark] unchanged, reused {out.path}")
            _print_summary(out.metrics)
            return out.manifest
        torch.set_num_threads(threads)
        package = OnnxPackage(folder, threads=threads, provider="CPUExecutionProvider")
        images = []
        for latex in formulas:
            if len(images) >= cfg.samples + cfg.warmup:
                break
            try:
                images.append(adapter.preprocess(render_formula(latex)))
            except RenderError:
                continue
        if len(images) <= cfg.warmup:
            raise PipelineError("not enough renderable formulas to benchmark")
        for img in images[:cfg.warmup]:
            _time_one(adapter, package, img, max_length)
        rows = []
        for img in tqdm(images[cfg.warmup:], desc="benchmark (torch, onnx)", disable=not ctx.progress):
            rows.append(_time_one(adapter, package, img, max_length))
        metrics = _summarize(rows, threads, max_length, str(folder), package.meta.get("target"))
        out.metrics.update(metrics)
        (out.path / "latency.json").write_text(json.dumps({"summary": metrics, "rows": rows}, indent=2) + "\n")
        _write_report(out.path, metrics)
    _print_summary(metrics)
    return out.manifest


def _time_one(adapter, package: OnnxPackage, img: torch.Tensor, max_length: int) -> dict:
    with torch.inference_mode():
        t0 = time.perf_counter()
        ref = adapter.generate(img[None], max_length=max_length, batch_size=1)
        t_torch = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = package.generate(img[None].numpy(), max_length=max_length, batch_size=1)
    t_onnx = time.perf_counter() - t0
    row = {"steps_torch": ref.steps[0], "steps_onnx": got.steps[0], "identical": ref.token_ids[0] == got.token_ids[0],
           "torch_encoder_ms": 1000 * ref.encoder_seconds, "torch_decoder_ms": 1000 * ref.decoder_seconds,
           "torch_total_ms": 1000 * t_torch,
           "onnx_encoder_ms": 1000 * got.encoder_seconds, "onnx_decoder_ms": 1000 * got.decoder_seconds,
           "onnx_total_ms": 1000 * t_onnx}
    if adapter.cached_decoder() is not None:  # torch with the same KV cache: what ONNX Runtime adds on top
        with torch.inference_mode():
            t0 = time.perf_counter()
            cached = adapter.generate(img[None], max_length=max_length, batch_size=1, use_cache=True)
            row["torch_cached_total_ms"] = 1000 * (time.perf_counter() - t0)
        row["torch_cached_encoder_ms"] = 1000 * cached.encoder_seconds
        row["torch_cached_decoder_ms"] = 1000 * cached.decoder_seconds
    return row


def _summarize(rows: list[dict], threads: int, max_length: int, package: str, target: Optional[str]) -> dict:
    mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0] if k.endswith("_ms")}
    steps_t = sum(r["steps_torch"] for r in rows)
    steps_o = sum(r["steps_onnx"] for r in rows)
    return {
        "n": len(rows), "threads": threads, "max_length": max_length, "package": package, "target": target,
        **{f"{k}": round(v, 2) for k, v in mean.items()},
        "torch_decoder_ms_per_step": round(sum(r["torch_decoder_ms"] for r in rows) / max(steps_t, 1), 3),
        "onnx_decoder_ms_per_step": round(sum(r["onnx_decoder_ms"] for r in rows) / max(steps_o, 1), 3),
        "speedup_total": round(mean["torch_total_ms"] / mean["onnx_total_ms"], 2),
        "speedup_encoder": round(mean["torch_encoder_ms"] / mean["onnx_encoder_ms"], 2),
        "speedup_decoder": round(mean["torch_decoder_ms"] / mean["onnx_decoder_ms"], 2),
        "identical_tokens": float(np.mean([r["identical"] for r in rows])),
        "speedup_vs_torch_cached": round(mean["torch_cached_total_ms"] / mean["onnx_total_ms"], 2)
        if "torch_cached_total_ms" in mean else None,
        "mean_steps": float(np.mean([r["steps_torch"] for r in rows])),
    }


def _write_report(folder: Path, m: dict) -> None:
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    labels = ["torch\n(full prefix)", "ONNX\n(KV cache)"]
    enc = [m["torch_encoder_ms"], m["onnx_encoder_ms"]]
    dec = [m["torch_decoder_ms"], m["onnx_decoder_ms"]]
    ax.bar(labels, enc, color="#4477aa", label="encoder")
    ax.bar(labels, dec, bottom=enc, color="#ee6677", label="decoder")
    ax.set_ylabel("ms per image (batch 1)")
    ax.set_title(f"Latency, {m['n']} images, {m['threads']} thread(s): {m['speedup_total']}x")
    ax.legend()
    savefig(fig, folder / "latency.png")
    table = markdown_table(["", "torch", "ONNX package", "ratio torch / ONNX"], [
        ["encoder ms / image", f"{m['torch_encoder_ms']:.1f}", f"{m['onnx_encoder_ms']:.1f}", f"{m['speedup_encoder']}x"],
        ["decoder ms / image", f"{m['torch_decoder_ms']:.1f}", f"{m['onnx_decoder_ms']:.1f}", f"{m['speedup_decoder']}x"],
        ["decoder ms / step", f"{m['torch_decoder_ms_per_step']:.2f}", f"{m['onnx_decoder_ms_per_step']:.2f}", ""],
        ["end to end ms / image", f"{m['torch_total_ms']:.1f}", f"{m['onnx_total_ms']:.1f}", f"{m['speedup_total']}x"],
    ])
    if m.get("speedup_vs_torch_cached") is not None:
        table += "\n\n" + markdown_table(["torch with the adapter's KV cache", "ms / image", "ratio to ONNX"], [
            ["encoder", f"{m['torch_cached_encoder_ms']:.1f}", ""],
            ["decoder", f"{m['torch_cached_decoder_ms']:.1f}", ""],
            ["end to end", f"{m['torch_cached_total_ms']:.1f}", f"{m['speedup_vs_torch_cached']}x"],
        ])
    (folder / "report.md").write_text(
        f"# Latency: torch vs {Path(m['package']).name} ({m['target']})\n\n"
        f"Batch 1, {m['n']} rendered formulas (mean {m['mean_steps']:.1f} decode steps, cap {m['max_length']} "
        f"incl. BOS), {m['threads']} intra-op thread(s) for both, timed one image at a time, torch and ONNX "
        f"interleaved so both see the same machine load. ONNX runs on ONNX Runtime CPU. Identical greedy "
        f"tokens on {m['identical_tokens']:.3f} of them.\n\n{table}\n\n![latency](latency.png)\n\n"
        "Wall-clock times on a shared machine: compare the ratios of one run, not absolute numbers "
        "across runs.\n")


def _print_summary(m: dict) -> None:
    print(f"[benchmark] {m['target']} n={m['n']} threads={m['threads']}: torch {m['torch_total_ms']:.0f} ms/img "
          f"(decoder {m['torch_decoder_ms_per_step']:.2f} ms/step) vs ONNX {m['onnx_total_ms']:.0f} ms/img "
          f"(decoder {m['onnx_decoder_ms_per_step']:.2f} ms/step): {m['speedup_total']}x end to end, "
          f"encoder {m['speedup_encoder']}x, decoder {m['speedup_decoder']}x; vs torch with KV cache "
          f"{m.get('speedup_vs_torch_cached')}x", flush=True)
