"""Quantization-aware finetune (QAT) of the encoder, before its INT8 graphs are made.

Static INT8 on every encoder projection rounds each weight to its channel's grid and each input to
its tensor's calibrated range; the model was never trained to tolerate that noise, and on the
chain's model it costs ~0.9 point of exact match (docs/quantize.md). Here ModelOpt's INT8 fake
quantizers go on every encoder ``nn.Linear`` (weights per output channel, inputs per tensor, both
symmetric — the TensorRT/MacaRT scheme; input ranges the ``percentile`` of a histogram over the
calibration rows, as the stage's default method takes them), and the encoder trains a few hundred
AdamW steps (straight-through estimator) to read as the float model does: sequence-level
distillation, teacher-forced on the float model's own greedy readings, with its logits and encoder
output as further targets (the prune stage's recovery finetune). The quantizers then come off: the
result is a float model whose weights tolerate INT8, which the stage quantizes like any other
(ONNX Runtime's calibrators set the deployed ranges). LayerNorm, softmax, GELU and the attention
products stay float, as in the graphs.
"""
from __future__ import annotations

import importlib
import threading
import time
from types import ModuleType
from typing import Sequence

import torch
from torch import nn
from tqdm import tqdm

from pipeline.pruning import recover
from pipeline.pruning.scores import own_predictions


def encoder_linears(adapter) -> set[str]:
    """The ``nn.Linear`` modules of ``adapter.model`` outside its decoder (the adapter says which
    parameters are the decoder's): the encoder projections the graphs quantize."""
    decoder = {id(p) for p in adapter.decoder_parameters()}
    return {n for n, m in adapter.model.named_modules() if isinstance(m, nn.Linear) and id(m.weight) not in decoder}


def import_detached(name: str) -> ModuleType:
    """``importlib.import_module(name)`` on a fresh thread's stack.

    ModelOpt's torch quantization imports PuLP, whose solver classes keep the exception of a failed
    optional import (``except Exception as e: err = e`` in a class body): the exception holds its
    traceback, the traceback its frames, and each frame, through ``f_back``, every caller up the
    stack with all its locals. Imported here in the middle of the quantize stage, that kept the
    stage's arrays and ONNX Runtime sessions (8.6 GB in ``stage=all``) alive to the end of the
    process; a new thread's stack holds nothing of its caller's."""
    imported: dict[str, ModuleType] = {}
    errors: list[BaseException] = []

    def target() -> None:
        try:
            imported[name] = importlib.import_module(name)
        except BaseException as exc:  # re-raised on the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=target, name=f"import {name}")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return imported[name]


def fake_quantize(model: nn.Module, linear: set[str], calib: torch.Tensor, encode, percentile: float,
                  batch_size: int = 8) -> list[str]:
    """ModelOpt INT8 fake quantizers on the ``nn.Linear`` modules named in ``linear`` (every other
    module, LayerNorm included, stays float); input ranges from a histogram of ``calib``'s
    activations at ``percentile``, weight ranges per output channel. Returns the quantized modules."""
    mtq = import_detached("modelopt.torch.quantization")
    TensorQuantizer = mtq.nn.TensorQuantizer

    if not linear:
        raise ValueError("no encoder nn.Linear to quantize")
    mtq.quantize(model, {"quant_cfg": [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*weight_quantizer", "parent_class": "nn.Linear", "cfg": {"num_bits": 8, "axis": 0}},
        {"quantizer_name": "*input_quantizer", "parent_class": "nn.Linear",
         "cfg": {"num_bits": 8, "axis": None, "calibrator": "histogram"}}], "algorithm": None})
    quantizers = []
    for n, m in model.named_modules():
        if isinstance(m, TensorQuantizer) and m.is_enabled:
            if n.rsplit(".", 1)[0] in linear:
                quantizers.append((n, m))
            else:  # the decoder's projections
                m.disable()
    for _, q in quantizers:
        q.disable_quant()
        q.enable_calib()
    with torch.no_grad():
        for i in range(0, len(calib), batch_size):
            encode(calib[i:i + batch_size])
    unread = set()
    for n, q in quantizers:
        try:
            if n.endswith("input_quantizer"):
                q.load_calib_amax("percentile", percentile=percentile)
            else:
                q.load_calib_amax()
        except RuntimeError as exc:
            if "hasn't seen any tensor" not in str(exc):
                raise
            # a module the encoder's reading never reached (a ViT's pooler when a token policy reads
            # through the layers): it is not in the graphs either, and stays float
            q.disable()
            unread.add(n.rsplit(".", 1)[0])
            continue
        q.enable_quant()
        q.disable_calib()
    return sorted(linear - unread)


def finetuned_copy(adapter, calib: torch.Tensor, images: torch.Tensor, steps: int, lr: float = 2e-5,
                   batch_size: int = 4, minutes: float = 60.0, percentile: float = 99.99, seed: int = 0,
                   max_length: int = 256, read_batch: int = 8, progress: bool = False,
                   targets: Sequence[Sequence[int]] | None = None, precision: str = "fp32",
                   device=None) -> tuple[object, dict]:
    """A copy of ``adapter`` whose encoder was finetuned ``steps`` steps with INT8 fake quantizers
    (ranges from ``calib``) on ``images``, against ``adapter`` in float; the quantizers removed.
    ``targets``: the float model's greedy readings of ``images`` (read here when not given)."""
    started = time.perf_counter()
    teacher = adapter
    teacher.model.eval()
    if targets is None:  # BOS ... EOS, what the student is teacher-forced on
        with tqdm(total=len(images), desc="QAT: float readings", disable=not progress) as bar:
            targets = own_predictions(teacher, images, max_length, read_batch, use_cache=True, progress=bar.update)
    read_s = time.perf_counter() - started
    student = teacher.clone()
    quantized = fake_quantize(student.model, encoder_linears(teacher), calib, student.encode, percentile)
    log = recover.finetune(student, teacher, images, [""] * len(images), steps=steps, minutes=minutes, lr=lr,
                           batch_size=batch_size, scope="encoder", targets=targets, seed=seed, progress=progress,
                           precision=precision, device=device)
    out = teacher.clone()
    out.model.load_state_dict({k: v for k, v in student.model.state_dict().items() if "_quantizer" not in k},
                              strict=True)
    out.model.eval()
    report = {"steps": int(log.get("steps", 0)), "planned_steps": steps, "lr": lr, "batch_size": batch_size,
              "precision": precision,
              "images": len(images), "percentile": percentile, "quantized_modules": len(quantized),
              "first_loss": log.get("first_loss"), "last_loss": log.get("last_loss"),
              "teacher_readings_seconds": round(read_s, 1), "seconds": round(time.perf_counter() - started, 1)}
    return out, report
