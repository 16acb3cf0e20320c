"""SmoothQuant (Xiao et al., 2023), folded into the float model before it is exported and quantized.

A ViT's LayerNorm outputs carry a few channels with outliers far above the rest; with one INT8
scale per activation tensor those channels set the scale and the others lose their resolution.
SmoothQuant divides each input channel ``j`` of a projection by ``s_j = max|X_j|^a / max|W_j|^(1-a)``
and multiplies the weight's column ``j`` by the same ``s_j``: the product is unchanged, the
activation's channels are flattened, the weights (quantized per output channel) absorb the rest.
The division is folded into what produces the channels — a LayerNorm's scale and shift, or the
output rows of the value projection feeding the attention's output projection (softmax · V is linear
in V per channel) — so the exported graph has no extra op and the float model computes the same
function. Which producer feeds which projections is model knowledge: the adapter's
``smoothing_pairs``.

ONNX Runtime has SmoothQuant only through ``neural-compressor`` (not a dependency here), and
ModelOpt's is for its torch quantizers (it keeps the scale as a ``pre_quant_scale`` in front of the
quantizer, for TensorRT-LLM); this module does the fold for the ONNX path.
"""
from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import nn

from pipeline.adapters.base import SmoothPair
from pipeline.errors import PipelineError


@torch.no_grad()
def input_absmax(adapter, pairs: Sequence[SmoothPair], images: torch.Tensor, batch_size: int = 8) -> dict[str, torch.Tensor]:
    """Per input channel, the largest |activation| each pair's consumers see over ``images``."""
    stats: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(_module, inputs, _output):
            x = inputs[0].detach().abs().reshape(-1, inputs[0].shape[-1]).amax(0).float()
            stats[name] = torch.maximum(stats[name], x) if name in stats else x
        return record

    handles = [p.consumers[0].register_forward_hook(hook(p.name)) for p in pairs]
    try:
        for start in range(0, images.shape[0], batch_size):
            adapter.encode(images[start:start + batch_size])
    finally:
        for h in handles:
            h.remove()
    return stats


def scales(absmax: torch.Tensor, consumers: Sequence[nn.Linear], alpha: float) -> torch.Tensor:
    w = torch.stack([c.weight.detach().abs().amax(0) for c in consumers]).amax(0).float()
    s = absmax.clamp(min=1e-5).pow(alpha) / w.clamp(min=1e-5).pow(1.0 - alpha)
    return s.clamp(1e-4, 1e4)


@torch.no_grad()
def fold(pairs: Sequence[SmoothPair], absmax: dict[str, torch.Tensor], alpha: float) -> dict[str, float]:
    """Fold the scales into the model in place; returns each pair's activation range ratio before
    and after (max over median of the channels' |max|): how much flatter the channels became."""
    report = {}
    for p in pairs:
        s = scales(absmax[p.name], p.consumers, alpha)
        prod = p.producer
        if isinstance(prod, nn.LayerNorm):
            prod.weight.div_(s.to(prod.weight.dtype))
            if prod.bias is not None:
                prod.bias.div_(s.to(prod.bias.dtype))
        elif isinstance(prod, nn.Linear):
            prod.weight.div_(s[:, None].to(prod.weight.dtype))
            if prod.bias is not None:
                prod.bias.div_(s.to(prod.bias.dtype))
        else:
            raise TypeError(f"{p.name}: cannot fold a scale into {type(prod).__name__}")
        for c in p.consumers:
            c.weight.mul_(s.to(c.weight.dtype))
        a = absmax[p.name]
        report[p.name] = {"before": float(a.max() / a.median().clamp(min=1e-9)),
                          "after": float((a / s).max() / (a / s).median().clamp(min=1e-9))}
    return report


@torch.no_grad()
def smoothed_copy(adapter, images: torch.Tensor, alpha: float):
    """A copy of ``adapter`` with SmoothQuant folded in at the adapter's ``smoothing_pairs``, from the
    activation maxima over ``images``; ``adapter`` is left as it is. Returns the copy and
    :func:`fold`'s report."""
    smoothed = copy.deepcopy(adapter)
    pairs = smoothed.smoothing_pairs()
    if not pairs:
        raise PipelineError(f"quantize.smoothquant: model family {smoothed.family!r} names no places to fold "
                            f"SmoothQuant into (its adapter's smoothing_pairs); set quantize.smoothquant=null")
    return smoothed, fold(pairs, input_absmax(smoothed, pairs, images), alpha)
