"""Options that take one of a few values, typed so that Hydra refuses any other at compose time.

OmegaConf's structured configs validate ``Enum`` fields (``typing.Literal`` they refuse as an annotation)
and name the allowed values in the error: ``Invalid value 'l2qkv', expected one of [l2_qkv, ...]``.
A :class:`Choice` is a ``str`` as well: it compares equal to its value (``cfg.drafter == "none"``),
prints and formats as it, and serialises to it in JSON, so the code that reads the option and the
config hashes that key artifact reuse see the same strings as before the option was typed.
"""
from __future__ import annotations

import enum
from typing import Iterable


class Choice(str, enum.Enum):
    """A value out of a fixed set: its name is its value (OmegaConf looks a string up by name)."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str.__str__(self), spec)


def choices(name: str, values: Iterable[str], module: str) -> type[Choice]:
    """A :class:`Choice` named ``name`` whose members are ``values`` (a registry's keys: the registry
    stays the one list), defined in ``module`` (``__name__``: a member pickles by reference)."""
    return Choice(name, [(v, v) for v in values], module=module)  # type: ignore[return-value]
