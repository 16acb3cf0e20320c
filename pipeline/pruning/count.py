"""Parameters, encoder FLOPs (``torch.utils.flop_counter``) and encoder latency of an adapter."""
from __future__ import annotations

import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode


def encoder_flops(adapter, batch: int = 1) -> int:
    """FLOPs of one encoder forward pass (a multiply-add counts 2), at batch ``batch``."""
    x = torch.zeros((batch, *adapter.input_shape))
    module = adapter.encoder_module()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        module(x)
    return int(counter.get_total_flops())


def flops_per_head(adapter) -> int:
    """Encoder FLOPs one head costs: measured by removing head 0 of the first layer on a copy."""
    probe = adapter.clone()
    probe.remove_encoder_heads({0: [0]})
    return encoder_flops(adapter) - encoder_flops(probe)


@torch.no_grad()
def encoder_latency_ms(adapter, images: torch.Tensor, repeats: int = 3) -> float:
    """Median encoder time per image at batch 1 over ``images`` (each timed ``repeats`` times)."""
    adapter.model.eval()
    adapter.encode(images[:1])  # warm-up
    times = []
    for img in images:
        for _ in range(repeats):
            t0 = time.perf_counter()
            adapter.encode(img[None])
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def parameters(adapter) -> int:
    return sum(p.numel() for p in adapter.model.parameters())


def attention_parameters(adapter) -> int:
    """Parameters of the encoder's attention projections (what head pruning shrinks)."""
    from pipeline.pruning.heads import projections
    total = 0
    for layer in range(len(adapter.encoder_head_counts())):
        for m in projections(adapter.encoder_attention(layer)):
            total += sum(p.numel() for p in m.parameters())
    return total
