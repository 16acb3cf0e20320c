"""Where torch computes (``model.device``): ``auto`` = the first CUDA device when torch sees one, else
the CPU; ``cpu``; ``cuda`` or ``cuda:N``. The torch work of the stages (prune's scoring, refit and
recovery finetune, distill's training and readings, quantize's QAT, the torch readings of evaluate,
prune and benchmark) runs there; ONNX export and every ONNX Runtime session stay where they are
(graphs are traced on the CPU; a package's provider is its target's).

A model lives on the CPU between those steps: :func:`placed` moves it to the device for one
piece of work and back, so the stages that save, export or compare models never meet a CUDA tensor.
"""
from __future__ import annotations

import contextlib
import re
from typing import Iterator

from pipeline.errors import ConfigError

SETTINGS = ("auto", "cpu", "cuda", "cuda:N")


def check(setting: str) -> None:
    """One error line for a setting this machine cannot honour (``cuda`` without CUDA): before any work."""
    if setting in ("auto", "cpu"):
        return
    if not re.fullmatch(r"cuda(:\d+)?", setting):
        raise ConfigError(f"model.device={setting!r}: must be one of {', '.join(SETTINGS)}")
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"model.device={setting}: torch {torch.__version__} sees no CUDA device on this machine; "
                          f"model.device=auto (the CPU here) or cpu")
    index = int(setting.split(":")[1]) if ":" in setting else 0
    if index >= torch.cuda.device_count():
        raise ConfigError(f"model.device={setting}: torch sees {torch.cuda.device_count()} CUDA device(s)")


def resolve(setting: str):
    """The ``torch.device`` a (checked) setting names; ``auto``: CUDA when torch sees it, else the CPU."""
    import torch

    check(setting)
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


@contextlib.contextmanager
def placed(device, *adapters) -> Iterator[None]:
    """``adapters``' models on ``device`` for the block, back where each was after it (also on an error)."""
    before = [_device_of(a.model) for a in adapters]
    try:
        for a in adapters:
            a.model.to(device)
        yield
    finally:
        for a, where in zip(adapters, before):
            a.model.to(where)


def _device_of(model):
    import torch

    return next((p.device for p in model.parameters()), torch.device("cpu"))
