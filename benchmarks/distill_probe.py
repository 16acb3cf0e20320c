"""Probe for issue 14: how fast a BPE student decoder learns on this CPU (not the stage yet).

The student is initialised from the char decoder (``pipeline.distillation.student``), the encoder is
frozen and its outputs are computed once (fp16 in memory), the targets are the normalized formulas
in the tokenizer stage's BPE (no display wrapper). Every ``--eval-every`` minutes it reads the first
``--eval`` formulas of the eval split greedily and prints exact match, CER and decoder steps, next to
the char model's reading of the same formulas.

    python benchmarks/distill_probe.py artifacts --train 512 --templated 256 --minutes 10
Needs ``artifacts/corpus`` and ``artifacts/tokenizer`` (``stage=evaluate``, ``stage=tokenizer``).
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline import metrics  # noqa: E402
from pipeline.adapters.latex_ocr_junia import LatexOcrJuniaAdapter  # noqa: E402
from pipeline.data.corpus import read_jsonl  # noqa: E402
from pipeline.data.render import render_inputs  # noqa: E402
from pipeline.data.templates import templated_formulas  # noqa: E402
from pipeline.distillation.student import init_student, piece_map  # noqa: E402
from pipeline.tokenization.bpe import BpeTokenizer  # noqa: E402
from pipeline.tokenization.atoms import normalize_formula  # noqa: E402

CAP = 160


class _OnMemory(LatexOcrJuniaAdapter):
    """The adapter decoding from encoder outputs already computed (``encode`` is the identity)."""

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        return images.float()


@torch.no_grad()
def encode_all(adapter, images: list, batch: int = 16) -> torch.Tensor:
    out = []
    for i in range(0, len(images), batch):
        out.append(adapter.encode(torch.stack(images[i:i + batch])).half())
    return torch.cat(out)


def read(adapter, memory: torch.Tensor, truths: list[str]) -> dict:
    result = adapter.generate(memory, CAP, batch_size=16, use_cache=True)
    preds = result.texts  # the metrics normalize both sides (the display wrapper goes there)
    em = sum(metrics.exact_match(p, t) for p, t in zip(preds, truths)) / len(truths)
    return {"em": em, "cer": metrics.corpus_cer(preds, truths), "steps": sum(result.steps) / len(truths),
            "capped": sum(result.hit_cap) / len(truths), "decoder_s": result.decoder_seconds}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifacts", type=Path)
    ap.add_argument("--train", type=int, default=512)
    ap.add_argument("--templated", type=int, default=256)
    ap.add_argument("--eval", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--eval-every", type=float, default=2.5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    corpus = read_jsonl(args.artifacts / "corpus" / "formulas.jsonl")
    train = [(f.id, f.latex) for f in corpus if f.split == "train"][:args.train]
    train += [(f"t{i}", t) for i, t in enumerate(templated_formulas(args.templated, seed=args.seed))]
    evals = [(f.id, f.latex) for f in corpus if f.split == "eval"][:args.eval]
    teacher = LatexOcrJuniaAdapter.load("package")
    t0 = time.perf_counter()
    train_items = render_inputs(train, teacher.preprocess, desc="train")
    eval_items = render_inputs(evals, teacher.preprocess, desc="eval")
    mem_train = encode_all(teacher, [x for _, _, x in train_items])
    mem_eval = encode_all(teacher, [x for _, _, x in eval_items])
    print(f"rendered and encoded {len(train_items)} train + {len(eval_items)} eval images in "
          f"{time.perf_counter() - t0:.0f} s; cache {mem_train.numel() * 2 / 2**20:.0f} MiB fp16", flush=True)

    bpe_path = args.artifacts / "tokenizer" / "tokenizer.json"
    bpe = BpeTokenizer.from_file(bpe_path)
    truths = [t for _, t, _ in eval_items]
    char_row = read(_OnMemory(teacher.model, teacher.model_config, teacher.tokenizer, teacher.tokenizer_path),
                    mem_eval, truths)
    print(f"char model: EM {char_row['em']:.3f} CER {char_row['cer']:.3f} steps {char_row['steps']:.1f} "
          f"capped {char_row['capped']:.2f} decoder {char_row['decoder_s']:.1f} s", flush=True)

    student, config = init_student(teacher.model, teacher.model_config, piece_map(bpe.tokenizer, teacher.tokenizer))
    targets = [bpe.encode(normalize_formula(t), max_length=CAP) for _, t, _ in train_items]
    params = [p for n, p in student.named_parameters() if not n.startswith(("patch_embed", "encoder"))]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    reader = _OnMemory(student, config, bpe, bpe_path)

    def evaluate(step: int, minutes: float, loss: float) -> None:
        row = read(reader, mem_eval, truths)
        print(f"minutes {minutes:5.1f} step {step:5d} loss {loss:.3f} | EM {row['em']:.3f} CER {row['cer']:.3f} "
              f"steps {row['steps']:.1f} capped {row['capped']:.2f} decoder {row['decoder_s']:.1f} s", flush=True)

    evaluate(0, 0.0, float("nan"))
    start = time.perf_counter()
    next_eval, step, losses = args.eval_every, 0, []
    order: list[int] = []
    minutes, read_at = 0.0, 0
    while (time.perf_counter() - start) / 60 < args.minutes:
        if len(order) < args.batch:
            order += rng.sample(range(len(targets)), len(targets))
        idx, order = order[:args.batch], order[args.batch:]
        width = max(len(targets[i]) for i in idx)
        seq = torch.full((len(idx), width), bpe.pad_id, dtype=torch.long)
        for r, i in enumerate(idx):
            seq[r, :len(targets[i])] = torch.tensor(targets[i])
        student.train()
        logits = student.decode(seq[:, :-1], mem_train[idx].float())
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, 1:].reshape(-1),
                                                 ignore_index=bpe.pad_id)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        student.eval()
        step += 1
        losses.append(loss.item())
        minutes = (time.perf_counter() - start) / 60
        if minutes >= next_eval:
            evaluate(step, minutes, sum(losses[-50:]) / len(losses[-50:]))
            next_eval += args.eval_every
            read_at = step
    if step != read_at:  # the last step was not just read
        evaluate(step, minutes, sum(losses[-50:]) / max(1, len(losses[-50:])))


if __name__ == "__main__":
    main()
