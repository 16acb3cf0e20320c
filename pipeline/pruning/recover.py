"""Recovery after head removal, distilled from the original model on rendered train-split formulas.

1. ``refit``: closed-form distillation of each block. Layer by layer, from the first pruned one,
   the attention output projection and then the MLP output projection of the pruned model are
   refitted by ridge least squares so that, on the same images, the residual stream after the
   attention and after the block matches the original model's (the fit also absorbs the drift
   from earlier pruned layers). The ridge penalty is on the distance from the current weights, so a
   layer with nothing to fix keeps its weights. Deterministic, no labels; each block runs alone on its
   inputs (kept per batch) rather than the encoder from the image up to it.
2. ``distill``: block-wise gradient distillation. Layer by layer, every weight of the block is
   trained (Adam) so that, from the pruned model's own input to that block, its output matches the
   original block's output. Only one block is in the graph at a time (no decoder, no full encoder
   backward), so it is cheap enough to run on a few hundred images; starting from the refit.
3. ``finetune``: gradient steps on label cross-entropy + KL to the original's decoder logits + MSE
   to its encoder outputs, bounded by steps and minutes.
"""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from pipeline import interrupts
from pipeline.pruning.heads import projections
from pipeline.pruning.scores import _batches, id_batch, label_batch


class _Stop(Exception):
    """Raised by a hook to end a forward pass once the layer of interest has been seen."""


def _block_of(model: nn.Module, attn: nn.Module) -> nn.Module:
    """The encoder block holding ``attn`` (its parent module)."""
    for m in model.modules():
        if any(c is attn for c in m.children()):
            return m
    raise ValueError("attention module not found in the model")


def _last_linear(block: nn.Module, attn: nn.Module) -> nn.Linear | None:
    """The block's MLP output projection: its last ``Linear`` outside the attention."""
    inside = {id(m) for m in attn.modules()}
    lins = [m for m in block.modules() if isinstance(m, nn.Linear) and id(m) not in inside]
    return lins[-1] if lins else None


def _first_tensor(args, kwargs) -> torch.Tensor:
    if args and torch.is_tensor(args[0]):
        return args[0]
    return next(v for v in kwargs.values() if torch.is_tensor(v))


def _out_tensor(y) -> torch.Tensor:
    return y if torch.is_tensor(y) else y[0]


class _Solver:
    """Ridge least squares ``y ~ x W + b`` from streamed batches (float64 normal equations), the
    penalty on the distance from the layer's current weights."""

    def __init__(self) -> None:
        self.xtx = self.xty = None
        self.yy = 0.0

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.reshape(-1, x.shape[-1]).double(), y.reshape(-1, y.shape[-1]).double()
        self.yy += float(y.pow(2).sum())
        x1 = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
        self.xtx = x1.T @ x1 if self.xtx is None else self.xtx + x1.T @ x1
        self.xty = x1.T @ y if self.xty is None else self.xty + x1.T @ y

    def solve_into(self, lin: nn.Linear, ridge: float) -> dict[str, float]:
        reg = ridge * float(torch.diagonal(self.xtx).mean()) * torch.eye(len(self.xtx), dtype=self.xtx.dtype)
        reg[-1, -1] = 0.0  # the bias is not shrunk
        # shrunk towards the current weights, not towards zero: where the data do not ask for a
        # change (an unpruned layer whose input did not drift) the layer stays as it was
        w0 = torch.cat([lin.weight.double().T, (lin.bias.double() if lin.bias is not None
                                                 else torch.zeros(lin.out_features, dtype=torch.float64))[None]])
        w = torch.linalg.solve(self.xtx + reg, self.xty + reg @ w0)  # [in + 1, out]
        lin.weight.copy_(w[:-1].T.to(lin.weight.dtype))
        if lin.bias is not None:
            lin.bias.copy_(w[-1].to(lin.bias.dtype))
        # residuals before and after the fit, from the normal equations: |y|^2 - 2 w.xty + w.xtx.w
        # (no second pass over the data for the error of the current weights)
        norm = max(self.yy, 1e-30)
        return {f"rel_error_{when}": max(self._residual(v), 0.0) ** 0.5 / norm ** 0.5
                for when, v in (("before", w0), ("after", w))}

    def _residual(self, w: torch.Tensor) -> float:
        return self.yy - 2 * float((w * self.xty).sum()) + float((w * (self.xtx @ w)).sum())


