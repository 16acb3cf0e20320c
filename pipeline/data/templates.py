"""Simple templated formulas (x^{2}+y, \\frac{a}{b} ...): a sanity check of the rendering recipe.

The model reads ~80 % of these exactly when they are rendered the way it was trained; a recipe
that drifts (font set, scale, canvas) drops that to almost nothing. Never used as the eval split.
"""
from __future__ import annotations

import random

_VARS = list("abcxyzmnkt")
_GREEK = [r"\alpha", r"\beta", r"\gamma", r"\theta", r"\lambda", r"\sigma", r"\pi", r"\mu"]


def templated_formulas(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)

    def atom() -> str:
        return rng.choice([rng.choice(_VARS), rng.choice(_GREEK), str(rng.randint(0, 9))])

    templates = [
        lambda: f"{atom()}^{{{atom()}}}+{atom()}",
        lambda: f"\\frac{{{atom()}}}{{{atom()}}}",
        lambda: f"{atom()}_{{{atom()}}}={atom()}",
        lambda: f"\\sqrt{{{atom()}+{atom()}}}",
        lambda: f"{atom()}+{atom()}-{atom()}",
        lambda: f"({atom()}+{atom()})^{{2}}",
    ]
    return [rng.choice(templates)() for _ in range(n)]
