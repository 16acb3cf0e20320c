"""Stage quantize: INT8 where it is safe, float where it is not, chosen by per-layer sensitivity.

``python -m pipeline stage=quantize`` takes the model the chain hands over (the pruned model when the
prune stage's artifact exists, else the original; ``quantize.model=`` overrides), exports its
encoder to float ONNX with the export stage's graph code, and with the calibrate stage's set:

1. compares calibration methods (ORT's MinMax, moving-average MinMax, Percentile, Entropy) on the
   same INT8 graph: encoder SNR, exact match and CER of greedy readings, calibration time;
2. measures every matrix-multiply group's sensitivity both ways (only it INT8; all but it INT8);
3. returns the most sensitive groups to float until the exact-match loss against the float model,
   read on calibration-split formulas, is within ``quantize.budget`` (binary search over the ranking);
4. writes the plan (``plan.json``, editable, ``quantize.plan=FILE`` applies one), the QDQ encoders
   (``encoder.qdq.onnx``: plain ops for TensorRT / Metax; ``encoder.ort_cpu.qdq.onnx``: ONNX Runtime
   fusions + the same plan), and the report with its sensitivity bar chart and heat map;
5. checks the result on eval-split formulas next to the anchors (float, ``quantize_dynamic``,
   ``quantize_static`` defaults, ModelOpt INT8) in one table.

Scheme: symmetric INT8, per-channel weights, per-tensor activations, explicit Q/DQ. The ort_cpu decoder
graphs (first, step, verify) get 8-bit weights (``MatMulNBits``) node by node as the budget allows
(``quantize.decoder``, on by default), then decoder_first's cross-attention K/V projections in
dynamic INT8 where the budget still holds (``quantize.decoder_cross_kv``); the other targets'
decoders stay float (export casts them to FP16 for TensorRT / Metax).
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

import onnx

from calibration import sensitivity
from calibration.calibrators import METHODS, CalibSetReader, calib_images, load_calib_set, token_feeds
from pipeline.context import StageContext, file_hash
from pipeline.data.corpus import check_splits
from pipeline.errors import PipelineError, optional_part
from pipeline.names import QDQ_ENCODER, QDQ_ENCODER_ORT, QUANTIZE_ORIGINAL
from pipeline.quantization import prepare, qdq, report
from pipeline.quantization.check import check_on_eval
from pipeline.quantization.decoder_plan import decoder_plan
from pipeline.quantization.encoder_plan import EncoderGraphs, apply_given, check_given_ort, compare_methods, \
    given_sensitivity, search_ort, search_plain
from pipeline.quantization.groups import find_groups
from pipeline.quantization.measure import encoder_outputs
from pipeline.quantization.plan import load as load_plan, qat_of as plan_qat, smoothquant_of as plan_smoothquant
from pipeline.quantization.report import resolution_note, summary_line
from pipeline.quantization.search import PlanSearch, SearchReads, json_number, mac_share, search_chunk
from pipeline.quantization.sets import decoder_search_set, search_set as search_rows
from pipeline.reports import Phases

NAME = "quantize"
CONFIG_KEY = "quantize"
log = logging.getLogger(__name__)


@dataclass
class QuantizeConfig:
    model: str = "auto"               # auto = the prune stage's model when it exists, else original | a stage | a folder
    calibration: str = "calibrate"    # the calibrate stage's artifact (name under artifacts, or a folder)
    methods: list[str] = field(default_factory=lambda: ["minmax", "minmax_ema", "percentile_99.99",
                                                        "percentile", "entropy"])
    method: str = "auto"              # auto = the best of the comparison | one of calibration.calibrators.METHODS
    calib_images: int = 32            # calibration-set rows the ranges come from
    # the next rows (with their formulas): accuracy during the search; at 96 one formula was 1 point,
    # twice the budget, and the binary search followed single-formula noise (docs/quantize.md)
    search_images: int = 256
    # where the search formulas come from: null = calibration-set rows calib_images.. (as many as
    # search_images) | a corpus split (train: 1,779 formulas, paired SE ~0.3-0.4 point where 256
    # calibration rows give ~1), its first search_images formulas that render. Never an eval split:
    # the check would read the formulas the plan was chosen on. The ranges, the sensitivity images
    # and the decoder's records stay calibration rows
    search_split: Optional[str] = None
    # a search reading stops once its candidate is clearly over the budget (loss minus 3 paired standard
    # errors above it), checked after every this many formulas; candidates within or near the budget are
    # read whole, so the decision is the whole set's where it could go either way. 0 = read every one whole
    search_chunk: int = 128
    sensitivity_images: int = 8       # rows whose encoder output scores each group
    metric: str = "snr_db"            # sensitivity metric: snr_db | cosine
    budget: float = 0.005             # allowed exact-match loss vs the float model (0.005 = 0.5 point)
    plan: Optional[str] = None        # apply this plan file (JSON) instead of searching
    eval_limit: int = 64              # formulas of each split for the final check and the anchors
    eval_splits: list[str] = field(default_factory=lambda: ["eval", "shift"])  # the first one: latency, identical tokens
    workers: int = 2                  # session sets a search-set reading is split over, 1 thread each
                                      # (1: one session set with model.threads)
    decoder: bool = True              # ort_cpu decoder weights in 8 bits, node by node, as the budget allows
    # then decoder_first's cross-attention K/V projections of the encoder output (1,024 rows a formula;
    # FP32: 10 of its 14 ms) in dynamic INT8 (half the time), kept where the budget still holds
    decoder_cross_kv: bool = True
    decoder_search_images: int = 256  # calibration rows from calib_images on: the decoder's search set
    check: bool = True                # float vs ours on eval_limit formulas of each split, with latency (stage=all:
                                      # off; export's parity and the benchmark read the packages there)
    anchors: bool = True              # quantize_dynamic, quantize_static defaults, ModelOpt INT8 and NNCF's
                                      # accuracy control (when installed: the compare extra) beside ours
    latency_images: int = 6           # images timed at batch 1 (1 thread) per variant
    # SmoothQuant alpha (pipeline/quantization/smooth.py): folded into a copy of the model, from the
    # activations of the calib_images rows, before its graphs are exported; null = off. A plan file
    # carries its own (quantize.plan wins). Off by default: alpha 0.8 let every ort_cpu projection go
    # INT8 at no loss on the search set, and the package read 1.72-1.78x faster than the float one, but
    # the whole eval split lost 0.9-1.2 points against it, over the 0.5-point budget (docs/quantize.md)
    smoothquant: Optional[float] = None
    # the ort_cpu encoder's activations: uint8 = asymmetric (zero point fitted to the range; ONNX
    # Runtime CPU runs U8S8 at the speed of S8S8) | int8 = symmetric, zero point 0. The plain graph
    # (TensorRT, Metax) is symmetric int8 regardless. A plan file carries its own (quantize.plan wins)
    ort_cpu_activations: str = "uint8"
    # quantization-aware finetune of the encoder before its graphs are made (pipeline/quantization/qat.py):
    # this many AdamW steps with ModelOpt's INT8 fake quantizers on every encoder projection, distilled
    # from the float model on its own greedy readings of the first qat_images calibration rows; the
    # graphs are then made and quantized from the finetuned weights, and every loss is still measured
    # against the float model handed over. 0 = off. A plan file carries its own (quantize.plan wins)
    qat_steps: int = 0
    qat_lr: float = 2e-5
    qat_images: int = 512             # calibration-set rows (from row 0) it trains on
    qat_minutes: float = 60.0         # wall-clock bound on the steps
    qat_precision: str = "fp32"       # fp32 | bf16: the student's forward and backward under bf16 autocast (2.1x a step here)
    # also the original model's graphs with this plan applied, no search (artifact quantize-original;
    # export.baselines packages it): what quantization does without pruning, beside the chain's model.
    # stage=all: off (a comparison; preset=thorough: on). Its plan check reads the first original_search_images
    # rows of the search set
    original: bool = False
    original_search_images: int = 64
    name: Optional[str] = None        # artifact folder; default "quantize" (+ the job's tag in a multirun)


Config = QuantizeConfig


def validate(cfg: QuantizeConfig) -> None:
    if cfg.search_chunk < 0:
        raise PipelineError(f"quantize.search_chunk must be >= 0 (0: read every candidate whole), got {cfg.search_chunk}")
    for key in ("calib_images", "search_images", "sensitivity_images", "eval_limit", "latency_images",
                "decoder_search_images", "workers", "original_search_images"):
        if getattr(cfg, key) < 1:
            raise PipelineError(f"quantize.{key} must be >= 1, got {getattr(cfg, key)}")
    if cfg.qat_steps < 0 or cfg.qat_images < 1 or not cfg.qat_lr > 0 or not cfg.qat_minutes > 0:
        raise PipelineError(f"quantize.qat_steps must be >= 0, qat_images >= 1, qat_lr and qat_minutes > 0; got "
                            f"{cfg.qat_steps}, {cfg.qat_images}, {cfg.qat_lr}, {cfg.qat_minutes}")
    from pipeline.pruning.recover import FINETUNE_PRECISIONS

    if cfg.qat_precision not in FINETUNE_PRECISIONS:
        raise PipelineError(f"quantize.qat_precision must be one of {', '.join(FINETUNE_PRECISIONS)}, "
                            f"got {cfg.qat_precision!r}")
    if not 0.0 <= cfg.budget < 1.0:
        raise PipelineError(f"quantize.budget must be in [0, 1) (a share of exact match), got {cfg.budget}")
    unknown = [m for m in cfg.methods if m not in METHODS]
    if unknown or not cfg.methods:
        raise PipelineError(f"quantize.methods: unknown {unknown or '[]'}; known: {', '.join(METHODS)}")
    if cfg.method != "auto" and cfg.method not in METHODS:
        raise PipelineError(f"quantize.method={cfg.method!r}; known: auto, {', '.join(METHODS)}")
    sensitivity.metric(cfg.metric)
    if cfg.smoothquant is not None and not 0.0 < cfg.smoothquant <= 1.0:
        raise PipelineError(f"quantize.smoothquant must be in (0, 1] (SmoothQuant's alpha) or null, got {cfg.smoothquant}")
    if cfg.ort_cpu_activations not in qdq.ACTIVATIONS:
        raise PipelineError(f"quantize.ort_cpu_activations must be one of {', '.join(qdq.ACTIVATIONS)}, "
                            f"got {cfg.ort_cpu_activations!r}")
    if not cfg.eval_splits or len(set(cfg.eval_splits)) != len(cfg.eval_splits):
        raise PipelineError(f"quantize.eval_splits must name at least one split, each once, got {list(cfg.eval_splits)}")
    check_splits("quantize.eval_splits", cfg.eval_splits)
    if cfg.search_split is not None:
        check_splits("quantize.search_split", cfg.search_split)
    if cfg.search_split is not None and cfg.search_split in cfg.eval_splits:
        raise PipelineError(f"quantize.search_split={cfg.search_split} is one of quantize.eval_splits: the check would "
                            f"read the formulas the plan was chosen on (search on train or calib)")


def _calib_folder(cfg: QuantizeConfig, ctx: StageContext) -> Path:
    for cand in (ctx.artifacts_dir / cfg.calibration, Path(cfg.calibration)):
        if (cand / "calib_set").is_dir():
            return cand
    raise PipelineError(f"quantize.calibration={cfg.calibration}: no calibration set there; "
                        f"run stage=calibrate first")


def run(cfg: QuantizeConfig, ctx: StageContext) -> dict:
    """The chain model's plan and graphs; with ``quantize.original`` (and a chain model that a stage
    made) also the graphs of the model it was made from, with that plan applied."""
    validate(cfg)
    manifest = _run_one(cfg, ctx)
    origin = ctx.chain_origin(manifest["config"]["model_ref"]) if cfg.original else None
    if origin is None or origin == manifest["config"]["model_ref"]:
        return manifest
    plan = ctx.artifacts_dir / ctx.artifact_name("quantize", cfg.name) / "plan.json"
    name = f"{cfg.name}-original" if cfg.name else ctx.artifact_name(QUANTIZE_ORIGINAL, stage="quantize")
    applied = replace(cfg, model=origin, plan=str(plan), original=False, name=name, check=False, anchors=False,
                      search_images=min(cfg.search_images, cfg.original_search_images),
                      decoder_search_images=min(cfg.decoder_search_images, cfg.original_search_images))
    log.info(f"[quantize] {origin}, the model {manifest['config']['model_ref']} was made from, with its plan "
             f"(quantize.original)")
    with optional_part("quantize.original (the model the chain's was made from, with its plan: a comparison)",
                       "quantize.original=false"):
        _run_one(applied, ctx)
    return manifest


def _run_one(cfg: QuantizeConfig, ctx: StageContext) -> dict:
    model_ref = ctx.chain_model(cfg.model, ctx.chain_upstream())
    calib_folder = _calib_folder(cfg, ctx)
    calib_set = load_calib_set(calib_folder)
    if "text" not in calib_set.column_names:
        raise PipelineError(f"{calib_folder}: the calibration set has no 'text' column; the plan search "
                            f"reads its formulas (build it from a labelled source)")
    need = cfg.calib_images + max(cfg.sensitivity_images,
                                  0 if cfg.search_split else cfg.search_images,
                                  cfg.decoder_search_images if cfg.decoder and not cfg.search_split else 0)
    if len(calib_set) < need:
        what = "sensitivity_images" if cfg.search_split else "search_images (or decoder_search_images)"
        raise PipelineError(f"quantize: calib_images + {what} = {need} > {len(calib_set)} images in "
                            f"{calib_folder}; lower them or build a larger set (calibrate.size)")
    inputs = {"model": ctx.model_hash(model_ref), "calib_set": file_hash(calib_folder / "calib_set"),
              "corpus": ctx.upstream("corpus")["outputs"]["formulas.jsonl"] if _has_corpus(ctx) else ""}
    if cfg.plan:
        inputs["plan"] = file_hash(Path(cfg.plan)) if Path(cfg.plan).is_file() else "missing"
    if cfg.search_split:
        ctx.split(cfg.search_split)  # an unknown or empty split: one error line before any work
        inputs["search_split"] = ctx.split_hash(cfg.search_split)
    mcfg = ctx.cfg.model
    # quantize.original makes another artifact: switching it must not redo this one; search_split
    # unset is the search as it was before the option, QAT off the stage as before it (same key)
    config = {**{k: v for k, v in asdict(cfg).items() if k not in ("original", "original_search_images")
                 and not (k == "search_split" and v is None)
                 and not (k.startswith("qat_") and not cfg.qat_steps)},  # QAT off: the key as before it
              "model_ref": model_ref, "max_length": int(mcfg.max_length), **ctx.decoding_key(),
              "batch_size": int(mcfg.batch_size)}
    log.info(f"[quantize] model: {model_ref}"
             + (" (handed over by prune)" if model_ref != "original" and cfg.model == "auto" else ""))
    with ctx.output(ctx.artifact_name("quantize", cfg.name), config, inputs) as out:
        if out.reused:
            log.info(f"[quantize] unchanged, reused {out.path}")
            log.info(summary_line(out.metrics))
            return out.manifest
        metrics = _quantize(cfg, ctx, model_ref, calib_set, out.path)
        out.metrics.update(metrics)
    log.info(summary_line(metrics))
    return out.manifest


def _has_corpus(ctx: StageContext) -> bool:
    return (ctx.artifacts_dir / "corpus" / "manifest.json").is_file()


def _quantize(cfg: QuantizeConfig, ctx: StageContext, model_ref: str, calib_set, folder: Path) -> dict:
    mcfg = ctx.cfg.model
    max_length, batch, threads = int(mcfg.max_length), int(mcfg.batch_size), int(mcfg.threads or 0)
    adapter = ctx.load_model(model_ref)
    scratch = folder / ".work"
    scratch.mkdir()
    started = time.perf_counter()
    phases = Phases()
    lap = phases.lap
    alpha = plan_smoothquant(cfg.plan) if cfg.plan else cfg.smoothquant
    qat_cfg = plan_qat(cfg.plan) if cfg.plan else (
        {"steps": cfg.qat_steps, "lr": cfg.qat_lr, "images": cfg.qat_images,
         **({"precision": cfg.qat_precision} if cfg.qat_precision != "fp32" else {})} if cfg.qat_steps else None)
    prepared = prepare.prepared_graphs(adapter, ctx.model_hash(model_ref), calib_set, ctx, scratch, alpha=alpha,
                                       qat_cfg=qat_cfg, calib_rows=cfg.calib_images, workers=cfg.workers,
                                       qat_minutes=cfg.qat_minutes)
    adapter, graphs, reference = prepared.adapter, prepared.graphs, prepared.reference
    groups = find_groups(onnx.load(str(graphs.encoder_std)), graphs.memory_length, graphs.hidden_size)
    by_name = {g.name: g for g in groups}
    given = load_plan(cfg.plan, list(by_name), list(METHODS)) if cfg.plan else None
    acts = given.ort_cpu_activations if given else cfg.ort_cpu_activations

    lap('float graphs')
    search_images, search_truths, search_set = search_rows(ctx, adapter, calib_set, cfg.calib_images,
                                                           cfg.search_images, cfg.search_split)
    sens_images = calib_images(calib_set, cfg.calib_images, cfg.calib_images + cfg.sensitivity_images)
    reads = SearchReads(graphs.open_readers(threads, cfg.workers), search_images, search_truths, max_length, batch,
                        cfg.budget, search_chunk(cfg.search_chunk, cfg.workers, batch))
    # the loss is against the float model handed over (with QAT on, not the finetuned one: same decoders)
    reads.float_reading = float_reading = reads.read(reference.encoder_std)
    ref_memory = encoder_outputs(graphs.package, graphs.encoder_std, sens_images)

    def reader():
        return CalibSetReader(calib_set, "images", batch_size=8, limit=cfg.calib_images,
                              extra_feeds=token_feeds(graphs.package.token_policy))

    lap('float reading of the search set')
    # 1. calibration methods side by side, on the ort_cpu graph with every weight group INT8: the same
    # groups as in the plain graph, but the fused attention leaves ORT's histogram calibrators
    # 16 tensors to watch instead of 32 (the 1024 x 1024 attention maps among them)
    enc = EncoderGraphs(graphs, scratch, by_name, {g.name: g for g in find_groups(onnx.load(str(graphs.encoder_ort)))},
                        acts)
    method_rows, method_readings = compare_methods(enc, [] if given else cfg.methods, reader, reads, ref_memory,
                                                   sens_images, ctx.progress)
    chosen = given.method if given else cfg.method if cfg.method != "auto" else max(
        method_rows, key=lambda m: (round(m["exact_match"], 6), m["snr_db"]))["method"]
    if chosen not in enc.ort_caches:
        enc.calibrate_ort(reader(), chosen)
    cache = scratch / f"ranges.{chosen}.json"  # the plain graph's ranges, attention products included
    qdq.calibrate(graphs.encoder_std, reader(), chosen, cache)

    lap('calibration methods and ranges')
    # 2. sensitivity, both views (a given plan carries the numbers it was made with)
    sens_started = time.perf_counter()
    if given:
        all_int8_score, sens = given_sensitivity(given, groups, cfg.metric)
    else:
        all_int8_score, sens = sensitivity.measure(
            [g.name for g in groups], lambda names: encoder_outputs(
                graphs.package, enc.plain(cache, chosen, names, scratch / "probe.onnx"), sens_images),
            ref_memory, sensitivity.metric(cfg.metric), ctx.progress)
    sens_seconds = time.perf_counter() - sens_started
    lap('sensitivity')
    ranked = sensitivity.ranking(sens)

    # 3. the plan: given, or searched (one search for the plain graph, the ort_cpu graph, the decoder)
    search_started = time.perf_counter()
    if given:
        plan, std = given, apply_given(given, enc, reads, cache, cfg.plan)
    else:
        plan, std = search_plain(enc, ranked, groups, sens, reads, cache, chosen, ctx.progress)
    lap('plan search (plain graph)')
    # 3b. the ort_cpu encoder's own plan, searched on that graph: its attention is fused and float,
    # so only the projections are groups, and the attention products that cost the plain graph's
    # plan most of its budget are not there to spend it (same ranking, same budget, same search set)
    if given:
        check_given_ort(plan, enc)
        ort = PlanSearch(-1)
    else:
        ort = search_ort(enc, plan, ranked, chosen, method_readings, reads, ctx.progress)
    lap('plan search (ort_cpu graph)')
    search_seconds = time.perf_counter() - search_started

    # 4. the deliverables: both QDQ encoders from the plan
    int8 = plan.int8_groups()
    ort_int8 = [n for n in plan.ort_cpu_int8_groups() if n in enc.ort_groups]
    final_std = enc.plain(cache, chosen, int8, folder / QDQ_ENCODER)
    final_ort = enc.ort(chosen, ort_int8, folder / QDQ_ENCODER_ORT)
    # the search read these very graphs already (same plan, same images): reuse those readings
    final_reading = std.readings.get(std.float_count) or reads.read(final_std)
    ort_reading = ort.readings.get(ort.float_count) or reads.read(final_ort)

    lap('final encoders and their readings')
    # 4b. the ort_cpu decoder: 8-bit weights node by node, as many as the budget allows with the
    # encoder plan in place (the loss is measured against the package with the float decoder)
    decoder_reading, decoder_trace, decoder_sens = None, [], []
    if (given.decoder == "int8") if given else cfg.decoder:
        n_dec, dec_images, dec_truths, dec_set = decoder_search_set(
            calib_set, cfg.calib_images, cfg.decoder_search_images, cfg.search_split, search_images, search_truths)
        with optional_part("quantize's ort_cpu decoder plan", "quantize.decoder=false"):
            decoder_reading, decoder_trace, decoder_sens = decoder_plan(
                graphs, folder, scratch, plan, given, dec_images, dec_truths, dec_set, sens_images, max_length,
                batch, threads, cfg.workers, cfg.budget, reads.chunk, ctx.progress,
                # the same rows as the search set: the ort_cpu encoder's reading with the float decoder is made
                ort_reading if n_dec == len(search_truths) else None, cfg.decoder_cross_kv)
    else:
        plan.decoder, plan.decoder_nodes, plan.decoder_cross_kv = "float", {}, "float"
    lap('decoder plan')
    plan.measured = {
        "search_set": search_set,
        "float_exact_match": float_reading.exact_match, "float_cer": float_reading.cer,
        "plan_exact_match": final_reading.exact_match, "plan_cer": final_reading.cer,
        "ort_cpu_exact_match": ort_reading.exact_match, "ort_cpu_cer": ort_reading.cer,
        "int8_mac_share": plan.int8_mac_share(), "all_int8_" + cfg.metric: json_number(all_int8_score),
        **(decoder_reading or {}),
    }
    plan.smoothquant, plan.ort_cpu_activations, plan.qat = alpha, acts, qat_cfg
    plan.save(folder / "plan.json")

    # 5. the check on eval formulas, beside the anchors (NNCF's judged by our reading of the search set)
    table = check_on_eval(cfg, ctx, adapter, graphs, folder, calib_set, by_name, plan, scratch, search_seconds,
                          reads.validate, len(search_truths), reference) if cfg.check or cfg.anchors else []
    lap('check on eval and anchors')
    metrics = {
        "model": model_ref, "method": chosen, "methods": method_rows, "groups": len(groups),
        "applied_plan": cfg.plan, "carried": plan.carried,
        "int8_groups": len(int8), "float_groups": sorted(set(by_name) - set(int8)),
        "int8_mac_share": plan.int8_mac_share(), "met_budget": plan.met_budget, "budget": cfg.budget,
        "search": plan.measured, "search_n": len(search_truths), "search_trace": std.trace,
        "ort_cpu_search_trace": ort.trace,
        # the deployable ort_cpu plan's reading of the search set against float: its loss and how finely
        # the search set resolves it
        "ort_cpu_search": {"loss": float_reading.exact_match - ort_reading.exact_match,
                           **ort_reading.paired(float_reading)},
        "ort_cpu_int8_groups": len(ort_int8), "ort_cpu_groups": len(enc.ort_groups),
        "ort_cpu_int8_mac_share": mac_share(by_name, set(ort_int8)), "anchors": table,
        "decoder_search_trace": decoder_trace, "decoder_sensitivity": decoder_sens,
        "sensitivity": [{"group": s.group, "only": json_number(s.only), "all_but": json_number(s.all_but),
                         "gain": json_number(s.gain), "macs": by_name[s.group].macs, "kind": by_name[s.group].kind}
                        for s in ranked],
        "all_int8_score": json_number(all_int8_score), "metric": cfg.metric, "smoothquant": alpha,
        "ort_cpu_activations": acts,
        "smoothing": prepared.smoothing, "qat": prepared.qat,
        "seconds": {"sensitivity": round(sens_seconds, 1), "search": round(search_seconds, 1),
                    "total": round(time.perf_counter() - started, 1)},
        "phase_seconds": phases.seconds,
        "decoder": report.decoder_line(plan),
        "decoder_precision": plan.decoder,
    }
    (folder / "quantize.json").write_text(json.dumps(metrics, indent=2) + "\n")
    report.plots(folder, ranked, by_name, cfg.metric, table)
    report.write_report(folder, metrics, plan)
    shutil.rmtree(scratch)
    if not plan.met_budget and given:
        log.warning(f"[quantize] the plan from {cfg.plan} loses {std.trace[0]['loss']:.1%} exact match on the search "
                    f"set (TensorRT/Metax graph), over the budget of {cfg.budget:.1%}; written as given, marked as such")
    elif not plan.met_budget:
        log.warning(f"[quantize] no plan met the budget of {cfg.budget:.3f} exact-match loss; "
                    f"the best found is written to plan.json, marked as such")
    note = resolution_note(metrics)
    if note:
        log.warning(f"[quantize] {note}")
    return metrics
