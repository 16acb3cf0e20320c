"""The frozen encoder's outputs for the distill stage's formulas: rendered, encoded once (fp16) and
cached under ``<artifacts>/cache/``, so the decoder trains and reads from them without the encoder."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from pipeline.artifacts import sha256_json
from pipeline.data.render import render_inputs
from pipeline.errors import PipelineError

VARIED_CHUNK = 1000  # varied-grammar formulas per encoder-output cache file


@torch.no_grad()
def encode(adapter, pairs: list[tuple[str, str]], batch: int, progress: bool, desc: str
            ) -> tuple[torch.Tensor, list[tuple[str, str]]]:
    items = render_inputs(pairs, adapter.preprocess, None, progress, f"render {desc}")
    if not items:
        raise PipelineError(f"distill: no {desc} formula could be rendered")
    out = []
    bar = tqdm(total=len(items), desc=f"encode {desc}", disable=not progress)
    for i in range(0, len(items), batch):
        out.append(adapter.encode(torch.stack([x for _, _, x in items[i:i + batch]])).half())
        bar.update(len(items[i:i + batch]))
    bar.close()
    return torch.cat(out), [(fid, latex) for fid, latex, _ in items]


def cached_memory(ctx, adapter, model_hash: str, name: str, pairs: list[tuple[str, str]],
                   batch: int) -> tuple[torch.Tensor, list[tuple[str, str]], float, bool]:
    """Encoder outputs of ``pairs`` (fp16) from ``<artifacts>/cache/<name>-<key>``, computed when missing."""
    config = {"formulas": sha256_json(pairs)}
    with ctx.cache_output(f"distill-memory-{name}-{sha256_json([config, model_hash])[:12]}", config,
                          {"model": model_hash}) as out:
        t0 = time.perf_counter()
        if not out.reused:
            memory, kept = encode(adapter, pairs, batch, ctx.progress, name)
            save_file({"memory": memory.contiguous()}, str(out.path / "memory.safetensors"))
            (out.path / "formulas.json").write_text(json.dumps(kept, ensure_ascii=False))
            out.metrics.update({"images": len(kept), "seconds": time.perf_counter() - t0})
    memory = load_file(str(out.path / "memory.safetensors"))["memory"]
    kept = [tuple(p) for p in json.loads((out.path / "formulas.json").read_text())]
    return memory, kept, float(out.metrics.get("seconds", 0.0)), out.reused


@dataclass
class Memory:
    """Encoder outputs and the (id, LaTeX) pairs they are of: the training set (train split,
    templated, then varied grammar) and the eval formulas."""
    train: torch.Tensor
    kept: list[tuple[str, str]]
    eval: torch.Tensor
    kept_eval: list[tuple[str, str]]
    seconds: float                  # encoding time of both (0 where read back from the cache)
    train_reused: bool              # the train split's outputs came from the cache


def training_memory(ctx, adapter, model_hash: str, train: list[tuple[str, str]], varied: list[tuple[str, str]],
                    evals: list[tuple[str, str]], batch: int) -> Memory:
    """:func:`cached_memory` of the training formulas and of the eval formulas."""
    mem_train, kept, seconds, train_reused = cached_memory(ctx, adapter, model_hash, "train", train, batch)
    # the varied grammar's outputs are cached on their own, VARIED_CHUNK formulas a file: the split's
    # cache stays valid, and a larger distill.varied (the grammar's draws are a prefix of any larger
    # one's with the same seed) reuses every chunk already computed
    parts = [mem_train]
    for i in range(0, len(varied), VARIED_CHUNK):
        mem_chunk, kept_chunk, chunk_s, _ = cached_memory(ctx, adapter, model_hash, "varied",
                                                          varied[i:i + VARIED_CHUNK], batch)
        parts.append(mem_chunk)
        kept += kept_chunk
        seconds += chunk_s
    mem_train = torch.cat(parts) if len(parts) > 1 else mem_train
    del parts
    mem_eval, kept_eval, eval_s, _ = cached_memory(ctx, adapter, model_hash, "eval", evals, batch)
    return Memory(mem_train, kept, mem_eval, kept_eval, seconds + eval_s, train_reused)
