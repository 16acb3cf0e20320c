"""The three graphs a seq2seq deployment runs: encoder, decoder first step, decoder step with past.

The torch decoder re-runs the whole prefix at every step. The adapter's cached decoder
(:meth:`ModelAdapter.cached_decoder`) keeps, per layer, the self-attention K/V of the tokens already
read (``past``) and the cross-attention K/V of the encoder memory (computed once by the first
step), so a step costs O(1) in the sequence length. These wrappers give it the fixed input and
output lists an ONNX graph needs.
"""
from __future__ import annotations

import torch
from torch import nn


class EncoderGraph(nn.Module):
    """images [B, C, H, W] -> memory [B, N, D]."""

    def __init__(self, adapter):
        super().__init__()
        self.encoder = adapter.encoder_module()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.encoder(images)


class KeptEncoderGraph(EncoderGraph):
    """images [B, C, H, W], keep [B, K] (kept patch indices, computed on the host by the package's token
    policy) -> memory [B, K, D]: the graph only gathers, its shapes never depend on the data."""

    def forward(self, images: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.encoder(images, keep)


class DecoderFirstGraph(nn.Module):
    """input_ids [B, T] (BOS, or any prefix), memory -> logits [B, V], present self K/V, cross K/V."""

    def __init__(self, cached: nn.Module):
        super().__init__()
        self.dec = cached

    def forward(self, input_ids: torch.Tensor, memory: torch.Tensor):
        cross = self.dec.cross_kv(memory)
        # the causal mask is built from shapes, so one graph serves any prefix length
        logits, present = self.dec.run(input_ids, [], cross, causal=True)
        return (logits, *present, *cross)


class DecoderStepGraph(nn.Module):
    """input_ids [B, 1], past self K/V [B, H, P, d], cross K/V -> logits [B, V], present [B, H, P+1, d]."""

    causal = every = False  # one new token: nothing to mask, its logits alone

    def __init__(self, cached: nn.Module):
        super().__init__()
        self.dec = cached

    def forward(self, input_ids: torch.Tensor, *kv: torch.Tensor):
        n = 2 * self.dec.num_layers
        past, cross = list(kv[:n]), list(kv[n:])
        logits, present = self.dec.run(input_ids, past, cross, causal=self.causal, every=self.every)
        return (logits, *present)


# tokens a decoder_verify call reads at most: the last written token and up to VERIFY_WIDTH - 1 drafts
# (package.json: verify_width). The batch (1) is fixed in the graph, the width is not: a call reads
# exactly the tokens it checks, and on this CPU a call costs about a step plus 0.15 ms a token more
# (docs/export.md), so a short draft pays where a padded 9-wide call would not
VERIFY_WIDTH = 9


class DecoderVerifyGraph(DecoderStepGraph):
    """input_ids [1, T] after past self K/V [1, H, P, d], cross K/V -> logits [1, T, V] (after each of the
    T tokens), present [1, H, P+T, d]: speculative decoding checks T drafted tokens in one call. Token i
    reads the past and new tokens 0..i (causal, offset by P), so its logits equal T single steps'."""

    causal = every = True


def io_names(num_layers: int) -> dict[str, list[str]]:
    past = [f"past_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    present = [f"present_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    cross = [f"cross_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    return {"past": past, "present": present, "cross": cross}
