"""The stage registry. Each stage is one module with ``NAME``, ``CONFIG_KEY``, a typed ``Config``
dataclass and ``run(cfg, ctx)``, and where its keys need more than the dataclass's own checks a
``validate(cfg)`` that the command line calls for every stage it will run before the first one starts
(a bad key of the last stage of ``stage=all`` fails in seconds, not after an hour); stages never
import each other, they meet through artifacts."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

# Order of ``stage=all``: the baseline first, then each stage reading the previous one's artifacts.
ORDER = ("evaluate", "prune", "tokenizer", "distill", "calibrate", "quantize", "export", "benchmark")
EXTRA = ("infer", "serve")
# Stages whose images come from the ``data`` group (quantize through calibrate's set); every other
# stage reads the corpus or its own keys and refuses ``data=image_folder|hf_disk`` in one line
DATA_STAGES = ("calibrate", "quantize")


@dataclass(frozen=True)
class StageSpec:
    name: str
    config_key: str
    config_cls: Any
    run: Callable[..., Any]
    doc: str
    validate: Callable[[Any], None]


def _no_checks(cfg: Any) -> None:
    """A stage whose dataclass checks its own keys (``__post_init__``)."""


def _load() -> dict[str, StageSpec]:
    specs = {}
    for name in ORDER + EXTRA:
        mod = importlib.import_module(f"pipeline.stages.{name}")
        specs[name] = StageSpec(name=mod.NAME, config_key=mod.CONFIG_KEY, config_cls=mod.Config,
                                run=mod.run, validate=getattr(mod, "validate", _no_checks),
                                doc=(mod.__doc__ or "").strip().splitlines()[0])
    return specs


STAGES: dict[str, StageSpec] = _load()


def check_data_group(stage: str, kind: str) -> None:
    """``stage=evaluate data=image_folder`` must not quietly evaluate the corpus: one error line
    naming the stage's own key for its inputs. ``stage=all`` hands the group to :data:`DATA_STAGES`."""
    from pipeline.errors import ConfigError

    if kind == "corpus" or stage == "all" or stage in DATA_STAGES:
        return
    own = {"evaluate": "eval.images=DIR (and eval.labels=FILE) or eval.formulas=FILE",
           "infer": "infer.image=<image or folder>",
           "export": "export.formulas=FILE", "benchmark": "benchmark.formulas=FILE"}.get(stage)
    raise ConfigError(f"data={kind}: stage {stage} does not read the data group (only "
                      f"{', '.join(DATA_STAGES)} do){'; use ' + own if own else ''}")
