"""Recovery after head removal, distilled from the original model on rendered train-split formulas.

1. ``refit``: closed-form distillation of each attention output. Layer by layer, the output
   projection of the pruned model is refitted by ridge least squares so that, on the same images,
   its attention output matches the original model's (the kept heads' contexts are the features; the
   fit also absorbs the drift from earlier pruned layers). Seconds, deterministic, no labels.
2. ``finetune``: gradient steps on label cross-entropy + KL to the original's decoder logits + MSE
   to its encoder outputs, bounded by steps and minutes.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

from pipeline.pruning.heads import projections
from pipeline.pruning.scores import _batches, label_batch


class _Stop(Exception):
    """Raised by a hook to end a forward pass once the layer of interest has been seen."""


def _attns(adapter) -> list:
    return [adapter.encoder_attention(i) for i in range(len(adapter.encoder_head_counts()))]


@torch.no_grad()
def _collect_outputs(adapter, images: torch.Tensor, layers: Sequence[int], batch_size: int) -> dict[int, list]:
    """The original model's attention outputs (output projection results) at ``layers``, per batch."""
    outs: dict[int, list] = {l: [] for l in layers}
    handles = []
    for l in layers:
        o = projections(adapter.encoder_attention(l))[3]
        handles.append(o.register_forward_hook(lambda m, a, y, l=l: outs[l].append(y.detach().clone())))
    try:
        for sl in _batches(len(images), batch_size):
            adapter.encode(images[sl])
    finally:
        for h in handles:
            h.remove()
    return outs


@torch.no_grad()
def refit(student, teacher, images: torch.Tensor, layers: Sequence[int], ridge: float = 1e-3,
          batch_size: int = 8, progress: bool = False) -> dict[int, dict[str, float]]:
    """Refit the output projection of ``layers`` (in order); returns the relative error per layer
    before and after the fit on the fitting images."""
    student.model.eval()
    teacher.model.eval()
    targets = _collect_outputs(teacher, images, layers, batch_size)
    report = {}
    for l in tqdm(sorted(layers), desc="refit layers", disable=not progress):
        o = projections(student.encoder_attention(l))[3]
        feats: list[torch.Tensor] = []

        def grab(m, args):
            feats.append(args[0].detach().reshape(-1, args[0].shape[-1]).double())
            raise _Stop

        handle = o.register_forward_pre_hook(grab)
        xtx = xty = None
        err_before = norm = 0.0
        try:
            for b, sl in enumerate(_batches(len(images), batch_size)):
                feats.clear()
                try:
                    student.encode(images[sl])
                except _Stop:
                    pass
                x = feats[0]
                y = targets[l][b].reshape(-1, targets[l][b].shape[-1]).double()
                pred = x @ o.weight.double().T + (o.bias.double() if o.bias is not None else 0.0)
                err_before += float((pred - y).pow(2).sum())
                norm += float(y.pow(2).sum())
                x1 = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
                xtx = x1.T @ x1 if xtx is None else xtx + x1.T @ x1
                xty = x1.T @ y if xty is None else xty + x1.T @ y
        finally:
            handle.remove()
        reg = ridge * float(torch.diagonal(xtx).mean()) * torch.eye(len(xtx), dtype=xtx.dtype)
        reg[-1, -1] = 0.0  # the bias is not shrunk
        w = torch.linalg.solve(xtx + reg, xty)  # [in + 1, out]
        o.weight.copy_(w[:-1].T.to(o.weight.dtype))
        if o.bias is not None:
            o.bias.copy_(w[-1].to(o.bias.dtype))
        # residual after the fit, from the normal equations: |y|^2 - 2 w.xty + w.xtx.w
        err_after = norm - 2 * float((w * xty).sum()) + float((w * (xtx @ w)).sum())
        report[l] = {"rel_error_before": (err_before / norm) ** 0.5 if norm else 0.0,
                     "rel_error_after": max(err_after, 0.0) ** 0.5 / norm ** 0.5 if norm else 0.0}
    return report


def finetune(student, teacher, images: torch.Tensor, latex: Sequence[str], steps: int, minutes: float,
             lr: float = 5e-5, batch_size: int = 4, label_weight: float = 1.0, logit_weight: float = 1.0,
             memory_weight: float = 1.0, seed: int = 0, progress: bool = False) -> dict[str, float]:
    """A bounded number of AdamW steps; every weight of the pruned model trains, dropout off."""
    if steps <= 0 or minutes <= 0 or len(images) == 0:
        return {"steps": 0, "seconds": 0.0}
    model = student.model
    teacher.model.eval()
    model.eval()  # no dropout: the short run should be deterministic and not noisier than it must be
    params = [p for p in model.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(images), generator=gen).tolist()
    t0 = time.perf_counter()
    done, first, last = 0, None, None
    bar = tqdm(total=steps, desc="recovery finetune", disable=not progress)
    while done < steps and time.perf_counter() - t0 < 60 * minutes:
        start = (done * batch_size) % len(order)
        idx = (order + order)[start:start + batch_size]
        x = images[idx]
        inp, tgt = label_batch(student, [latex[i] for i in idx])
        with torch.no_grad():
            t_mem = teacher.encode(x)
            t_logits = teacher.decode_logits(inp, t_mem).float()
        mem = student.encode(x)
        logits = student.decode_logits(inp, mem).float()
        mask = tgt.ne(student.pad_id)
        ce = F.cross_entropy(logits[mask], tgt[mask])
        kl = F.kl_div(F.log_softmax(logits[mask], -1), F.log_softmax(t_logits[mask], -1),
                      log_target=True, reduction="batchmean")
        mse = F.mse_loss(mem, t_mem) / t_mem.var().clamp_min(1e-8)
        loss = label_weight * ce + logit_weight * kl + memory_weight * mse
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        done += 1
        value = float(loss)
        first = value if first is None else first
        last = value
        bar.update(1)
        bar.set_postfix(loss=f"{value:.3f}")
    bar.close()
    for p in params:
        p.requires_grad_(False)
    return {"steps": done, "seconds": time.perf_counter() - t0, "first_loss": first, "last_loss": last}
