"""Multi-head attention with explicit q/k/v/out projections, and head removal on it.

``nn.MultiheadAttention`` packs q/k/v into one matrix and cannot hold fewer heads than
``embed_dim / head_dim``; ModelOpt does not quantize its internals, ORT does not fuse it and the
legacy ONNX exporter bakes its reshapes to traced shapes. :class:`ExplicitAttention` computes the
same function with four ``nn.Linear`` layers whose inner width is ``num_heads * head_dim``, so a
head is a slice of rows of q/k/v and of columns of out — the layout HF models (ViT, SigLIP,
TrOCR) already use, which is why :func:`remove_heads_from_linears` serves both.
"""
from __future__ import annotations

import contextlib
import math
from typing import Sequence

import torch
from torch import nn
import torch.nn.functional as F


class ExplicitAttention(nn.Module):
    """Drop-in for ``nn.MultiheadAttention(batch_first=True)`` in eval and training use."""

    def __init__(self, embed_dim: int, num_heads: int, head_dim: int, dropout: float = 0.0,
                 bias: bool = True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.dropout = dropout
        inner = num_heads * head_dim
        self.q_proj = nn.Linear(embed_dim, inner, bias=bias)
        self.k_proj = nn.Linear(embed_dim, inner, bias=bias)
        self.v_proj = nn.Linear(embed_dim, inner, bias=bias)
        self.out_proj = nn.Linear(inner, embed_dim, bias=bias)
        # Optional per-head gate (1.0 = head on). Used for gradient-based head importance; a
        # buffer, so it is saved with the model but is not trained.
        self.register_buffer("head_mask", None, persistent=False)
        # key/value pooling (:meth:`pool_keys`): (rows, cols, window rows, window cols) or None
        self.key_pool: tuple[int, int, int, int] | None = None
        # an additive bias on the scores, [B, 1, N, N] broadcast over the heads, set for one encoder pass by
        # :func:`keys_weighted` (proportional attention); None: none
        self.key_bias: torch.Tensor | None = None

    def pool_keys(self, grid: tuple[int, int], window: tuple[int, int]) -> None:
        """Attend to window means of the keys and values instead of every token: the key and value
        tokens (row-major patches of a ``grid``) are averaged over each ``window`` of patches before
        their projections (affine, so the same as averaging the projected keys), PVT's
        spatial-reduction attention. Queries and the output keep every token; the score and context
        products shrink by the window's size. ``(1, 1)`` turns it off."""
        (rows, cols), (wr, wc) = grid, window
        if wr < 1 or wc < 1 or rows % wr or cols % wc:
            raise ValueError(f"a {wr}x{wc} window does not tile the {rows}x{cols} patch grid")
        self.key_pool = None if (wr, wc) == (1, 1) else (rows, cols, wr, wc)

    @classmethod
    def from_mha(cls, mha: nn.MultiheadAttention) -> "ExplicitAttention":
        if not mha.batch_first:
            raise ValueError("only batch_first MultiheadAttention is supported")
        if not mha._qkv_same_embed_dim:
            raise ValueError("MultiheadAttention with separate kdim/vdim is not supported")
        e, h = mha.embed_dim, mha.num_heads
        new = cls(e, h, e // h, dropout=mha.dropout, bias=mha.in_proj_bias is not None)
        w = mha.in_proj_weight.detach()
        with torch.no_grad():
            new.q_proj.weight.copy_(w[:e]); new.k_proj.weight.copy_(w[e:2 * e]); new.v_proj.weight.copy_(w[2 * e:])
            if mha.in_proj_bias is not None:
                b = mha.in_proj_bias.detach()
                new.q_proj.bias.copy_(b[:e]); new.k_proj.bias.copy_(b[e:2 * e]); new.v_proj.bias.copy_(b[2 * e:])
            new.out_proj.weight.copy_(mha.out_proj.weight.detach())
            if mha.out_proj.bias is not None:
                new.out_proj.bias.copy_(mha.out_proj.bias.detach())
        return new.to(mha.out_proj.weight.device, mha.out_proj.weight.dtype)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, N, d]

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None,
                need_weights: bool = False) -> tuple[torch.Tensor, None]:
        """Same contract as MHA: boolean masks are True where attention is *not* allowed."""
        if self.num_heads == 0:  # every head removed: the block contributes only the out bias
            out = query.new_zeros(query.shape[:-1] + (self.embed_dim,))
            return (out + self.out_proj.bias if self.out_proj.bias is not None else out), None
        if self.key_pool is not None:
            pooled = pool_patch_tokens(key, *self.key_pool)
            value = pooled if value is key else pool_patch_tokens(value, *self.key_pool)
            key = pooled
        q = self._split(self.q_proj(query))
        k = self._split(self.k_proj(key))
        v = self._split(self.v_proj(value))
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim))
        if self.key_bias is not None:
            scores = scores + self.key_bias
        if attn_mask is not None:
            scores = _apply_mask(scores, attn_mask[None, None] if attn_mask.dim() == 2 else attn_mask)
        if key_padding_mask is not None:
            scores = _apply_mask(scores, key_padding_mask[:, None, None, :])
        probs = F.softmax(scores, dim=-1)
        if self.training and self.dropout > 0:
            probs = F.dropout(probs, p=self.dropout)
        ctx = torch.matmul(probs, v)  # [B, H, N, d]
        if self.head_mask is not None:
            ctx = ctx * self.head_mask.view(1, -1, 1, 1)
        b, _, n, _ = ctx.shape
        ctx = ctx.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim)
        return self.out_proj(ctx), None


