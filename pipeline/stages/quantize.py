"""Stage quantize (not built yet)."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import PipelineError

NAME = "quantize"
CONFIG_KEY = "quantize"
BUILT = False


@dataclass
class QuantizeConfig:
    pass


Config = QuantizeConfig


def run(cfg: QuantizeConfig, ctx) -> dict:
    raise PipelineError("stage 'quantize' is not built yet")
