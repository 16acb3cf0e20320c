"""The three graphs a seq2seq deployment runs: encoder, decoder first step, decoder step with past.

The torch decoder re-runs the whole prefix at every step. The cached decoder keeps, per layer,
the self-attention K/V of the tokens already read (``past``) and the cross-attention K/V of the
encoder memory (computed once by the first step), so a step costs O(1) in the sequence length.

Pad tokens never enter a greedy sequence (pad and BOS are banned), so the torch decoder's
key-padding mask is all False and the cached graphs leave it out.
"""
from __future__ import annotations

import math

import torch
from torch import nn
import torch.nn.functional as F


def _heads(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    b, n, _ = x.shape
    return x.reshape(b, n, num_heads, head_dim).transpose(1, 2)  # [B, H, N, d]


def _attend(attn: nn.Module, q_in: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            causal_offset: int | torch.Tensor | None) -> torch.Tensor:
    """``attn`` (an ExplicitAttention) applied with K/V already projected and split into heads."""
    q = _heads(attn.q_proj(q_in), attn.num_heads, attn.head_dim)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(attn.head_dim))
    if causal_offset is not None:
        # query i (absolute position offset+i) may read keys 0 .. offset+i
        t, s = q.shape[2], k.shape[2]
        qpos = torch.arange(t, device=q.device)[:, None] + causal_offset
        kpos = torch.arange(s, device=q.device)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
    ctx = torch.matmul(F.softmax(scores, dim=-1), v)
    if attn.head_mask is not None:
        ctx = ctx * attn.head_mask.view(1, -1, 1, 1)
    b, _, n, _ = ctx.shape
    return attn.out_proj(ctx.transpose(1, 2).reshape(b, n, attn.num_heads * attn.head_dim))


class EncoderGraph(nn.Module):
    """images [B, C, H, W] -> memory [B, N, D]."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model.encode(images)


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
            out += [_heads(a.k_proj(memory), a.num_heads, a.head_dim), _heads(a.v_proj(memory), a.num_heads, a.head_dim)]
        return out

    def run(self, tokens: torch.Tensor, past: list[torch.Tensor], cross: list[torch.Tensor], causal: bool
            ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """tokens [B, T] after ``past`` (per layer k, v [B, H, P, d]; empty list: P = 0) -> last logits [B, V], present.

        ``causal``: mask future keys (a prefix of T > 1 tokens); a single new token reads every key.
        """
        offset = past[0].shape[2] if past else 0
        emb = self.model.decoder_embed
        positions = torch.arange(tokens.shape[1], device=tokens.device) + offset
        x = emb.norm(emb.token_emb(tokens) + emb.pos_emb(positions)[None])
        present = []
        for i, blk in enumerate(self.blocks):
            a = blk.self_attn
            h = blk.self_norm(x)
            k = _heads(a.k_proj(h), a.num_heads, a.head_dim)
            v = _heads(a.v_proj(h), a.num_heads, a.head_dim)
            if past:
                k = torch.cat([past[2 * i], k], dim=2)
                v = torch.cat([past[2 * i + 1], v], dim=2)
            present += [k, v]
            x = x + _attend(a, h, k, v, offset if causal else None)
            x = x + _attend(blk.cross_attn, blk.cross_norm(x), cross[2 * i], cross[2 * i + 1], None)
            x = x + blk.ffn(blk.ffn_norm(x))
        logits = self.model.lm_head(self.model.decoder_norm(x[:, -1])).float()
        return logits, present


class DecoderFirstGraph(nn.Module):
    """input_ids [B, T] (BOS, or any prefix), memory -> logits [B, V], present self K/V, cross K/V."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.dec = CachedDecoder(model)

    def forward(self, input_ids: torch.Tensor, memory: torch.Tensor):
        cross = self.dec.cross_kv(memory)
        # the causal mask is built from shapes, so one graph serves any prefix length
        logits, present = self.dec.run(input_ids, [], cross, causal=True)
        return (logits, *present, *cross)


class DecoderStepGraph(nn.Module):
    """input_ids [B, 1], past self K/V [B, H, P, d], cross K/V -> logits [B, V], present [B, H, P+1, d]."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.dec = CachedDecoder(model)

    def forward(self, input_ids: torch.Tensor, *kv: torch.Tensor):
        n = 2 * self.dec.num_layers
        past, cross = list(kv[:n]), list(kv[n:])
        logits, present = self.dec.run(input_ids, past, cross, causal=False)
        return (logits, *present)


def io_names(num_layers: int) -> dict[str, list[str]]:
    past = [f"past_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    present = [f"present_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    cross = [f"cross_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    return {"past": past, "present": present, "cross": cross}


@torch.no_grad()
def cached_greedy(model: nn.Module, memory: torch.Tensor, bos: int, eos: int, banned: list[int],
                  max_length: int) -> list[list[int]]:
    """Greedy decoding with the cached decoder in torch (the reference for the ONNX runner)."""
    first, step = DecoderFirstGraph(model).eval(), DecoderStepGraph(model).eval()
    n = memory.shape[0]
    nl = first.dec.num_layers
    tokens = torch.full((n, 1), bos, dtype=torch.long)
    outs = first(tokens, memory)
    logits, present, cross = outs[0], list(outs[1:1 + 2 * nl]), list(outs[1 + 2 * nl:])
    seqs = [[] for _ in range(n)]
    done = [False] * n
    for _ in range(max_length - 1):
        logits[:, banned] = float("-inf")
        nxt = logits.argmax(-1)
        for r in range(n):
            if not done[r]:
                seqs[r].append(int(nxt[r]))
                done[r] = int(nxt[r]) == eos
        if all(done) or len(seqs[0]) >= max_length - 1:
            break
        outs = step(nxt[:, None], *present, *cross)
        logits, present = outs[0], list(outs[1:])
    return seqs
