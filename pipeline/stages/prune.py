"""Stage prune (not built yet)."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import PipelineError

NAME = "prune"
CONFIG_KEY = "prune"
BUILT = False


@dataclass
class PruneConfig:
    pass


Config = PruneConfig


def run(cfg: PruneConfig, ctx) -> dict:
    raise PipelineError("stage 'prune' is not built yet")
