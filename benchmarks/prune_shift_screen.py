"""Screen head-pruning recovery settings on the eval and the shift split (issue 10).

Builds each variant (lowest-``l2_qkv`` heads, layer-normalized, then the closed-form refit with the
given ridge / images, optionally block-wise distillation), reads the first ``--n`` formulas of the
eval and the shift split with the KV-cached greedy decoder (cap ``model.max_length``), and appends
one JSON line per variant to ``<artifacts>/prune-shift-screen/results.jsonl``. The original's
reading of the same formulas is computed once and cached there. Also records the encoder's relative
error against the original on held-out *calib* images (never used for fitting): a label-free proxy
on data training saw, so a setting can be chosen without looking at the shift split.

    python benchmarks/prune_shift_screen.py artifacts 'heads=8,ridge=1e-3' 'heads=8,ridge=1e-2,calib=128'

Variant keys: heads (8), ridge (1e-3), train (128: train-split images), calib (0: calib-split
images, from after the held-out ones), templates (0: templated formulas), distill (0 epochs).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.data.render import RenderError, render_formula  # noqa: E402
from pipeline.data.templates import templated_formulas  # noqa: E402
from pipeline.evaluation import EvalItem, evaluate_items  # noqa: E402
from pipeline.pruning import recover, scores as head_scores, select  # noqa: E402
from pipeline.stages import prune as stage  # noqa: E402

HELD_OUT_CALIB = 32


def parse(spec: str) -> dict:
    v = {"heads": 8, "ridge": 1e-3, "train": 128, "calib": 0, "templates": 0, "distill": 0}
    for kv in filter(None, spec.split(",")):
        k, val = kv.split("=")
        v[k] = float(val) if k == "ridge" else int(val)
    return v


def render_latex(adapter, latex: list[str], limit: int) -> list[torch.Tensor]:
    out = []
    for t in latex:
        if len(out) >= limit:
            break
        try:
            out.append(adapter.preprocess(render_formula(t)))
        except RenderError:
            continue
    return out


@torch.no_grad()
def rel_error(student, teacher, images: torch.Tensor, batch: int = 16) -> float:
    num = den = 0.0
    for s in range(0, len(images), batch):
        t = teacher.encode(images[s:s + batch])
        p = student.encode(images[s:s + batch])
        num += float((p - t).pow(2).sum())
        den += float(t.pow(2).sum())
    return (num / den) ** 0.5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifacts")
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import make_ctx  # the resolved root config, as python -m pipeline builds it

    torch.set_num_threads(a.threads)  # after the import: conftest sets its own thread count

    ctx = make_ctx(Path(a.artifacts).resolve())
    folder = ctx.artifacts_dir / "prune-shift-screen"
    folder.mkdir(parents=True, exist_ok=True)
    max_length, batch = int(ctx.cfg.model.max_length), int(ctx.cfg.model.batch_size)
    original = ctx.load_model("original")
    cfg = stage.PruneConfig(eval_limit=a.n, eval_splits=["eval", "shift"])
    items = stage._eval_items(cfg, ctx, original)
    scores = {"l2_qkv": head_scores.l2_scores(stage._attention_layers(original))}  # weight norms: no cache needed

    calib = ctx.split("calib")
    calib = [calib[i] for i in np.random.default_rng(ctx.seed + 2).permutation(len(calib))]
    held = torch.stack(render_latex(original, [f.latex for f in calib[:HELD_OUT_CALIB]], HELD_OUT_CALIB))
    calib_fit = [f.latex for f in calib[HELD_OUT_CALIB:]]
    train_fit = [f.latex for f in stage._train_pool(ctx, ctx.seed)]

    base_file = folder / f"original-n{a.n}.json"
    if base_file.is_file():
        base = json.loads(base_file.read_text())
    else:
        base = {}
        for split, its in items.items():
            r = evaluate_items(original, its, max_length, batch, image_match=False, progress=False, use_cache=True)
            base[split] = {"metrics": r["metrics"], "exact": [row["exact"] for row in r["rows"]]}
        base_file.write_text(json.dumps(base))
    print("original", {s: (round(v["metrics"]["exact_match"], 3), round(v["metrics"]["cer"], 3))
                       for s, v in base.items()}, flush=True)

    for spec in a.variants:
        v = parse(spec)
        t0 = time.perf_counter()
        removed = select.select_heads(scores["l2_qkv"], v["heads"], 1, "layer")
        student = stage._clone(original)
        student.remove_encoder_heads(removed)
        imgs = render_latex(original, train_fit, v["train"]) + render_latex(original, calib_fit, v["calib"]) \
            + render_latex(original, templated_formulas(4 * v["templates"] + 8, ctx.seed), v["templates"])
        images = torch.stack(imgs)
        layers = list(range(min(removed), 4))
        log = recover.refit(student, original, images, layers, ridge=v["ridge"])
        if v["distill"]:
            log_d = recover.distill(student, original, images, layers, epochs=v["distill"], lr=1e-3,
                                    minutes=30.0, seed=ctx.seed)
        else:
            log_d = {}
        t_fit = time.perf_counter() - t0
        row = {"spec": spec, **v, "fit_images": len(images), "removed": removed, "fit_seconds": t_fit,
               "enc_err_calib_heldout": rel_error(student, original, held),
               "refit": log, "distill": log_d}
        for split, its in items.items():
            r = evaluate_items(student, its, max_length, batch, image_match=False, progress=False, use_cache=True)
            m, b = r["metrics"], base[split]
            ex = [row_["exact"] for row_ in r["rows"]]
            row[split] = {"n": m["n"], "exact_match": m["exact_match"], "cer": m["cer"],
                          "hit_cap_share": m["hit_cap_share"], "em_original": b["metrics"]["exact_match"],
                          "cer_original": b["metrics"]["cer"],
                          "gained": sum(x and not y for x, y in zip(ex, b["exact"])),
                          "lost": sum(y and not x for x, y in zip(ex, b["exact"]))}
        row["total_seconds"] = time.perf_counter() - t0
        with open(folder / "results.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(f"{spec}: calib enc err {row['enc_err_calib_heldout']:.3f}; " + "; ".join(
            f"{s} EM {row[s]['em_original']:.3f}->{row[s]['exact_match']:.3f} "
            f"CER {row[s]['cer_original']:.3f}->{row[s]['cer']:.3f} (+{row[s]['gained']}/-{row[s]['lost']})"
            for s in items) + f"; {row['total_seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
