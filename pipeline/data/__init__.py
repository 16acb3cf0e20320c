"""Formula data: the docstring corpus, templated formulas, and the mathtext renderer."""
