"""What the BPE student learns to write for each training image: the formula, or with
``distill.targets=teacher`` the char model's own reading where it differs (sequence-level
distillation), read once from the cached encoder outputs and cached itself."""
from __future__ import annotations

import json
import re
import time

import torch
from tqdm import tqdm

from pipeline import metrics as M
from pipeline.artifacts import sha256_json
from pipeline.device import placed

TARGETS = ("truth", "teacher")


_STYLES = re.compile(r"\\(?:displaystyle|textstyle|scriptstyle|scriptscriptstyle)(?![a-zA-Z])")


def kd_target(truth: str, reading: str, capped: bool) -> str:
    """What the student learns for one image under ``distill.targets=teacher``: the formula when the
    char model read it right (metric-equal) or ran to the cap (a runaway reading teaches nothing),
    else the char model's reading without its display wrapper, line breaks and style switches (what
    every metric strips; the truth targets have none of them)."""
    if capped or M.exact_match(reading, truth):
        return truth
    stripped = " ".join(_STYLES.sub(" ", M.strip_display(reading)).split())
    return stripped or truth


def teacher_readings(ctx, teacher, model_hash: str, memory: torch.Tensor,
                      kept: list[tuple[str, str]], max_length: int, batch: int) -> tuple[list[str], list[bool]]:
    """The char model's greedy readings of the training images (from their cached encoder outputs),
    cached under ``<artifacts>/cache/`` like the outputs themselves."""
    config = {"formulas": sha256_json(kept), "max_length": max_length, **ctx.decoding_key()}
    with ctx.cache_output(f"distill-teacher-{sha256_json([config, model_hash])[:12]}", config,
                          {"model": model_hash}) as out:
        if not out.reused:
            t0 = time.perf_counter()
            bar = tqdm(total=len(kept), desc="teacher readings", disable=not ctx.progress)
            with placed(ctx.device, teacher):
                result = teacher.generate(memory, max_length, batch_size=batch, use_cache=True, encoded=True,
                                          progress=bar.update)
            bar.close()
            (out.path / "readings.json").write_text(json.dumps(
                {"texts": result.texts, "capped": [bool(c) for c in result.hit_cap]}, ensure_ascii=False))
            out.metrics.update({"images": len(kept), "seconds": time.perf_counter() - t0})
    payload = json.loads((out.path / "readings.json").read_text())
    return payload["texts"], payload["capped"]


def training_texts(ctx, targets: str, teacher, model_hash: str, memory: torch.Tensor, kept: list[tuple[str, str]],
                   max_length: int, batch: int) -> tuple[list[str], int]:
    """The LaTeX each training image is taught as, and how many came from the teacher's readings."""
    texts = [latex for _, latex in kept]
    if targets != "teacher":
        return texts, 0
    readings, capped = teacher_readings(ctx, teacher, model_hash, memory, kept, max_length, batch)
    texts = [kd_target(t, r, c) for t, r, c in zip(texts, readings, capped)]
    return texts, sum(t != latex for t, (_, latex) in zip(texts, kept))
