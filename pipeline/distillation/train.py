"""Training the BPE student's decoder on cached encoder outputs: bounded, resumable, deterministic.

The batch order depends only on the step and the seed (one permutation of the images per epoch),
the learning rate only on the step (linear warm-up, cosine decay to a tenth), so a run is a function
of its step count: a checkpoint holds the model, the optimizer, the step, torch's RNG (dropout) and
the curve so far; a killed run started again with the same file continues to the weights an
uninterrupted run reaches (the weights' moving average too, ``Schedule.ema``). Checkpoints are
written to a temporary file and renamed, and read back with ``weights_only=True`` (tensors, numbers,
strings, lists and dicts only).
"""
from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm


@dataclass
class Schedule:
    steps: int            # optimizer steps of the whole run
    minutes: float        # wall-clock cap on the training steps (evaluation not counted)
    batch: int
    lr: float
    weight_decay: float = 0.01
    warmup: int = 50      # steps of linear warm-up
    seed: int = 0
    checkpoint_every: int = 100
    eval_every: int = 250  # steps between learning-curve points (0 = only at the start and the end)
    block_lr_scale: float = 1.0  # learning-rate factor for the copied decoder weights (the new rows get lr)
    freeze_cross_attention: bool = False  # the attention over the encoder output stays the char model's
    ema: float = 0.0      # decay of an exponential moving average of the trained weights (0 = none): the
                          # curve's points and the returned weights are the average's


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    return tuple(int(i) for i in np.random.default_rng([seed, epoch]).permutation(n))


def batch_indices(n: int, batch: int, step: int, seed: int) -> list[int]:
    """The images of ``step``'s batch: positions step*batch ... of a stream of per-epoch permutations."""
    return [_epoch_order(n, seed, pos // n)[pos % n] for pos in range(step * batch, (step + 1) * batch)]


def learning_rate(s: Schedule, step: int) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    t = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def pad_batch(targets: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
    width = max(len(t) for t in targets)
    seq = torch.full((len(targets), width), pad_id, dtype=torch.long)
    for r, t in enumerate(targets):
        seq[r, :len(t)] = torch.as_tensor(list(t), dtype=torch.long)
    return seq


def _save(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def train_decoder(student, memory: torch.Tensor, targets: Sequence[Sequence[int]], s: Schedule,
                  evaluate: Optional[Callable[[], dict]] = None, state_file: Optional[Path] = None,
                  progress: bool = False) -> dict:
    """AdamW on ``student.decoder_parameters()`` with cross-entropy on ``targets`` (BOS ... EOS ids)
    given ``memory`` [N, L, D] (the frozen encoder's outputs, any float dtype).

    ``evaluate()`` is called at step 0, every ``eval_every`` steps and at the end; its dict goes into
    the curve with the step, the training minutes and the mean loss since the previous point.
    Returns ``{"steps", "stopped_by", "minutes", "resumed_at", "curve", "losses"}``."""
    model = student.model
    params = student.decoder_parameters()
    frozen = student.cross_attention_parameters() if s.freeze_cross_attention else []
    if frozen:
        ids = {id(p) for p in frozen}
        params = [p for p in params if id(p) not in ids]
        for p in frozen:  # no gradient for them: the backward pass skips their weight gradients
            p.requires_grad_(False)
    fresh = {id(p) for p in student.vocabulary_parameters()} if s.block_lr_scale != 1.0 else set()
    groups = [{"params": [p for p in params if id(p) in fresh or not fresh], "scale": 1.0}]
    if fresh:
        groups.append({"params": [p for p in params if id(p) not in fresh], "scale": s.block_lr_scale})
    opt = torch.optim.AdamW(groups, lr=s.lr, weight_decay=s.weight_decay)
    if not 0.0 <= s.ema < 1.0:
        raise ValueError(f"ema must be in [0, 1), got {s.ema}")
    ema = [p.detach().clone() for p in params] if s.ema else []
    step, seconds, resumed, curve, losses = 0, 0.0, 0, [], []
    if state_file is not None and Path(state_file).is_file():
        saved = torch.load(state_file, map_location="cpu", weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["rng"])
        step = resumed = int(saved["step"])
        seconds, curve, losses = float(saved["seconds"]), list(saved["curve"]), list(saved["losses"])
        if ema:
            for e, v in zip(ema, saved["ema"]):
                e.copy_(v)

    def swap_ema() -> None:  # the average's weights into the model, the trained ones into the average
        with torch.no_grad():
            for e, p in zip(ema, params):
                held = p.detach().clone()
                p.copy_(e)
                e.copy_(held)

    def point() -> None:
        if evaluate is None:
            return
        since = losses[curve[-1]["step"]:] if curve else []
        swap_ema()
        try:
            row = evaluate()
        finally:
            swap_ema()
        curve.append({"step": step, "minutes": seconds / 60,
                      "loss": float(np.mean(since)) if since else None, **row})

    def checkpoint() -> None:
        if state_file is not None:
            _save(Path(state_file), {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                                     "rng": torch.get_rng_state(), "seconds": seconds, "curve": curve,
                                     "losses": losses, **({"ema": ema} if ema else {})})

    if not curve:
        point()
    stopped_by = "steps"
    bar = tqdm(total=s.steps, initial=step, desc="distill", disable=not progress)
    try:
        while step < s.steps:
            if seconds >= 60 * s.minutes:
                stopped_by = "minutes"
                break
            t0 = time.perf_counter()
            idx = batch_indices(len(targets), s.batch, step, s.seed)
            seq = pad_batch([targets[i] for i in idx], student.pad_id).to(student.device)
            for group in opt.param_groups:
                group["lr"] = learning_rate(s, step) * group["scale"]
            model.train()
            logits = student.decode_logits(seq[:, :-1], memory[idx].float())
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), seq[:, 1:].reshape(-1),
                                   ignore_index=student.pad_id)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            if ema:  # the average's decay ramps up over the first steps (it starts at the copied weights)
                decay = min(s.ema, (1 + step) / (10 + step))
                with torch.no_grad():
                    for e, p in zip(ema, params):
                        e.lerp_(p, 1.0 - decay)
            model.eval()
            step += 1
            seconds += time.perf_counter() - t0
            losses.append(float(loss.detach()))
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if s.eval_every and step % s.eval_every == 0 and step < s.steps:
                point()
            if s.checkpoint_every and step % s.checkpoint_every == 0:
                checkpoint()
    finally:
        bar.close()
        model.eval()
        for p in frozen:
            p.requires_grad_(True)
    if not curve or curve[-1]["step"] != step:
        point()
    if ema:
        swap_ema()  # the run's weights are the average's
    return {"steps": step, "stopped_by": stopped_by, "minutes": seconds / 60, "resumed_at": resumed,
            "curve": curve, "losses": losses}
