"""The shift split: real formulas from packages the corpus never read, built like the corpus."""
from __future__ import annotations

from collections import Counter

import pytest

from conftest import make_ctx
from pipeline.data.corpus import extract_math
from pipeline.data.render import render_formula
from pipeline.errors import PipelineError
from pipeline.metrics import normalize

SHIFT_PACKAGES = {"networkx", "matplotlib", "pandas", "mpmath"}


def test_spaced_directive_is_read_for_the_shift_split_only():
    doc = """Defined as

    .. math ::

        \\gamma = \\lim_{n\\to\\infty} H_n - \\log n

    and :math:`x_1`.
    """
    assert extract_math(doc, spaced_directive=True) == ["x_1", "\\gamma = \\lim_{n\\to\\infty} H_n - \\log n"]
    assert extract_math(doc) == ["x_1"]  # the corpus keeps its extraction (and its splits)


@pytest.fixture(scope="module")
def shift(corpus_root):
    return make_ctx(corpus_root).split("shift")


@pytest.mark.slow
def test_shift_split_is_real_disjoint_and_large_enough(shift, corpus):
    assert len(shift) >= 300
    assert {f.split for f in shift} == {"shift"}
    packages = Counter(f.source.split("/")[0] for f in shift)
    assert set(packages) == SHIFT_PACKAGES and min(packages.values()) >= 5
    norms = [f.normalized for f in shift]
    assert len(norms) == len(set(norms))                          # de-duplicated after normalization
    assert not set(norms) & {f.normalized for f in corpus}        # nothing the corpus holds, in any split
    assert all(f.normalized == normalize(f.latex) and 3 <= len(f.normalized) <= 120 for f in shift)
    for f in shift[::37]:                                         # renderable at the model's scale
        img = render_formula(f.latex)
        assert img.width <= 496 and img.height <= 112


@pytest.mark.slow
def test_shift_split_is_cached_and_deterministic(shift, corpus_root, tmp_path):
    import shutil

    ctx = make_ctx(corpus_root)
    first = ctx.upstream("corpus-shift")
    assert first["metrics"]["total"] == len(shift) and ctx.split_hash("shift") == first["outputs"]["formulas.jsonl"]
    assert ctx.split("shift") == shift                           # reused, same content
    # another root, a changed key (the first package alone, a few seconds to read): built again, and
    # what it holds is exactly what that package gave the whole split (packages are read in order)
    shutil.copytree(corpus_root / "corpus", tmp_path / "corpus")
    rebuilt = make_ctx(tmp_path, ["data.shift_packages=[networkx]"]).split("shift")
    assert rebuilt and rebuilt == [f for f in shift if f.source.startswith("networkx/")]


def test_shift_packages_must_not_be_corpus_packages(corpus_root):
    with pytest.raises(PipelineError, match="sympy"):
        make_ctx(corpus_root, ["data.shift_packages=[mpmath,sympy]"]).split("shift")
    with pytest.raises(PipelineError, match="not installed"):
        make_ctx(corpus_root, ["data.shift_packages=[no_such_package_xyz]"]).split("shift")
