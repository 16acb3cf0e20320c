"""What stage evaluate reads: a corpus split, a formulas file (one LaTeX a line, rendered) or a
folder of labelled images, as (image, truth) items for :func:`pipeline.evaluation.evaluate_items`."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pipeline import files
from pipeline.context import file_hash
from pipeline.data.render import render_inputs
from pipeline.errors import ImageError, PipelineError
from pipeline.evaluation import EvalItem

log = logging.getLogger(__name__)


@dataclass
class Source:
    """One thing to evaluate, read but not yet rendered: its (id, latex) pairs (or labelled image
    files), the input hashes that decide reuse, and a description."""
    pairs: list[tuple[str, str]]
    inputs: dict[str, str]
    description: str
    folder: Optional[Path] = None   # eval.images: the pairs are (file name, latex) in this folder


def read_source(cfg, ctx, split: Optional[str] = None) -> Source:
    """What to evaluate from ``eval.images``, ``eval.formulas`` or a corpus split: files and hashes
    only, so reuse is decided before the model is loaded and anything is rendered."""
    if cfg.formulas and cfg.images:
        raise PipelineError("give eval.formulas or eval.images, not both")
    if cfg.limit is not None and cfg.limit <= 0:
        raise PipelineError(f"eval.limit must be positive, got {cfg.limit}")
    if cfg.images:
        folder = Path(cfg.images)
        if not folder.is_dir():
            raise PipelineError(f"eval.images: no such folder {folder}")
        labels_path = files.labels_file(folder, cfg.labels, "eval.labels", required=True)
        labels = files.read_labels(labels_path, "eval.labels")
        return Source(labels[:cfg.limit] if cfg.limit else labels,
                      {"images": file_hash(folder), "labels": file_hash(labels_path)}, f"images {folder}", folder)
    if cfg.formulas:
        path = Path(cfg.formulas)
        pairs = [(f"line{i}", ln) for i, ln in files.read_formulas(path, "eval.formulas")]
        source, inputs = f"file {path}", {"formulas": file_hash(path)}
    else:
        split = split or cfg.split or "eval"
        pairs = [(f.id, f.latex) for f in ctx.split(split)]
        source = "shift split (packages the corpus never read)" if split == "shift" else f"corpus split '{split}'"
        inputs = {f"split:{split}": ctx.split_hash(split)}
    if cfg.limit:
        pairs = pairs[:cfg.limit]
    if not pairs:
        raise PipelineError(f"nothing to evaluate in {source}")
    return Source(pairs, inputs, source)


def load_items(src: Source, adapter, progress: bool) -> list[EvalItem]:
    """The (image, truth) pairs of a source: images decoded, or formulas rendered, and preprocessed."""
    if src.folder is not None:
        return _image_items(src, adapter)
    items = [EvalItem(fid, latex, tensor) for fid, latex, tensor
             in render_inputs(src.pairs, adapter.preprocess, progress=progress, desc=f"evaluate {src.description}")]
    if not items:
        raise PipelineError(f"no formula in {src.description} could be rendered")
    return items


def _image_items(src: Source, adapter) -> list[EvalItem]:
    items, skipped = [], []
    for name, latex in src.pairs:
        try:
            items.append(EvalItem(name, latex, adapter.preprocess(files.open_image(src.folder / name))))
        except ImageError as exc:
            skipped.append(str(exc))
    if not items:
        raise ImageError(f"eval.images: no readable image among the {len(src.pairs)} labelled in {src.folder}: "
                         f"{'; '.join(skipped[:3])}")
    if skipped:
        log.warning(f"[evaluate] skipped {len(skipped)} unreadable image(s): {'; '.join(skipped[:5])}")
    return items
