"""Stage infer: read formula images with an exported package alone (ONNX Runtime, no torch model).

``python -m pipeline stage=infer infer.package=<folder or export stage name> infer.image=<image or folder>``
prints ``<file>\\t<latex>`` per image (sorted by name); ``infer.output=FILE`` also writes them.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pipeline import files
from pipeline.context import StageContext, check_max_length
from pipeline.errors import ConfigError, ImageError, InputError, check_range
from pipeline.export.runtime import OnnxPackage

log = logging.getLogger(__name__)

NAME = "infer"
CONFIG_KEY = "infer"


@dataclass
class InferConfig:
    package: Optional[str] = None      # exported package folder, or an export stage's name under the root
    image: Optional[str] = None        # an image file, or a folder of images
    max_length: Optional[int] = None   # decode cap incl. BOS; null = the package's
    batch_size: int = 8                # images a decoder call reads (plain greedy); with speculative: 1
    speculative: bool = True           # a package with a drafter reads image by image, speculatively (token for
                                       # token its greedy reading, fewer decoder calls); false: plain greedy, batched
    threads: int = 0                   # ONNX Runtime intra-op threads; 0 = its default
    output: Optional[str] = None       # also write "<file>\t<latex>" lines here

    def __post_init__(self) -> None:  # the package's own ceiling is checked when it is loaded
        if self.max_length is not None:
            check_range("infer.max_length", self.max_length, 2, why="BOS plus at least one token")
        check_range("infer.batch_size", self.batch_size, 1)
        check_range("infer.threads", self.threads, 0, why="0 = ONNX Runtime's default")


Config = InferConfig


def image_paths(ref: Optional[str]) -> list[Path]:
    if not ref:
        raise ConfigError("stage=infer needs infer.image=<image file or folder of images>")
    path = Path(ref)
    if path.is_dir():
        return files.image_files(path, "infer.image")
    if not path.is_file():
        raise InputError(f"infer.image={ref}: no such file or folder")
    return [path]


def run(cfg: InferConfig, ctx: StageContext) -> dict:
    folder = files.find_package(cfg.package, ctx.artifacts_dir, "infer.package")
    paths = image_paths(cfg.image)
    if cfg.output:  # before the work, not after it
        files.check_output_file(cfg.output, "infer.output")
    package = OnnxPackage(folder, threads=cfg.threads, speculative=cfg.speculative)
    if cfg.max_length is not None:
        check_max_length(cfg.max_length, package.max_positions, f"package {folder}", "infer.max_length")
    images, names, skipped = [], [], []
    for p in paths:
        try:
            images.append(package.preprocess(files.open_image(p)))
            names.append(p.name)
        except ImageError as exc:
            skipped.append(str(exc))
    if not images:
        raise ImageError(f"infer.image={cfg.image}: no readable image: {'; '.join(skipped[:3])}")
    if skipped:
        log.warning(f"[infer] skipped {len(skipped)} unreadable image(s): {'; '.join(skipped[:5])}")
    import numpy as np

    t0 = time.perf_counter()
    batch = 1 if package.speculative else cfg.batch_size  # speculative decoding reads one image a call
    result = package.generate(np.stack(images), int(cfg.max_length or package.meta["max_length"]), batch)
    seconds = time.perf_counter() - t0
    lines = [f"{n}\t{t}" for n, t in zip(names, result.texts)]
    for line in lines:
        print(line, flush=True)  # the predictions are the command's output, not log lines
    if package.provider != package.meta.get("provider"):
        log.warning(f"[infer] {package.meta.get('provider')} is not available here; ran on {package.provider}")
    how = (f"speculative, {sum(result.calls)} decoder calls for {sum(result.steps)} tokens" if package.speculative
           else f"greedy, batch {batch}")
    log.info(f"[infer] {len(lines)} image(s) in {seconds:.2f} s with {folder} ({package.meta['target']}; {how})")
    if cfg.output:
        Path(cfg.output).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {"predictions": dict(zip(names, result.texts)), "hit_cap": dict(zip(names, result.hit_cap)),
            "seconds": seconds, "package": str(folder)}
