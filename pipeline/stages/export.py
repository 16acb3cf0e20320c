"""Stage export (not built yet)."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import PipelineError

NAME = "export"
CONFIG_KEY = "export"
BUILT = False


@dataclass
class ExportConfig:
    pass


Config = ExportConfig


def run(cfg: ExportConfig, ctx) -> dict:
    raise PipelineError("stage 'export' is not built yet")
