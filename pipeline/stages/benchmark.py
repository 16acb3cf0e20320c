"""Stage benchmark (not built yet)."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import PipelineError

NAME = "benchmark"
CONFIG_KEY = "benchmark"
BUILT = False


@dataclass
class BenchmarkConfig:
    pass


Config = BenchmarkConfig


def run(cfg: BenchmarkConfig, ctx) -> dict:
    raise PipelineError("stage 'benchmark' is not built yet")