def _stopped_runs(runs, hooks: list):
    """Each of ``runs`` (one batch's forward each) until a hook raises ``_Stop``; yields the batch
    index once its hooks have seen it, then removes the hooks."""
    try:
        for b, run in enumerate(runs):
            try:
                run()
            except _Stop:
                pass
            yield b
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def _hooked_passes(student, images, batch_size: int, hooks: list):
    """Encode batch by batch (:func:`_stopped_runs`): a real pass from the image."""
    yield from _stopped_runs((lambda sl=sl: student.encode(images[sl]) for sl in _batches(len(images), batch_size)),
                             hooks)


def _teacher_targets(teacher, images: torch.Tensor, layers: Sequence[int], batch_size: int,
                     after_attention: bool = True) -> dict:
    """Per layer and batch: the original's residual stream after attention (block input + attention
    output; only with ``after_attention``) and after the whole block."""
    out: dict[int, dict[str, list]] = {l: {"h": [], "y": []} for l in layers}
    handles = []
    for l in layers:
        attn = teacher.encoder_attention(l)
        block = _block_of(teacher.model, attn)
        o = projections(attn)[3]
        state: dict = {}
        if after_attention:
            handles.append(block.register_forward_pre_hook(
                lambda m, a, k, s=state: s.__setitem__("x", _first_tensor(a, k)), with_kwargs=True))
            handles.append(o.register_forward_hook(
                lambda m, a, y, s=state, l=l: out[l]["h"].append((s["x"] + y).detach().clone())))
        handles.append(block.register_forward_hook(lambda m, a, y, l=l: out[l]["y"].append(_out_tensor(y).detach().clone())))
    try:
        for sl in _batches(len(images), batch_size):
            teacher.encode(images[sl])
    finally:
        for h in handles:
            h.remove()
    return out


def _block_calls(student, images, batch_size: int, block: nn.Module) -> list[tuple[tuple, dict]]:
    """Per batch, the arguments ``block`` is called with: a pass of each batch stopped there."""
    calls: list[tuple[tuple, dict]] = []

    def pre(m, a, k):
        calls.append((a, k))
        raise _Stop

    for _ in _hooked_passes(student, images, batch_size, [block.register_forward_pre_hook(pre, with_kwargs=True)]):
        pass
    return calls


def _with_input(call: tuple[tuple, dict], x: torch.Tensor) -> tuple[tuple, dict]:
    """``call`` with its first tensor (the block's input) replaced by ``x``."""
    a, k = call
    if a and torch.is_tensor(a[0]):
        return (x, *a[1:]), k
    key = next(name for name, v in k.items() if torch.is_tensor(v))
    return a, {**k, key: x}


def _only_input(call: tuple[tuple, dict]) -> bool:
    a, k = call
    return sum(torch.is_tensor(v) for v in (*a, *k.values())) == 1


@torch.no_grad()
def refit(student, teacher, images: torch.Tensor, layers: Sequence[int], ridge: float = 1e-3,
          batch_size: int = 8, progress: bool = False, replay: bool = True) -> dict[int, dict[str, float]]:
    """Layer by layer (in order), refit the attention output projection so that block input +
    attention output matches the original's, then the MLP output projection so that the block
    output matches the original's. Assumes pre-norm blocks ending in ``h + Linear(...)``, as ViT,
    SigLIP and the default model are built. Returns relative errors before/after each fit.

    ``replay``: each block runs alone on its inputs, kept per batch, and its output (after its refit)
    is the next block's input, instead of the encoder running from the image to the block twice a
    layer (5.5 encoder passes for four layers become 3.5; the forward passes are ~3/4 of the refit).
    The same batches through the same modules: the weights are bit for bit those of ``replay=False``
    (tested). Where the next block's input is not the previous block's output (checked on the first
    batch against a real pass) or a block takes more than its input, it falls back to real passes."""
    student.model.eval()
    teacher.model.eval()
    targets = _teacher_targets(teacher, images, layers, batch_size)
    report: dict[int, dict[str, float]] = {}
    order = sorted(layers)
    calls: list[tuple[tuple, dict]] | None = None  # the current block's arguments per batch (replay)
    for i, l in enumerate(tqdm(order, desc="refit layers", disable=not progress)):
        attn = student.encoder_attention(l)
        block = _block_of(student.model, attn)
        o = projections(attn)[3]
        fc2 = _last_linear(block, attn)
        if replay and calls is None:
            calls = _block_calls(student, images, batch_size, block)
            if not all(_only_input(c) for c in calls):
                calls, replay = None, False
        # 1) attention output projection: features = kept heads' contexts, target = h_T - x_S
        solver, state = _Solver(), {}

        def pre_block(m, a, k):
            state["x"] = _first_tensor(a, k)

        def pre_out(m, a):
            state["c"] = a[0]
            raise _Stop

        hs = [block.register_forward_pre_hook(pre_block, with_kwargs=True), o.register_forward_pre_hook(pre_out)]
        for b in _passes(student, images, batch_size, hs, block, calls):
            solver.add(state["c"], targets[l]["h"][b] - state["x"])
        entry = {f"attn_{k}": v for k, v in solver.solve_into(o, ridge).items()}
        # 2) MLP output projection: features = its input, target = y_T - (y_S - fc2 output)
        if fc2 is not None:
            solver = _Solver()

            def fc2_hook(m, a, y):
                state["g"], state["o"] = a[0], y

            def block_hook(m, a, y):
                state["y"] = _out_tensor(y)
                raise _Stop

            hs = [fc2.register_forward_hook(fc2_hook), block.register_forward_hook(block_hook)]
            for b in _passes(student, images, batch_size, hs, block, calls):
                solver.add(state["g"], targets[l]["y"][b] - (state["y"] - state["o"]))
            entry.update({f"mlp_{k}": v for k, v in solver.solve_into(fc2, ridge).items()})
        report[l] = entry
        if calls is not None and i + 1 < len(order):  # the refitted block's output: the next block's input
            nxt = _block_of(student.model, student.encoder_attention(order[i + 1]))
            probe = _block_calls(student, images[:batch_size], batch_size, nxt)[0]
            outs = [_out_tensor(block(*a, **k)) for a, k in calls]
            if _only_input(probe) and torch.equal(_first_tensor(*probe), outs[0]):
                calls = [_with_input(probe, x) for x in outs]
            else:  # not a chain of blocks: the next layers read real passes
                calls, replay = None, False
    return report


