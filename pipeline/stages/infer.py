"""Stage infer: read formula images with an exported package alone (ONNX Runtime, no torch model).

``python -m pipeline stage=infer package=<folder or export stage name> image=<image or folder>``
prints ``<file>\\t<latex>`` per image (sorted by name); ``infer.output=FILE`` also writes them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from PIL import Image, UnidentifiedImageError

from pipeline.context import StageContext
from pipeline.errors import PipelineError
from pipeline.export.runtime import PACKAGE_META, OnnxPackage

NAME = "infer"
CONFIG_KEY = "infer"
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".gif", ".webp"}


@dataclass
class InferConfig:
    max_length: Optional[int] = None   # decode cap incl. BOS; null = the package's
    batch_size: int = 8
    threads: int = 0                   # ONNX Runtime intra-op threads; 0 = its default
    output: Optional[str] = None       # also write "<file>\t<latex>" lines here


Config = InferConfig


def resolve_package(ref: Optional[str], ctx: StageContext) -> Path:
    if not ref:
        raise PipelineError("stage=infer needs package=<exported package folder or export stage name>")
    for cand in (Path(ref), ctx.artifacts_dir / ref):
        if (cand / PACKAGE_META).is_file():
            return cand
    raise PipelineError(f"package={ref}: not an exported package folder (no {PACKAGE_META}) "
                        f"nor an export under {ctx.artifacts_dir}")


def image_paths(ref: Optional[str]) -> list[Path]:
    if not ref:
        raise PipelineError("stage=infer needs image=<image file or folder of images>")
    path = Path(ref)
    if path.is_dir():
        paths = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        if not paths:
            raise PipelineError(f"image={ref}: no image ({', '.join(sorted(IMAGE_SUFFIXES))}) in the folder")
        return paths
    if not path.is_file():
        raise PipelineError(f"image={ref}: no such file or folder")
    return [path]


def run(cfg: InferConfig, ctx: StageContext) -> dict:
    folder = resolve_package(ctx.cfg.package, ctx)
    paths = image_paths(ctx.cfg.image)
    if cfg.batch_size < 1:
        raise PipelineError(f"infer.batch_size must be >= 1, got {cfg.batch_size}")
    if cfg.max_length is not None and cfg.max_length < 2:
        raise PipelineError(f"infer.max_length must be >= 2, got {cfg.max_length}")
    package = OnnxPackage(folder, threads=cfg.threads)
    images, names, skipped = [], [], []
    for p in paths:
        try:
            with Image.open(p) as im:
                im.load()
                images.append(package.preprocess(im))
                names.append(p.name)
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            skipped.append(f"{p.name} ({type(exc).__name__})")
    if skipped:
        print(f"[infer] skipped {len(skipped)} unreadable image(s): {', '.join(skipped[:5])}", flush=True)
    if not images:
        raise PipelineError(f"image={ctx.cfg.image}: no readable image")
    import numpy as np

    t0 = time.perf_counter()
    result = package.generate(np.stack(images), int(cfg.max_length or package.meta["max_length"]), cfg.batch_size)
    seconds = time.perf_counter() - t0
    lines = [f"{n}\t{t}" for n, t in zip(names, result.texts)]
    for line in lines:
        print(line, flush=True)
    if package.provider != package.meta.get("provider"):
        print(f"[infer] {package.meta.get('provider')} is not available here; ran on {package.provider}", flush=True)
    print(f"[infer] {len(lines)} image(s) in {seconds:.2f} s with {folder} ({package.meta['target']})", flush=True)
    if cfg.output:
        Path(cfg.output).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {"predictions": dict(zip(names, result.texts)), "hit_cap": dict(zip(names, result.hit_cap)),
            "seconds": seconds, "package": str(folder)}
