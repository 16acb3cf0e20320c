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

# one definition of a head's view for pruning and the adapters (projections, num_heads are used from here)
from pipeline.adapters.attention import num_heads, projections  # noqa: F401


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
