"""The rendering recipe: shape, range, determinism, scale, and that the model reads it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.data.render import PX_PER_EM, RenderError, render_formula
from pipeline.data.templates import templated_formulas, varied_formulas
from pipeline.metrics import exact_match


def test_render_shape_range_and_background(real_adapter):
    x = real_adapter.preprocess(render_formula(r"\frac{a}{b}+x^{2}"))
    assert x.shape == (1, 128, 512) and x.dtype == torch.float32
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    assert float(x[0, 0, 0]) == 1.0 and float(x[0, -1, -1]) == 1.0   # white canvas
    assert float(x.min()) < 0.1                                      # black ink


def test_render_is_deterministic(real_adapter):
    a = real_adapter.preprocess(render_formula(r"\sum_{i=1}^{n} x_{i}"))
    b = real_adapter.preprocess(render_formula(r"\sum_{i=1}^{n} x_{i}"))
    assert torch.equal(a, b)
    assert np.array_equal(np.asarray(render_formula("x+y")), np.asarray(render_formula("x+y")))


def test_scale_is_about_32_px_per_em():
    # A capital M in Computer Modern is close to 0.7 em tall.
    h = render_formula("M").height
    assert 0.6 * PX_PER_EM <= h <= 0.8 * PX_PER_EM


def test_preprocess_is_idempotent_on_its_own_canvas(real_adapter):
    x = real_adapter.preprocess(render_formula(r"\alpha+\beta"))
    canvas = Image.fromarray((x[0].numpy() * 255).round().astype(np.uint8))
    assert torch.equal(real_adapter.preprocess(canvas), x)


def test_wide_formula_shrinks_to_fit(real_adapter):
    x = real_adapter.preprocess(render_formula("+".join(f"x_{{{i}}}" for i in range(40))))
    ink = (x[0] < 0.9).nonzero()
    assert ink[:, 1].min() >= 7 and ink[:, 1].max() <= 512 - 8


def test_unrenderable_is_a_clear_error():
    with pytest.raises(RenderError, match="mathtext cannot render"):
        render_formula(r"\frac{a}{")
    with pytest.raises(RenderError):
        render_formula("   ")


@pytest.mark.slow
def test_model_reads_the_recipe_but_not_a_tight_crop(real_adapter):
    """Rendered the training way the model reads most templates; the package's loader on a tight
    crop (stretched onto a black canvas) reads far less (0.3 here on templates, ~0 on real formulas)."""
    from latex_ocr_junia.data import load_and_preprocess_image

    formulas = templated_formulas(10, seed=3)
    ours = torch.stack([real_adapter.preprocess(render_formula(f)) for f in formulas])
    r = real_adapter.generate(ours, max_length=90, batch_size=10, use_cache=True)
    ours_em = np.mean([exact_match(p, f) for p, f in zip(r.texts, formulas)])

    import tempfile, os
    crops = []
    with tempfile.TemporaryDirectory() as d:
        for i, f in enumerate(formulas):
            path = os.path.join(d, f"{i}.png")
            render_formula(f).save(path)
            crops.append(load_and_preprocess_image(path, 128, 512))
    r2 = real_adapter.generate(torch.stack(crops), max_length=90, batch_size=10, use_cache=True)
    tight_em = np.mean([exact_match(p, f) for p, f in zip(r2.texts, formulas)])
    assert ours_em >= 0.6, (ours_em, r.texts)
    assert tight_em <= ours_em - 0.25, (tight_em, r2.texts)


def test_render_inputs_keeps_order_honours_the_limit_and_names_the_skipped(caplog):
    import logging

    from pipeline.data.render import render_inputs

    pairs = [("a", "x^2"), ("bad", r"\frac{"), ("b", "a+b"), ("c", "y")]
    with caplog.at_level(logging.WARNING, logger="pipeline.data.render"):
        items = render_inputs(pairs, lambda im: im.size, limit=2, desc="evaluate file f.txt")
    assert [(i, t) for i, t, _ in items] == [("a", "x^2"), ("b", "a+b")]
    assert all(isinstance(size, tuple) for _, _, size in items)
    assert [r.getMessage() for r in caplog.records] == [
        "evaluate file f.txt: skipped 1 formula(s) mathtext cannot render: bad"]


def test_varied_formulas_are_seeded_short_distinct_and_render():
    """The varied grammar (distill.varied): the same seed gives the same formulas, another seed others;
    none longer than its cap, nearly all distinct, and mathtext renders every one (a command is never
    glued to a following letter, ``\\alphax``)."""
    a, b = varied_formulas(60, seed=1), varied_formulas(60, seed=2)
    assert a == varied_formulas(60, seed=1) and a != b
    assert all(len(f) <= 64 for f in a) and len(set(a)) >= 57
    assert all(len(f) <= 30 for f in varied_formulas(20, seed=1, max_chars=30))
    for f in a:
        render_formula(f)
