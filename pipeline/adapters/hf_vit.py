"""HF-style attention (separate q/k/v ``Linear``s, as in ViT, SigLIP, TrOCR): list and remove heads.

``transformers`` attention modules keep q/k/v and the output projection as separate ``nn.Linear``s
(``q_proj``/``k_proj``/``v_proj`` and ``o_proj`` in ViT, ``out_proj`` in SigLIP) and reshape with
``view(..., -1, head_dim)``, so removing a head is the same row/column slicing as for
:class:`~pipeline.adapters.attention.ExplicitAttention`:
:func:`~pipeline.adapters.attention.remove_heads_from_linears` serves both.

:class:`HFVisionEncoder` gives a ``transformers`` vision model (``ViTModel``,
``SiglipVisionModel`` ...) the structure half of the adapter interface (head counts, attention
per layer, head removal, the encoder as a module), which is what head scoring by weight norm,
selection, FLOP counting and removal need.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pipeline.adapters.attention import (HEAD_COUNT_NAMES, num_heads, out_projection_name,
                                        remove_heads_from_linears)
from pipeline.errors import PipelineError


def is_hf_attention(module: nn.Module) -> bool:
    return (all(isinstance(getattr(module, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj"))
            and out_projection_name(module) is not None and hasattr(module, "head_dim"))


def hf_attention_modules(model: nn.Module) -> list[nn.Module]:
    """Every HF-style attention module below ``model``, in forward (registration) order."""
    return [m for m in model.modules() if is_hf_attention(m)]


def remove_hf_heads(attn: nn.Module, remove: Sequence[int]) -> list[int]:
    """Remove heads from one HF-style attention module in place; returns the kept head indices."""
    out_name = out_projection_name(attn)
    if out_name is None or not is_hf_attention(attn):
        raise PipelineError(f"{type(attn).__name__} is not HF-style attention (q_proj/k_proj/v_proj/o_proj)")
    q, k, v, o, keep = remove_heads_from_linears(attn.q_proj, attn.k_proj, attn.v_proj, getattr(attn, out_name),
                                                 num_heads(attn), int(attn.head_dim), remove)
    attn.q_proj, attn.k_proj, attn.v_proj = q, k, v
    setattr(attn, out_name, o)
    for name in HEAD_COUNT_NAMES:  # forward reshapes with -1, the count is bookkeeping
        if hasattr(attn, name):
            setattr(attn, name, len(keep))
    if hasattr(attn, "all_head_size"):
        attn.all_head_size = len(keep) * int(attn.head_dim)
    return keep


class HFVisionEncoder:
    """The structure half of the adapter interface for a ``transformers`` vision encoder."""

    family = "hf_vit"

    def __init__(self, model: nn.Module, image_size: int, channels: int = 3):
        self.model = model.eval()
        self.image_size = int(image_size)
        self.channels = int(channels)
        if not hf_attention_modules(model):
            raise PipelineError(f"{type(model).__name__} has no HF-style attention (q_proj/k_proj/v_proj/o_proj) "
                                "to prune")

    @classmethod
    def from_config(cls, config) -> "HFVisionEncoder":
        """A randomly initialised ``ViTModel`` / ``SiglipVisionModel`` from its config (no download)."""
        from transformers import SiglipVisionConfig, SiglipVisionModel, ViTConfig, ViTModel

        if isinstance(config, ViTConfig):
            model = ViTModel(config, add_pooling_layer=False)
        elif isinstance(config, SiglipVisionConfig):
            model = SiglipVisionModel(config)
        else:
            raise PipelineError(f"unsupported HF vision config {type(config).__name__}")
        return cls(model, config.image_size, config.num_channels)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return self.channels, self.image_size, self.image_size

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=images).last_hidden_state

    def encoder_module(self) -> nn.Module:
        from pipeline.adapters.base import EncoderModule

        return EncoderModule(self).eval()

    def encoder_head_counts(self) -> list[int]:
        return [num_heads(a) for a in hf_attention_modules(self.model)]

    def encoder_attention(self, layer: int) -> nn.Module:
        return hf_attention_modules(self.model)[layer]

    def remove_encoder_heads(self, heads: dict[int, Sequence[int]]) -> None:
        attns = hf_attention_modules(self.model)
        for layer, remove in heads.items():
            if remove:
                remove_hf_heads(attns[int(layer)], remove)
