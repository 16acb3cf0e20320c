"""The real formula corpus: real sources, renderable, de-duplicated, disjoint seeded splits."""
from __future__ import annotations

from collections import Counter

from pipeline.data.corpus import assign_split, extract_math
from pipeline.data.render import render_formula
from pipeline.metrics import normalize


def test_extract_math_roles_and_directives():
    doc = """Compute :math:`x^2 + y` here.

    .. math::

        \\frac{a}{b} = c

        d_i = e

    .. math:: z = 1
    """
    found = extract_math(doc)
    assert "x^2 + y" in found and "\\frac{a}{b} = c" in found and "d_i = e" in found and "z = 1" in found


def test_split_assignment_is_seeded_and_stable():
    shares = {"train": 0.6, "calib": 0.2, "eval": 0.2}
    a = [assign_split(f"x_{i}", 0, shares) for i in range(300)]
    assert a == [assign_split(f"x_{i}", 0, shares) for i in range(300)]
    assert a != [assign_split(f"x_{i}", 1, shares) for i in range(300)]
    counts = Counter(a)
    assert 0.5 < counts["train"] / 300 < 0.7


def test_real_corpus_splits(corpus):
    by_split = Counter(f.split for f in corpus)
    assert by_split["eval"] >= 300 and by_split["calib"] >= 512 and by_split["train"] >= 1000
    norms = [f.normalized for f in corpus]
    assert len(norms) == len(set(norms))                       # de-duplicated after normalization
    assert all(f.normalized == normalize(f.latex) for f in corpus[:200])
    packages = Counter(f.source.split("/")[0] for f in corpus)
    assert set(packages) == {"numpy", "scipy", "sympy", "torch"}  # real docstrings, not templates
    for f in corpus[::97]:                                    # renderable at the model's scale
        img = render_formula(f.latex)
        assert img.width <= 496 and img.height <= 112
