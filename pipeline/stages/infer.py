"""Stage infer: read formula images with an exported package alone (ONNX Runtime, no torch model).

``python -m pipeline stage=infer infer.package=<folder or export stage name> infer.image=<image or folder>``
prints ``<file>\\t<latex>`` per image (sorted by name); ``infer.output=FILE`` also writes them.
``infer.engine=ray`` reads the folder with Ray Data on an actor pool (pipeline/cluster/data.py), an error
row for each file that cannot be read, to ``infer.output`` as JSON Lines or Parquet.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pipeline import files
from pipeline.cluster import Engine
from pipeline.context import StageContext, check_max_length
from pipeline.errors import ConfigError, ImageError, InputError, check_range
from pipeline.export.runtime import OnnxPackage

log = logging.getLogger(__name__)

NAME = "infer"
CONFIG_KEY = "infer"


@dataclass
class InferConfig:
    package: Optional[str] = None      # exported package folder, or an export stage's name under the root
    image: Optional[str] = None        # an image file, a folder of images, or a .txt file of image paths (one a line)
    max_length: Optional[int] = None   # decode cap incl. BOS; null = the package's
    batch_size: int = 8                # images a decoder call reads (plain greedy); with speculative: 1
    speculative: bool = True           # a package with a drafter reads image by image, speculatively (token for
                                       # token its greedy reading, fewer decoder calls); false: plain greedy, batched
    threads: int = 0                   # ONNX Runtime intra-op threads; 0 = its default
    output: Optional[str] = None       # also write "<file>\t<latex>" lines here (engine=ray: .jsonl or .parquet)
    engine: Engine = Engine.builtin    # builtin: this process | ray: Ray Data on an actor pool
    address: Optional[str] = None      # engine=ray: an existing cluster (auto, host:6379, ray://host:10001); null = local
    actors: int = 0                    # engine=ray: actors, each one package's sessions x infer.threads (0 = 1)
                                       # CPUs; 0 = one per core / threads

    def __post_init__(self) -> None:  # the package's own ceiling is checked when it is loaded
        if self.max_length is not None:
            check_range("infer.max_length", self.max_length, 2, why="BOS plus at least one token")
        check_range("infer.batch_size", self.batch_size, 1)
        check_range("infer.threads", self.threads, 0, why="0 = ONNX Runtime's default")
        check_range("infer.actors", self.actors, 0, why="0 = one per core / infer.threads")
        if self.engine is Engine.ray and self.output and Path(self.output).suffix not in (".jsonl", ".parquet"):
            raise ConfigError(f"infer.output={self.output}: infer.engine=ray writes .jsonl or .parquet (path, latex, error)")
        if self.engine is Engine.builtin and (self.address or self.actors):
            raise ConfigError("infer.address and infer.actors are for infer.engine=ray")


Config = InferConfig

LIST_SUFFIX = ".txt"  # infer.image=paths.txt: the images it lists


def image_paths(ref: Optional[str]) -> list[Path]:
    if not ref:
        raise ConfigError("stage=infer needs infer.image=<image file or folder of images>")
    path = Path(ref)
    if path.is_dir():
        return files.image_files(path, "infer.image")
    if path.is_file() and path.suffix.lower() == LIST_SUFFIX:
        return files.image_list(path, "infer.image")
    if not path.is_file():
        raise InputError(f"infer.image={ref}: no such file or folder")
    return [path]


def run(cfg: InferConfig, ctx: StageContext) -> dict:
    if cfg.engine is Engine.ray:
        return run_ray(cfg, ctx)
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
    result = package.generate(np.stack(images), int(cfg.max_length or package.max_length), batch)
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


def run_ray(cfg: InferConfig, ctx: StageContext) -> dict:
    """infer.engine=ray: Ray Data over the paths, an actor pool reading them (pipeline/cluster/data.py).
    A file that cannot be read gets its row with the error; the rest are read."""
    from pipeline import cluster
    from pipeline.cluster.data import read_paths, write_rows

    folder = files.find_package(cfg.package, ctx.artifacts_dir, "infer.package")
    paths = image_paths(cfg.image)
    if cfg.output:
        files.check_output_file(cfg.output, "infer.output")
    if cfg.address:  # an unreachable cluster is refused before the package is loaded
        cluster.check_reachable(cfg.address, "infer.address")
    package = OnnxPackage(folder, threads=1, speculative=cfg.speculative)  # checked before Ray starts
    if cfg.max_length is not None:
        check_max_length(cfg.max_length, package.max_positions, f"package {folder}", "infer.max_length")
    threads = cfg.threads or 1
    actors = cfg.actors or max(1, cluster.cores() // threads)
    progress = ctx.progress
    connected = cluster.connect(cfg.address, "infer.address", cluster.cores(), progress)
    try:
        cluster.check_cpus(threads, "infer.threads")
        t0 = time.perf_counter()
        rows = read_paths(paths, folder, actors, threads, cfg.batch_size, cfg.speculative, cfg.max_length, progress)
        seconds = time.perf_counter() - t0
    finally:
        cluster.disconnect(connected)
    for row in rows:
        if not row["error"]:
            print(f"{Path(row['path']).name}\t{row['latex']}", flush=True)
    errors = [row for row in rows if row["error"]]
    if cfg.output:
        write_rows(rows, cfg.output)
    print(f"{len(rows) - len(errors)} image(s) read, {len(errors)} error(s)"
          + (f": {'; '.join(row['error'] for row in errors[:3])}" if errors else ""), flush=True)
    log.info(f"[infer] {len(rows)} path(s) in {seconds:.2f} s with {folder} on Ray Data: {actors} actor(s) x "
             f"{threads} thread(s), batches of {cfg.batch_size}")
    return {"predictions": {Path(r["path"]).name: r["latex"] for r in rows if not r["error"]},
            "errors": {Path(r["path"]).name: r["error"] for r in errors}, "seconds": seconds, "package": str(folder)}
