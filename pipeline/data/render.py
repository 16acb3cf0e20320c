"""Deterministic LaTeX -> image renderer (matplotlib mathtext, Computer Modern).

The default model was trained on black formulas on a white canvas at about 32 px per em; other
font sets, or a tight crop blown up to the canvas, read almost nothing. ``render_formula`` gives
the tight ink crop at that scale; the model adapter's ``preprocess`` places it on the canvas.
"""
from __future__ import annotations

import io
import logging
import threading
import warnings
from typing import Any, Callable, Iterable, Optional

import numpy as np
from PIL import Image

from pipeline import interrupts

FONTSET = "cm"
PX_PER_EM = 32
INK_THRESHOLD = 250  # a pixel darker than this (of 255) is ink

log = logging.getLogger(__name__)
_lock = threading.Lock()  # mathtext's parser caches are not thread-safe
# mathtext logs every unknown glyph it substitutes; a model's odd prediction is not news
logging.getLogger("matplotlib.mathtext").setLevel(logging.ERROR)


class RenderError(ValueError):
    """mathtext cannot render this formula."""


def render_formula(latex: str, px_per_em: int = PX_PER_EM, fontset: str = FONTSET) -> Image.Image:
    """Render ``latex`` (without ``$``) to a tight, white-background, 8-bit grey image."""
    from matplotlib import mathtext
    from matplotlib.font_manager import FontProperties

    text = latex.strip()
    if not text:
        raise RenderError("empty formula")
    buf = io.BytesIO()
    prop = FontProperties(size=px_per_em, math_fontfamily=fontset)
    try:
        with _lock, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # dpi 72: one point is one pixel, so a font size of N points is N px per em.
            mathtext.math_to_image(f"${text}$", buf, prop=prop, dpi=72, format="png")
    except Exception as exc:  # mathtext raises ValueError/ParseException/KeyError for bad input
        raise RenderError(f"mathtext cannot render {text!r}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    buf.seek(0)
    with Image.open(buf) as im:
        grey = im.convert("L")
    crop = crop_to_ink(grey)
    if crop is None:
        raise RenderError(f"formula renders no ink: {text!r}")
    return crop


def ink_bbox(grey: Image.Image, threshold: int = INK_THRESHOLD) -> tuple[int, int, int, int] | None:
    arr = np.asarray(grey)
    ys, xs = np.nonzero(arr < threshold)
    if len(xs) == 0:
        return None
    return int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1


def crop_to_ink(grey: Image.Image, threshold: int = INK_THRESHOLD) -> Image.Image | None:
    box = ink_bbox(grey, threshold)
    return None if box is None else grey.crop(box)


def render_inputs(pairs: Iterable[tuple[str, str]], preprocess: Callable[[Image.Image], Any],
                  limit: Optional[int] = None, progress: bool = False, desc: str = "render"
                  ) -> list[tuple[str, str, Any]]:
    """(id, latex, ``preprocess(image)``) for each formula mathtext renders, in order, at most
    ``limit`` of them: the one render loop of evaluate, export and benchmark. The formulas it cannot
    render are skipped and named in one warning (``desc`` says whose)."""
    from tqdm import tqdm

    items, skipped = [], []
    for fid, latex in tqdm(pairs, desc=desc, disable=not progress):
        if limit is not None and len(items) >= limit:
            break
        try:
            image = render_formula(latex)
        except RenderError:
            # a signal matplotlib swallowed (its KeyboardInterrupt caught inside mathtext) fails every render
            # after it: the run was interrupted, not the formulas unrenderable
            interrupts.check(f"while rendering {desc}")
            skipped.append(str(fid))
            continue
        items.append((fid, latex, preprocess(image)))
    if skipped:
        log.warning("%s: skipped %d formula(s) mathtext cannot render: %s%s", desc, len(skipped),
                    ", ".join(skipped[:5]), " ..." if len(skipped) > 5 else "")
    return items
