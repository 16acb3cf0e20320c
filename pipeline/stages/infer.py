"""Stage infer (not built yet)."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import PipelineError

NAME = "infer"
CONFIG_KEY = "infer"
BUILT = False


@dataclass
class InferConfig:
    pass


Config = InferConfig


def run(cfg: InferConfig, ctx) -> dict:
    raise PipelineError("stage 'infer' is not built yet")
