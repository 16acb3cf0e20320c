"""Stage calibrate (not built yet)."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import PipelineError

NAME = "calibrate"
CONFIG_KEY = "calibrate"
BUILT = False


@dataclass
class CalibrateConfig:
    pass


Config = CalibrateConfig


def run(cfg: CalibrateConfig, ctx) -> dict:
    raise PipelineError("stage 'calibrate' is not built yet")
