"""A head's view of an attention module: its projections, and hooks that gate heads.

Gating works on the *input* of the output projection (the concatenated per-head contexts), so it
needs nothing from the module beyond its layout: the same code gates ExplicitAttention and
HF-style attention.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch import nn


def projections(attn: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]:
    out = getattr(attn, "out_proj", None) or getattr(attn, "o_proj", None)
    q, k, v = (getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj"))
    if not all(isinstance(m, nn.Linear) for m in (q, k, v, out)):
        raise TypeError(f"{type(attn).__name__} has no explicit q/k/v/out Linear projections")
    return q, k, v, out  # type: ignore[return-value]


def num_heads(attn: nn.Module) -> int:
    for name in ("num_heads", "num_attention_heads"):
        if hasattr(attn, name):
            return int(getattr(attn, name))
    raise TypeError(f"{type(attn).__name__} does not say how many heads it has")


def head_dim(attn: nn.Module) -> int:
    return int(attn.head_dim)


@contextlib.contextmanager
def head_gates(attns: Sequence[nn.Module], gates: Sequence[torch.Tensor]) -> Iterator[None]:
    """While open, each head's context is multiplied by its gate (``gates[l][h]``) before the
    output projection. Gates may require grad (Michel et al. head importance) or be 0/1 masks."""
    handles = []
    for attn, gate in zip(attns, gates):
        d = head_dim(attn)

        def pre_hook(module, args, gate=gate, d=d):
            (x, *rest) = args
            scale = gate.to(x.dtype).repeat_interleave(d)
            return (x * scale, *rest)

        handles.append(projections(attn)[3].register_forward_pre_hook(pre_hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
