"""The quantize stage's check: float, the plan's encoders and the anchors read on the same eval
formulas (each of ``quantize.eval_splits``) with the same session options, and timed, in one table."""
from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from pipeline.context import StageContext
from pipeline.names import INT8_DECODERS as DECODERS, QDQ_ENCODER, QDQ_ENCODER_ORT
from pipeline.quantization import anchors
from pipeline.quantization.graphs import FloatGraphs
from pipeline.quantization.measure import Reading, latency, read
from pipeline.quantization.plan import Plan
from pipeline.quantization.search import mac_share
from pipeline.quantization.sets import split_set


def check_on_eval(cfg, ctx: StageContext, adapter, graphs: FloatGraphs, folder: Path, calib_set, by_name,
                  plan: Plan, scratch: Path, search_seconds: float, validate: anchors.Validate | None = None,
                  search_rows: int = 0, reference: FloatGraphs | None = None) -> list[dict]:
    """Float, ours and the anchors on the same eval formulas and session options: one table; the
    accuracy columns also on the other ``quantize.eval_splits`` (the shift split: sources training
    never saw). ``cfg``: the stage's QuantizeConfig. ``reference``: the float model's graphs when
    ``graphs`` are of finetuned weights (QAT): float and the anchors are of the model handed over,
    ours of the finetuned one."""
    reference = reference or graphs
    max_length, batch = ctx.limits.max_length, ctx.limits.batch_size
    sets = {split: split_set(ctx, adapter, split, cfg.eval_limit) for split in cfg.eval_splits}
    images, truths = sets[cfg.eval_splits[0]]
    variants: dict[str, tuple[Path, float, float]] = {  # name -> (encoder, INT8 MAC share, search seconds)
        "float (ort_cpu package)": (reference.encoder_ort, 0.0, 0.0),
        "ours (plan, ort_cpu graph)": (folder / QDQ_ENCODER_ORT, mac_share(by_name, set(plan.ort_cpu_int8_groups())),
                                       search_seconds),
        "ours (plan, TensorRT/Metax graph)": (folder / QDQ_ENCODER, plan.int8_mac_share(), search_seconds),
    }
    decoders = {g: folder / n for g, n in DECODERS.items()} if plan.decoder == "int8" else {}
    packages = {name: graphs.open_readers(ctx.limits.threads, cfg.workers,
                                          decoders if name.startswith("ours (plan, ort") else None) for name in variants}
    float_readers = graphs.open_readers(ctx.limits.threads, cfg.workers)
    notes: dict[str, str] = {}
    if cfg.anchors:
        for name, (path, share, secs, note) in anchors.build_all(reference, scratch, calib_set, cfg.calib_images,
                                                                  by_name, validate, search_rows,
                                                                  cfg.budget).items():
            if path is None:
                notes[name] = note
                continue
            variants[name] = (path, share, secs)
            packages[name] = float_readers
            if note:
                notes[name] = note
    readings: dict[str, dict[str, Reading]] = {}
    for name, (path, _, _) in tqdm(variants.items(), desc="eval check", disable=not ctx.progress):
        readings[name] = {split: read(packages[name], path, imgs, ts, max_length, batch)
                          for split, (imgs, ts) in sets.items()}
    k = min(cfg.latency_images + 1, len(images))
    timed = latency({n: (graphs.open_package(1, decoders if n.startswith("ours (plan, ort") else None), p)
                     for n, (p, _, _) in variants.items()}, images[:k], max_length)
    base = readings["float (ort_cpu package)"][cfg.eval_splits[0]]
    rows = []
    for name, (path, share, secs) in variants.items():
        r, t = readings[name][cfg.eval_splits[0]], timed[name]
        rows.append({"variant": name, "exact_match": r.exact_match, "cer": r.cer,
                     "splits": {sp: {"exact_match": x.exact_match, "cer": x.cer, "n": len(x.exact)}
                                for sp, x in readings[name].items()},
                     "identical_vs_float": r.identical_to(base), "encoder_ms": t["encoder_ms"],
                     "decoder_ms_per_step": t["decoder_ms_per_step"], "total_ms": t["total_ms"],
                     "size_mb": path.stat().st_size / 2 ** 20, "int8_mac_share": share,
                     "search_s": round(secs, 1), "n": len(truths), "note": notes.get(name, "")})
    for name, note in notes.items():
        if name not in variants:
            rows.append({"variant": name, "note": note})
    return rows
