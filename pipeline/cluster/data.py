"""``infer.engine=ray``: a folder of images read with Ray Data on an actor pool.

The paths are a dataset; ``map_batches`` sends batches of them to a pool of :class:`PackageReader`
actors, each with one :class:`OnnxPackage` (its own ONNX Runtime sessions, ``threads`` intra-op
threads = the actor's ``num_cpus``: ONNX Runtime ignores ``OMP_NUM_THREADS``). An actor opens each
file through :func:`pipeline.files.open_image` (the guard every stage reads images through), applies
the package's own preprocessing and reads the batch with ``generate`` as ``stage=infer`` does
(speculative packages image by image), so the readings are ``stage=infer``'s. A file that cannot be
read gets its row with the error; the rest are read. Rows: ``path``, ``latex``, ``error``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

from pipeline import files
from pipeline.errors import ImageError
from pipeline.export.runtime import OnnxPackage

COLUMNS = ("path", "latex", "error")
FORMATS = (".jsonl", ".parquet")


class PackageReader:
    """A Ray Data actor: one package's sessions; a batch of paths in, their readings out."""

    def __init__(self, package: str, threads: int, speculative: bool, max_length: Optional[int]):
        self.package = OnnxPackage(package, threads=threads, speculative=speculative)
        self.max_length = int(max_length or self.package.max_length)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        paths = [str(p) for p in batch["path"]]
        images, read, errors = [], [], [None] * len(paths)
        for i, path in enumerate(paths):
            try:
                images.append(self.package.preprocess(files.open_image(path)))
                read.append(i)
            except (ImageError, OSError) as exc:
                errors[i] = str(exc)
        texts: list = [None] * len(paths)
        if images:
            # stage=infer's call: a package with a drafter reads image by image, else the batch at once
            per_call = 1 if self.package.speculative else len(images)
            result = self.package.generate(np.stack(images), self.max_length, per_call)
            for i, text in zip(read, result.texts):
                texts[i] = text
        return {"path": paths, "latex": texts, "error": errors}


def read_paths(paths: list[Path], package: Path, actors: int, threads: int, batch_size: int,
               speculative: bool, max_length: Optional[int], progress: bool) -> list[dict]:
    """Every path's row (``path``, ``latex``, ``error``), sorted by path, read on ``actors`` actors of
    ``threads`` CPUs each, ``batch_size`` paths a batch."""
    import ray.data

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = progress
    context.enable_operator_progress_bars = progress
    dataset = ray.data.from_items([{"path": str(p)} for p in paths])
    readings = dataset.map_batches(
        PackageReader, fn_constructor_kwargs=dict(package=str(package), threads=threads, speculative=speculative,
                                                  max_length=max_length),
        batch_size=batch_size, batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=threads)
    rows = [{k: None if row[k] is None else str(row[k]) for k in COLUMNS} for row in readings.iter_rows()]
    return sorted(rows, key=lambda row: row["path"])


def write_rows(rows: list[dict], output: str | Path) -> Path:
    """The rows as JSON Lines or Parquet (by the suffix), through a temporary file renamed into place."""
    output = Path(output)
    if output.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({k: pa.array([row[k] for row in rows], pa.string()) for k in COLUMNS})
        return files.replace_file(output, lambda tmp: pq.write_table(table, str(tmp)))
    text = "".join(json.dumps({k: row[k] for k in COLUMNS}, ensure_ascii=False) + "\n" for row in rows)
    return files.write_text_atomic(output, text)
