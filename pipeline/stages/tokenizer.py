"""Stage tokenizer (not built yet)."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import PipelineError

NAME = "tokenizer"
CONFIG_KEY = "tokenizer"
BUILT = False


@dataclass
class TokenizerConfig:
    pass


Config = TokenizerConfig


def run(cfg: TokenizerConfig, ctx) -> dict:
    raise PipelineError("stage 'tokenizer' is not built yet")
