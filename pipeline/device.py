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


def native_bf16(device, cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether ``device`` computes bfloat16 natively: a CUDA device that supports it, or a CPU with AVX512-BF16 or
    AMX (its Linux ``/proc/cpuinfo`` flags). Elsewhere torch emulates it, and bf16 autocast is slower than fp32:
    7x a training step on an AVX2 EPYC (docs/results/2026-12-07-bf16-on-avx2.md)."""
    import torch

    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if device.type != "cpu":
        return False
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:  # not Linux: fp32
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags))


def precision(setting: str, device) -> str:
    """A training precision setting (``auto`` | ``fp32`` | ``bf16``) as run on ``device``: ``auto`` is bf16
    where the device computes it natively (:func:`native_bf16`), else fp32."""
    if setting != "auto":
        return setting
    return "bf16" if native_bf16(device) else "fp32"


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
