"""The formulas the quantize stage reads: the plan search's set, the decoder search's, and a corpus
split's first formulas that render (the search split, the eval check's splits)."""
from __future__ import annotations

from typing import Optional

import numpy as np

from calibration.calibrators import calib_images
from pipeline.context import StageContext
from pipeline.data.render import render_inputs
from pipeline.errors import PipelineError


def split_set(ctx: StageContext, adapter, split: str, limit: int) -> tuple[np.ndarray, list[str]]:
    """The first ``limit`` formulas of a corpus split that render, as model inputs, with their LaTeX."""
    items = render_inputs([(f.id, f.latex) for f in ctx.split(split)], adapter.preprocess, limit,
                          ctx.progress, f"quantize {split}")
    if not items:
        raise PipelineError(f"quantize: no {split}-split formula could be rendered")
    return np.stack([x.numpy() for _, _, x in items]).astype(np.float32), [latex for _, latex, _ in items]


def search_set(ctx: StageContext, adapter, calib_set, calib_rows: int, size: int,
               split: Optional[str]) -> tuple[np.ndarray, list[str], str]:
    """The formulas the plan search reads (images, truths, and a line saying which): calibration-set
    rows after the ranges' ``calib_rows``, or the first ``size`` of ``split`` (``quantize.search_split``)."""
    if split:
        images, truths = split_set(ctx, adapter, split, size)
        return images, truths, f"{split} split, its first {len(truths)} formulas"
    end = calib_rows + size
    return (calib_images(calib_set, calib_rows, end), calib_set[calib_rows:end]["text"],
            f"calibration-set rows {calib_rows}..{end - 1}")


def decoder_search_set(calib_set, calib_rows: int, size: int, split: Optional[str], search_images: np.ndarray,
                       search_truths: list[str]) -> tuple[int, np.ndarray, list[str], str]:
    """The decoder search's formulas (how many, images, truths, a line saying which): under a search
    split the search set's first ``size``, else ``size`` calibration rows from ``calib_rows`` on."""
    if split:
        n = min(size, len(search_truths))
        return n, search_images[:n], search_truths[:n], f"{split} split, its first {n} formulas"
    end = calib_rows + size
    return (size, calib_images(calib_set, calib_rows, end), calib_set[calib_rows:end]["text"],
            f"calibration-set rows {calib_rows}..{end - 1}")