def pool_patch_tokens(x: torch.Tensor, rows: int, cols: int, wr: int, wc: int) -> torch.Tensor:
    """[B, rows·cols, D] patch tokens in row-major order -> [B, rows/wr · cols/wc, D], the mean of
    each ``wr`` × ``wc`` window of patches (row-major)."""
    d = x.shape[-1]
    return x.reshape(-1, rows // wr, wr, cols // wc, wc, d).mean(dim=(2, 4)).reshape(-1, (rows // wr) * (cols // wc), d)


def stand_for(keep: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
    """[B, K] kept patch indices -> [B, K] float counts: how many patches of the grid each kept one stands for
    (itself and those nearest it; squared grid distance, the first of a tie), in ops an exported graph keeps (no
    data-dependent shape): the package computes it from its ``keep`` input, so a runtime passes nothing more."""
    n = grid_h * grid_w
    cells = torch.arange(n, device=keep.device)
    # integers throughout (exact in any precision a target converts the graph's floats to), no Cast: the
    # counts come out of a Where on float constants
    d = (cells[None, :, None] // grid_w - keep[:, None, :] // grid_w) ** 2 + \
        (cells[None, :, None] % grid_w - keep[:, None, :] % grid_w) ** 2  # [B, patches, K]
    owner = d.argmin(-1)  # [B, patches]
    slots = torch.arange(keep.shape[1], device=keep.device)
    one = torch.ones((), dtype=torch.float32, device=keep.device)
    return torch.where(owner[:, :, None] == slots[None, None, :], one, 0 * one).sum(1)


def proportional_bias(counts: torch.Tensor, specials: int = 0) -> torch.Tensor:
    """[B, K] counts -> the scores' bias [B, 1, S + K, S + K]: log(count) on each key (0 on the S special
    tokens), the same for every query (ToMe's proportional attention: softmax then weighs a kept key as
    ``count`` copies of it). Expanded to the square, the layout ONNX Runtime's MultiHeadAttention takes."""
    bias = torch.log(counts)
    if specials:
        bias = torch.cat([bias.new_zeros(bias.shape[0], specials), bias], 1)
    n = bias.shape[1]
    return bias[:, None, None, :].expand(-1, 1, n, -1)


@contextlib.contextmanager
def keys_weighted(modules: Sequence[nn.Module], bias: torch.Tensor | None):
    """Every :class:`ExplicitAttention` below ``modules`` adds ``bias`` to its scores inside the block."""
    attns = [m for mod in modules for m in mod.modules() if isinstance(m, ExplicitAttention)] if bias is not None else []
    for a in attns:
        a.key_bias = bias
    try:
        yield
    finally:
        for a in attns:
            a.key_bias = None


def reads_key_bias(modules: Sequence[nn.Module]) -> bool:
    """Whether every one of ``modules`` (encoder layers) attends through an :class:`ExplicitAttention`."""
    return bool(modules) and all(any(isinstance(m, ExplicitAttention) for m in mod.modules()) for mod in modules)


def _apply_mask(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return scores.masked_fill(mask, float("-inf"))
    return scores + mask


def replace_mha(module: nn.Module) -> int:
    """Replace every ``nn.MultiheadAttention`` below ``module`` by :class:`ExplicitAttention`."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.MultiheadAttention):
            setattr(module, name, ExplicitAttention.from_mha(child))
            count += 1
        else:
            count += replace_mha(child)
    return count


# ---- a head's view of any attention with separate q/k/v/out Linears (ExplicitAttention, HF-style):
# the one definition; pruning (pipeline/pruning/heads.py) and the HF adapter (hf_vit.py) use these
OUT_NAMES = ("out_proj", "o_proj")                      # the output projection's name by family
HEAD_COUNT_NAMES = ("num_heads", "num_attention_heads")


def out_projection_name(attn: nn.Module) -> str | None:
    """Name of the output projection ``Linear`` (``out_proj``, ``o_proj``), None when there is none."""
    for name in OUT_NAMES:
        if isinstance(getattr(attn, name, None), nn.Linear):
            return name
    return None


def projections(attn: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]:
    """q, k, v and output projection ``Linear``s; TypeError for a module without them."""
    out = out_projection_name(attn)
    q, k, v = (getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj"))
    if out is None or not all(isinstance(m, nn.Linear) for m in (q, k, v)):
        raise TypeError(f"{type(attn).__name__} has no explicit q/k/v/out Linear projections")
    return q, k, v, getattr(attn, out)  # type: ignore[return-value]


def num_heads(attn: nn.Module) -> int:
    """The head count the module states, else q's width over ``head_dim``."""
    for name in HEAD_COUNT_NAMES:
        if hasattr(attn, name):
            return int(getattr(attn, name))
    q, d = getattr(attn, "q_proj", None), getattr(attn, "head_dim", None)
    if isinstance(q, nn.Linear) and d:
        return q.out_features // int(d)
    raise TypeError(f"{type(attn).__name__} does not say how many heads it has")


def head_slices(heads: Sequence[int], head_dim: int) -> torch.Tensor:
    return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads]) if heads \
        else torch.zeros(0, dtype=torch.long)


def remove_heads_from_linears(q: nn.Linear, k: nn.Linear, v: nn.Linear, o: nn.Linear,
                              num_heads: int, head_dim: int, remove: Sequence[int]
                              ) -> tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear, list[int]]:
    """Return q/k/v/out ``Linear``s without the heads in ``remove`` (rows of q/k/v, columns of out)."""
    remove = sorted(set(int(h) for h in remove))
    bad = [h for h in remove if not 0 <= h < num_heads]
    if bad:
        raise ValueError(f"head index out of range {bad} for {num_heads} heads")
    keep = [h for h in range(num_heads) if h not in remove]
    idx = head_slices(keep, head_dim)
    return (_slice_linear(q, idx, dim=0), _slice_linear(k, idx, dim=0),
            _slice_linear(v, idx, dim=0), _slice_linear(o, idx, dim=1), keep)


def _slice_linear(lin: nn.Linear, idx: torch.Tensor, dim: int) -> nn.Linear:
    w = lin.weight.detach().index_select(dim, idx.to(lin.weight.device))
    out_f, in_f = w.shape
    new = nn.Linear(in_f, out_f, bias=lin.bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        new.weight.copy_(w)
        if lin.bias is not None:
            new.bias.copy_(lin.bias.detach().index_select(0, idx.to(w.device)) if dim == 0 else lin.bias.detach())
    return new


def remove_heads(attn: ExplicitAttention, remove: Sequence[int]) -> list[int]:
    """Remove heads from an :class:`ExplicitAttention` in place; returns the kept original indices."""
    attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj, keep = remove_heads_from_linears(
        attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj, attn.num_heads, attn.head_dim, remove)
    attn.num_heads = len(keep)
    attn.head_mask = None
    return keep
