"""The stage registry. Each stage is one module with ``NAME``, ``CONFIG_KEY``, a typed ``Config``
dataclass and ``run(cfg, ctx)``; stages never import each other, they meet through artifacts."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

# Order of ``stage=all``: the baseline first, then each stage reading the previous one's artifacts.
ORDER = ("evaluate", "prune", "tokenizer", "calibrate", "quantize", "export", "benchmark")
EXTRA = ("infer",)


@dataclass(frozen=True)
class StageSpec:
    name: str
    config_key: str
    config_cls: Any
    run: Callable[..., Any]
    built: bool
    doc: str


def _load() -> dict[str, StageSpec]:
    specs = {}
    for name in ORDER + EXTRA:
        mod = importlib.import_module(f"pipeline.stages.{name}")
        specs[name] = StageSpec(name=mod.NAME, config_key=mod.CONFIG_KEY, config_cls=mod.Config,
                                run=mod.run, built=bool(getattr(mod, "BUILT", True)),
                                doc=(mod.__doc__ or "").strip().splitlines()[0])
    return specs


STAGES: dict[str, StageSpec] = _load()
