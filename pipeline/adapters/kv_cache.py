"""KV-cached decoding for the latex-ocr-junia decoder (ExplicitAttention inside), in torch.

The shipped decoder re-runs the whole prefix at every step, re-projecting the encoder memory into
cross-attention K/V each time. This decoder keeps, per layer, the self-attention K/V of the tokens
already read (``past``) and the cross-attention K/V of the memory (computed once), so a step
costs O(1) in the sequence length. Same function: greedy tokens equal the full recompute's.

Pad tokens never enter a greedy sequence (pad and BOS are banned), so the full decoder's
key-padding mask is all False and the cached one leaves it out.
"""
from __future__ import annotations

import math

import torch
from torch import nn
import torch.nn.functional as F


def split_heads(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    b, n, _ = x.shape
    return x.reshape(b, n, num_heads, head_dim).transpose(1, 2)  # [B, H, N, d]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int | torch.Tensor | None,
           head_dim: int) -> torch.Tensor:
    """softmax(q kᵀ / √d) v on heads split out ([B, H, T, d] / [B, H, S, d]): the attention every cached
    decoder (this one, the HF adapter's) exports. ``causal_offset``: query i sits at absolute position
    offset + i and reads keys 0 .. offset + i; None: every key."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(head_dim))
    if causal_offset is not None:
        t, s = q.shape[2], k.shape[2]
        qpos = torch.arange(t, device=q.device)[:, None] + causal_offset
        kpos = torch.arange(s, device=q.device)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return torch.matmul(F.softmax(scores, dim=-1), v)


def merge_heads(ctx: torch.Tensor, like: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """[B, H, T, d] -> [B, T, H·d] with the sizes taken from the block's input ``like``, not from ctx: in
    an exported graph ctx then feeds the head merge alone, the pattern ORT's MultiHeadAttention fusion
    takes (pipeline/export/fusion.py)."""
    b, n = like.shape[0], like.shape[1]  # read before the transpose: the graph keeps its node order
    return ctx.transpose(1, 2).reshape(b, n, num_heads * head_dim)


def _attend(attn: nn.Module, q_in: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            causal_offset: int | torch.Tensor | None) -> torch.Tensor:
    """``attn`` (an ExplicitAttention) applied with K/V already projected and split into heads."""
    ctx = attend(split_heads(attn.q_proj(q_in), attn.num_heads, attn.head_dim), k, v, causal_offset, attn.head_dim)
    if attn.head_mask is not None:
        ctx = ctx * attn.head_mask.view(1, -1, 1, 1)
    return attn.out_proj(merge_heads(ctx, q_in, attn.num_heads, attn.head_dim))


class CachedDecoder(nn.Module):
    """The decoder of a latex-ocr-junia model (ExplicitAttention inside) with a KV cache."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.blocks = model.decoder_blocks

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    def cross_kv(self, memory: torch.Tensor) -> list[torch.Tensor]:
        """Per layer: cross-attention K and V of the memory, [B, H, N, d] each (k0, v0, k1, v1 ...)."""
        out = []
        for blk in self.blocks:
            a = blk.cross_attn
            out += [split_heads(a.k_proj(memory), a.num_heads, a.head_dim), split_heads(a.v_proj(memory), a.num_heads, a.head_dim)]
        return out

    def run(self, tokens: torch.Tensor, past: list[torch.Tensor], cross: list[torch.Tensor], causal: bool,
            every: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """tokens [B, T] after ``past`` (per layer k, v [B, H, P, d]; empty list: P = 0) -> last logits [B, V]
        (``every``: the logits after each of the T tokens, [B, T, V]), present.

        ``causal``: mask future keys (T > 1 tokens, after a past or not); a single new token reads every key.
        """
        offset = past[0].shape[2] if past else 0
        emb = self.model.decoder_embed
        positions = torch.arange(tokens.shape[1], device=tokens.device) + offset
        x = emb.norm(emb.token_emb(tokens) + emb.pos_emb(positions)[None])
        present = []
        for i, blk in enumerate(self.blocks):
            a = blk.self_attn
            h = blk.self_norm(x)
            k = split_heads(a.k_proj(h), a.num_heads, a.head_dim)
            v = split_heads(a.v_proj(h), a.num_heads, a.head_dim)
            if past:
                k = torch.cat([past[2 * i], k], dim=2)
                v = torch.cat([past[2 * i + 1], v], dim=2)
            present += [k, v]
            x = x + _attend(a, h, k, v, offset if causal else None)
            x = x + _attend(blk.cross_attn, blk.cross_norm(x), cross[2 * i], cross[2 * i + 1], None)
            x = x + blk.ffn(blk.ffn_norm(x))
        logits = self.model.lm_head(self.model.decoder_norm(x if every else x[:, -1])).float()
        return logits, present