def _passes(student, images, batch_size: int, hooks: list, block: nn.Module, calls):
    """Yields each batch's index once ``hooks`` have seen it: a real pass from the image
    (:func:`_hooked_passes`), or ``block`` alone on its kept arguments (``calls``); then removes them."""
    if calls is None:
        yield from _hooked_passes(student, images, batch_size, hooks)
    else:
        yield from _stopped_runs((lambda a=a, k=k: block(*a, **k) for a, k in calls), hooks)


@contextlib.contextmanager
def _trainable(params: Sequence[nn.Parameter]):
    """Every parameter takes gradients inside; each gets its own ``requires_grad`` back after."""
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


def _unit_norm(y: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(y, y.shape[-1:])


def distill(student, teacher, images: torch.Tensor, layers: Sequence[int], epochs: int = 4, lr: float = 1e-3,
            batch_size: int = 8, minutes: float = 10.0, seed: int = 0,
            progress: bool = False) -> dict[int, dict[str, float]]:
    """Layer by layer (in order), Adam on every weight of the block so that its output, from the
    pruned model's own block input, matches the original block's output (MSE after a parameter-free
    LayerNorm, cosine-annealed learning rate); a block whose error did not go down is restored. Each layer
    gets an equal share of ``minutes``. Returns relative errors before/after and the steps taken."""
    student.model.eval()
    teacher.model.eval()
    layers = sorted(layers)
    if not layers or epochs <= 0 or minutes <= 0 or len(images) == 0:
        return {}
    with torch.no_grad():
        targets = _teacher_targets(teacher, images, layers, batch_size, after_attention=False)
    gen = torch.Generator().manual_seed(seed)
    report: dict[int, dict[str, float]] = {}
    for l in tqdm(layers, desc="distill layers", disable=not progress):
        block = _block_of(student.model, student.encoder_attention(l))
        state: dict = {}

        def pre_block(m, a, k):
            state["x"] = _first_tensor(a, k).detach().clone()
            raise _Stop

        xs = []
        for _ in _hooked_passes(student, images, batch_size, [block.register_forward_pre_hook(pre_block, with_kwargs=True)]):
            xs.append(state["x"])
        x_all, y_all = torch.cat(xs), torch.cat(targets.pop(l)["y"])
        # compared after a parameter-free LayerNorm: what the next block (and the final norm) sees;
        # raw residual-stream errors are dominated by a large common component that the norm removes
        y_all = _unit_norm(y_all)

        def rel_error() -> float:
            with torch.no_grad():
                err = sum(float((_unit_norm(_out_tensor(block(x_all[s]))) - y_all[s]).pow(2).sum())
                          for s in _batches(len(x_all), batch_size))
            return (err / float(y_all.pow(2).sum())) ** 0.5

        before = rel_error()
        start = {k: v.detach().clone() for k, v in block.state_dict().items()}
        params = list(block.parameters())
        opt = torch.optim.Adam(params, lr=lr)
        total = epochs * -(-len(x_all) // batch_size)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total)
        with _trainable(params):
            deadline = time.perf_counter() + 60 * minutes / len(layers)
            steps = 0
            for _ in range(epochs):
                order = torch.randperm(len(x_all), generator=gen)
                for s in _batches(len(x_all), batch_size):
                    idx = order[s]
                    loss = F.mse_loss(_unit_norm(_out_tensor(block(x_all[idx]))), y_all[idx])
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    sched.step()
                    steps += 1
                    if time.perf_counter() > deadline:
                        break
                if time.perf_counter() > deadline:
                    break
        after = rel_error()
        if after > before:  # the steps did not help on the fit set: keep the block as it was
            block.load_state_dict(start)
        report[l] = {"block_rel_error_before": before, "block_rel_error_after": min(after, before),
                     "kept": after <= before, "steps": steps, "steps_planned": total}
    return report


def _save_state(path: Path, model: nn.Module, opt: torch.optim.Optimizer, done: int, first, last) -> None:
    """Model + optimizer + step, written to a temporary file and renamed (a kill never leaves half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": done,
                "first_loss": first, "last_loss": last}, tmp)
    os.replace(tmp, path)


FINETUNE_SCOPES = ("model", "encoder")
# what the decoder is teacher-forced on: the labels, or the original's own greedy readings
FINETUNE_TARGETS = ("labels", "teacher")
# the student's forward and backward: fp32, or under bf16 autocast (matmuls in bfloat16; weights,
# optimizer and losses fp32): 2.3x faster a step on this CPU (AVX512-BF16), the usual mixed precision
# on a GPU. The teacher's outputs are fp32 either way (a fast run with them in bf16 too, and fewer
# steps and formulas, read 1.6 points fewer on the eval split: docs/chain.md)
FINETUNE_PRECISIONS = ("fp32", "bf16")
# the setting: either, or auto (bf16 where the device computes it natively, else fp32: pipeline.device.precision)
PRECISION_SETTINGS = ("auto", *FINETUNE_PRECISIONS)


class TeacherCache:
    """The teacher's encoder output and logits of each image, computed the first time a batch holds
    it and reused after: every image comes back ``steps * batch / len(images)`` times, and the
    teacher's half of a step (its encoder and decoder forward, ~1 s of 3 on 2 cores) is the same
    each time. A row's logits are kept at its own length (the padded tail is never read)."""

    def __init__(self, teacher) -> None:
        self.teacher = teacher
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def batch(self, idx: Sequence[int], images: torch.Tensor, inp: torch.Tensor,
              lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        missing = [r for r, i in enumerate(idx) if i not in self.rows]
        if missing:
            rows = torch.tensor(missing, device=inp.device)
            mem = self.teacher.encode(images[[idx[r] for r in missing]])
            logits = self.teacher.decode_logits(inp[rows], mem).float()
            for k, r in enumerate(missing):
                self.rows[idx[r]] = (mem[k].clone(), logits[k, :lengths[r]].clone())
        mems = torch.stack([self.rows[i][0] for i in idx])
        out = mems.new_zeros(len(idx), inp.shape[1], self.rows[idx[0]][1].shape[-1])
        for r, i in enumerate(idx):
            out[r, :lengths[r]] = self.rows[i][1]
        return mems, out


def finetune(student, teacher, images: torch.Tensor, latex: Sequence[str], steps: int, minutes: float,
             lr: float = 5e-5, batch_size: int = 4, label_weight: float = 1.0, logit_weight: float = 1.0,
             memory_weight: float = 1.0, seed: int = 0, progress: bool = False,
             state_file: Path | None = None, save_every: int = 10, scope: str = "model",
             targets: Sequence[Sequence[int]] | None = None, precision: str = "fp32",
             device=None) -> dict[str, float]:
    """A bounded number of AdamW steps, dropout off; ``scope``: every weight of the pruned model
    trains (``model``), or the encoder's alone (``encoder``: the decoder stays the original's, so the
    pruned encoder learns to feed it what the original's did). ``targets``: token ids (BOS ... EOS)
    per image the decoder is teacher-forced on instead of ``latex``'s labels, e.g. the original's own
    greedy readings (sequence-level distillation: the prefixes the student meets when it decodes).

    Resumable: with ``state_file``, model + optimizer + step are saved every ``save_every`` steps
    and when the time bound ends the run; a later call with the same file, the same starting model
    and the same arguments continues where it stopped (the batch order depends on the step only),
    giving the weights an uninterrupted run would. The file holds tensors and numbers only and is
    read with ``weights_only=True``.

    The teacher's outputs are computed once an image (:class:`TeacherCache`); ``precision``
    (:data:`FINETUNE_PRECISIONS`): the student's forward and backward in fp32 or under bf16 autocast.
    ``device``: where the steps run (both models are placed there for the loop and put back after)."""
    from pipeline.device import placed

    with placed(device, student, teacher) if device is not None else contextlib.nullcontext():
        return _finetune(student, teacher, images, latex, steps, minutes, lr, batch_size, label_weight, logit_weight,
                         memory_weight, seed, progress, state_file, save_every, scope, targets, precision)


def _finetune(student, teacher, images, latex, steps, minutes, lr, batch_size, label_weight, logit_weight,
              memory_weight, seed, progress, state_file, save_every, scope, targets, precision) -> dict[str, float]:
    if steps <= 0 or minutes <= 0 or len(images) == 0:
        return {"steps": 0, "seconds": 0.0}
    model = student.model
    teacher.model.eval()
    model.eval()  # no dropout: the short run should be deterministic and not noisier than it must be
    if scope not in FINETUNE_SCOPES:
        raise ValueError(f"finetune scope must be one of {', '.join(FINETUNE_SCOPES)}, got {scope!r}")
    if precision not in FINETUNE_PRECISIONS:
        raise ValueError(f"finetune precision must be one of {', '.join(FINETUNE_PRECISIONS)}, got {precision!r}")
    if teacher.token_policy is not None and teacher.token_policy != student.token_policy:
        raise ValueError("a teacher that reads with a token policy must keep the student's (its memory is at "
                         "its own kept tokens)")
    cache = TeacherCache(teacher)  # fp32 always: the targets are the float teacher's
    device = next(model.parameters()).device
    params = list(model.parameters())
    if scope == "encoder":
        decoder = {id(p) for p in student.decoder_parameters()}
        params = [p for p in params if id(p) not in decoder]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(images), generator=gen).tolist()
    if student.token_policy is not None:  # a batch of one bucket: each image reads what it keeps at batch 1
        order = student.token_policy.batches_by_bucket(images.detach().float().cpu().numpy(), order, batch_size)
    t0 = time.perf_counter()
    done, first, last, resumed = 0, None, None, 0
    if state_file is not None and Path(state_file).is_file():
        saved = torch.load(state_file, weights_only=True, map_location=device)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        done = resumed = int(saved["step"])
        first, last = saved["first_loss"], saved["last_loss"]
    bar = tqdm(total=steps, initial=done, desc="recovery finetune", disable=not progress)
    with _trainable(params):
        while done < steps and time.perf_counter() - t0 < 60 * minutes:
            interrupts.check()  # a signal a native callback swallowed ends the finetune at a step
            start = (done * batch_size) % len(order)
            idx = (order + order)[start:start + batch_size]
            x = images[idx]
            inp, tgt = label_batch(student, [latex[i] for i in idx]) if targets is None \
                else id_batch(student, [targets[i] for i in idx])
            inp, tgt = inp.to(device), tgt.to(device)
            mask = tgt.ne(student.pad_id)
            t_mem, t_logits = cache.batch(idx, images, inp, mask.sum(1).tolist())
            keep = student.keep_indices(x) if student.token_policy is not None else None
            if keep is not None and teacher.token_policy is None:  # the teacher read them all: its memory at
                t_mem = student.kept_memory(t_mem, keep)  # the kept ones
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                mem = student.encode(x) if keep is None else student.encode_kept(x, keep)
                logits = student.decode_logits(inp, mem)
            mem, logits = mem.float(), logits.float()
            ce = F.cross_entropy(logits[mask], tgt[mask]) if label_weight else logits.new_zeros(())
            kl = F.kl_div(F.log_softmax(logits[mask], -1), F.log_softmax(t_logits[mask], -1),
                          log_target=True, reduction="batchmean")
            mse = F.mse_loss(mem, t_mem) / t_mem.var().clamp_min(1e-8)
            loss = label_weight * ce + logit_weight * kl + memory_weight * mse
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done += 1
            value = float(loss.detach())
            first = value if first is None else first
            last = value
            bar.update(1)
            bar.set_postfix(loss=f"{value:.3f}")
            if state_file is not None and done % save_every == 0 and done < steps:
                _save_state(Path(state_file), model, opt, done, first, last)
    bar.close()
    if state_file is not None and done < steps:  # stopped by the time bound: keep the place
        _save_state(Path(state_file), model, opt, done, first, last)
    return {"steps": done, "resumed_at": resumed, "seconds": time.perf_counter() - t0, "first_loss": first,
            "last_loss": last}
