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
(``quantize.decoder``, on by default); the other targets' decoders stay float (export casts them to
FP16 for TensorRT / Metax).
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

import numpy as np
import onnx
from tqdm import tqdm

from calibration import sensitivity
from calibration.calibrators import METHODS, CalibSetReader, calib_images, load_calib_set
from pipeline import readings
from pipeline.context import StageContext, file_hash
from pipeline.data.render import render_inputs
from pipeline.errors import PipelineError, optional_part
from pipeline.quantization import anchors, qdq
from pipeline.quantization import decoder as qdec
from pipeline.quantization.groups import find_groups
from pipeline.quantization.measure import Reading, encoder_outputs, latency, loss_against, read, read_or_reject
from pipeline.quantization.plan import GroupPlan, Plan, load as load_plan, qat_of as plan_qat, \
    smoothquant_of as plan_smoothquant
from pipeline.quantization.graphs import FloatGraphs, float_graphs
from pipeline.names import INT8_DECODERS, QDQ_ENCODER, QDQ_ENCODER_ORT, QUANTIZE_ORIGINAL
from pipeline.reports import Phases, markdown_table, plt, savefig

NAME = "quantize"
CONFIG_KEY = "quantize"
log = logging.getLogger(__name__)
DECODERS = INT8_DECODERS  # ort_cpu: 8-bit weights, float activations


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
            _print_summary(out.metrics)
            return out.manifest
        metrics = _quantize(cfg, ctx, model_ref, calib_set, out.path)
        out.metrics.update(metrics)
    _print_summary(metrics)
    return out.manifest


def _has_corpus(ctx: StageContext) -> bool:
    return (ctx.artifacts_dir / "corpus" / "manifest.json").is_file()


def _quantize(cfg: QuantizeConfig, ctx: StageContext, model_ref: str, calib_set, folder: Path) -> dict:
    mcfg = ctx.cfg.model
    max_length, batch = int(mcfg.max_length), int(mcfg.batch_size)
    adapter = ctx.load_model(model_ref)
    scratch = folder / ".work"
    scratch.mkdir()
    started = time.perf_counter()
    phases = Phases()
    lap = phases.lap
    alpha = plan_smoothquant(cfg.plan) if cfg.plan else cfg.smoothquant
    graph_key = ctx.model_hash(model_ref)
    smoothing: dict = {}
    if alpha is not None:  # the chain's model stays as it is: only the graphs made here are smoothed
        adapter, smoothing, rows_hash = _smoothed(adapter, calib_set, cfg.calib_images, alpha)
        graph_key += f":smoothquant={alpha}:{rows_hash}"
    qat_cfg = plan_qat(cfg.plan) if cfg.plan else (
        {"steps": cfg.qat_steps, "lr": cfg.qat_lr, "images": cfg.qat_images,
         **({"precision": cfg.qat_precision} if cfg.qat_precision != "fp32" else {})} if cfg.qat_steps else None)
    qat_report: dict = {}
    reference = None  # the float model's graphs when the quantized ones are made from finetuned weights
    if qat_cfg:
        (scratch / "reference").mkdir()
        reference = float_graphs(adapter, scratch / "reference", max_length, graph_key, threads=int(mcfg.threads or 0))
        with optional_part("quantize's quantization-aware finetune", "quantize.qat_steps=0"):
            adapter, qat_report, rows_hash = _qat(adapter, calib_set, cfg, qat_cfg, ctx, reference, graph_key)
        graph_key += f":qat={json.dumps(qat_cfg, sort_keys=True)}:{rows_hash}"
    graphs: FloatGraphs = float_graphs(adapter, scratch, max_length, graph_key, threads=int(mcfg.threads or 0))
    reference = reference or graphs
    groups = find_groups(onnx.load(str(graphs.encoder_std)), graphs.memory_length, graphs.hidden_size)
    by_name = {g.name: g for g in groups}
    given = load_plan(cfg.plan, list(by_name), list(METHODS)) if cfg.plan else None
    acts = given.ort_cpu_activations if given else cfg.ort_cpu_activations

    lap('float graphs')
    search_images, search_truths, search_set = _search_set(cfg, ctx, adapter, calib_set)
    sens_images = calib_images(calib_set, cfg.calib_images, cfg.calib_images + cfg.sensitivity_images)
    package = graphs.package  # encoder outputs (sensitivity)
    readers = graphs.open_readers(int(mcfg.threads or 0), cfg.workers)  # greedy readings of the search set
    # the loss is against the float model handed over (with QAT on, not the finetuned one: same decoders)
    float_reading = read(readers, reference.encoder_std, search_images, search_truths, max_length, batch)
    ref_memory = encoder_outputs(package, graphs.encoder_std, sens_images)
    score = sensitivity.metric(cfg.metric)

    def reader(limit: int):
        return CalibSetReader(calib_set, "images", batch_size=8, limit=limit)

    def build(model: Path, cache: Path, method: str, names, out: Path) -> Path:
        qdq.quantize(model, out, cache, method, [by_name[n].node for n in names])
        return out

    lap('float reading of the search set')
    # 1. calibration methods side by side, on the ort_cpu graph with every weight group INT8: the same
    # groups as in the plain graph, but the fused attention leaves ORT's histogram calibrators
    # 16 tensors to watch instead of 32 (the 1024 x 1024 attention maps among them)
    ort_groups = {g.name: g for g in find_groups(onnx.load(str(graphs.encoder_ort)))}
    ort_caches: dict[str, Path] = {}
    method_rows = []
    method_readings: dict[str, Reading] = {}  # the ort_cpu graph, every projection INT8, per method

    def calibrate_ort(method: str) -> float:
        ort_caches[method] = scratch / f"ranges.ort_cpu.{method}.json"
        return qdq.calibrate(graphs.encoder_ort, reader(cfg.calib_images), method, ort_caches[method])

    for method in tqdm([] if given else cfg.methods, desc="calibration methods", disable=not ctx.progress):
        seconds = calibrate_ort(method)
        variant = scratch / f"enc.{method}.onnx"
        qdq.quantize(graphs.encoder_ort, variant, ort_caches[method], method,
                     [g.node for g in ort_groups.values() if g.kind == "weights"], acts)
        r = method_readings[method] = read(readers, variant, search_images, search_truths, max_length, batch)
        method_rows.append({"method": method, "exact_match": r.exact_match, "cer": r.cer,
                            "snr_db": sensitivity.SNR().score(ref_memory, encoder_outputs(package, variant, sens_images)),
                            "identical": r.identical_to(float_reading), "calibration_s": round(seconds, 1)})
    if given:
        chosen = given.method
    else:
        chosen = cfg.method if cfg.method != "auto" else max(
            method_rows, key=lambda m: (round(m["exact_match"], 6), m["snr_db"]))["method"]
    if chosen not in ort_caches:
        calibrate_ort(chosen)
    cache = scratch / f"ranges.{chosen}.json"  # the plain graph's ranges, attention products included
    qdq.calibrate(graphs.encoder_std, reader(cfg.calib_images), chosen, cache)

    lap('calibration methods and ranges')
    def memory_with(names) -> np.ndarray:
        return encoder_outputs(package, build(graphs.encoder_std, cache, chosen, names, scratch / "probe.onnx"), sens_images)

    # 2. sensitivity, both views (a given plan carries the numbers it was made with)
    sens_started = time.perf_counter()
    if given:
        sens = [sensitivity.GroupSensitivity(g.name, *[float(given.groups[g.name].sensitivity.get(k, float("nan")))
                                                        if g.name in given.groups else float("nan")
                                                        for k in ("only", "all_but", "gain")]) for g in groups]
        all_int8_score = float(given.measured.get("all_int8_" + cfg.metric, float("nan")))
    else:
        all_int8_score, sens = sensitivity.measure([g.name for g in groups], memory_with, ref_memory, score,
                                                   ctx.progress)
    sens_seconds = time.perf_counter() - sens_started
    lap('sensitivity')
    ranked = sensitivity.ranking(sens)

    # 3. the plan: given, or searched
    search_started = time.perf_counter()
    chunk = _chunk(cfg, batch)
    trace: list[dict] = []
    std_readings: dict[int, Reading] = {}  # groups returned to float -> the search set's reading
    if given:
        plan = given
        for name in by_name:  # groups the file leaves out stay float
            plan.groups.setdefault(name, GroupPlan("float", by_name[name].node, by_name[name].kind, by_name[name].macs))
        for name, g in plan.groups.items():  # the file's nodes and MACs are of the graph it was made on
            g.node, g.kind, g.macs = by_name[name].node, by_name[name].kind, by_name[name].macs
        int8 = plan.int8_groups()
        r = read(readers, build(graphs.encoder_std, cache, chosen, int8, scratch / "plan.onnx"),
                 search_images, search_truths, max_length, batch)
        loss = float_reading.exact_match - r.exact_match
        plan.met_budget = loss <= cfg.budget + 1e-9
        plan.budget = cfg.budget
        trace.append({"float_groups": len(by_name) - len(int8), "exact_match": r.exact_match, "loss": loss,
                      **r.paired(float_reading)})
        plan.note = f"applied from {cfg.plan}" + (f"; {carried_line(plan.carried)}" if plan.carried else "")
        std_readings[len(by_name) - len(int8)] = r
        k = len(by_name) - len(int8)
    else:
        order = [r.group for r in ranked]

        def loss_with_float(k: int) -> float:
            names = [g for g in by_name if g not in set(order[:k])]
            r = read_or_reject(readers, build(graphs.encoder_std, cache, chosen, names, scratch / "plan.onnx"),
                               search_images, search_truths, max_length, batch, float_reading, cfg.budget, chunk)
            std_readings[k] = r
            loss = loss_against(r, float_reading)
            trace.append({"float_groups": k, "returned": order[k - 1] if k else None, "exact_match": r.exact_match,
                          "cer": r.cer, "loss": loss, "n": len(r.exact), **r.paired(float_reading),
                          "int8_mac_share": _mac_share(by_name, names)})
            return loss

        k = _smallest_within(loss_with_float, len(order), cfg.budget, ctx.progress)
        float_set = set(order[:k])
        plan = Plan(method=chosen, budget=cfg.budget, met_budget=True, groups={
            g.name: GroupPlan("float" if g.name in float_set else "int8", g.node, g.kind, g.macs,
                              {"only": _num(x.only), "all_but": _num(x.all_but), "gain": _num(x.gain)})
            for g, x in zip(groups, sens)})
        if k == len(order):
            plan.note = "every group float: no INT8 group fits the budget on the search set"

    lap('plan search (plain graph)')
    # 3b. the ort_cpu encoder's own plan, searched on that graph: its attention is fused and float,
    # so only the projections are groups, and the attention products that cost the plain graph's
    # plan most of its budget are not there to spend it (same ranking, same budget, same search set)
    ort_trace: list[dict] = []
    ort_readings: dict[int, Reading] = {}
    k_ort = -1
    if given:
        unknown = sorted(set(plan.ort_cpu_groups) - set(ort_groups))
        if unknown:
            raise PipelineError(f"quantize.plan: ort_cpu_groups {', '.join(unknown[:5])} are not projections of the "
                                f"ort_cpu graph (its attention is fused): known {', '.join(ort_groups)}")
    else:
        ort_order = [r.group for r in ranked if r.group in ort_groups]

        def ort_loss_with_float(k: int) -> float:
            names = ort_order[k:]
            if chosen in method_readings and set(names) == {n for n, g in ort_groups.items() if g.kind == "weights"}:
                r = method_readings[chosen]  # the method comparison read this very graph (same ranges, same set)
            else:
                qdq.quantize(graphs.encoder_ort, scratch / "plan.ort.onnx", ort_caches[chosen], chosen,
                             [ort_groups[n].node for n in names], acts)
                r = read_or_reject(readers, scratch / "plan.ort.onnx", search_images, search_truths, max_length,
                                   batch, float_reading, cfg.budget, chunk)
            ort_readings[k] = r
            loss = loss_against(r, float_reading)
            ort_trace.append({"float_groups": k, "returned": ort_order[k - 1] if k else None,
                              "exact_match": r.exact_match, "cer": r.cer, "loss": loss, "n": len(r.exact),
                              **r.paired(float_reading),
                              "int8_mac_share": _mac_share(by_name, names)})
            return loss

        k_ort = _smallest_within(ort_loss_with_float, len(ort_order), cfg.budget, ctx.progress)
        plan.ort_cpu_groups = {n: ("int8" if i >= k_ort else "float") for i, n in enumerate(ort_order)}
    lap('plan search (ort_cpu graph)')
    search_seconds = time.perf_counter() - search_started

    # 4. the deliverables: both QDQ encoders from the plan
    int8 = plan.int8_groups()
    ort_int8 = [n for n in plan.ort_cpu_int8_groups() if n in ort_groups]
    final_std = build(graphs.encoder_std, cache, chosen, int8, folder / QDQ_ENCODER)
    qdq.quantize(graphs.encoder_ort, folder / QDQ_ENCODER_ORT, ort_caches[chosen], chosen,
                 [ort_groups[n].node for n in ort_int8], acts)
    # the search read these very graphs already (same plan, same images): reuse those readings
    final_reading = std_readings.get(k) or read(readers, final_std, search_images, search_truths, max_length, batch)
    ort_reading = ort_readings.get(k_ort) or read(readers, folder / QDQ_ENCODER_ORT, search_images, search_truths,
                                                  max_length, batch)

    lap('final encoders and their readings')
    # 4b. the ort_cpu decoder: 8-bit weights node by node, as many as the budget allows with the
    # encoder plan in place (the loss is measured against the package with the float decoder)
    decoder_reading, decoder_trace, decoder_sens = None, [], []
    if (given.decoder == "int8") if given else cfg.decoder:
        if cfg.search_split:  # the search set's first decoder_search_images formulas
            n_dec = min(cfg.decoder_search_images, len(search_truths))
            dec_images, dec_truths = search_images[:n_dec], search_truths[:n_dec]
            dec_set = f"{cfg.search_split} split, its first {n_dec} formulas"
        else:
            n_dec = cfg.decoder_search_images
            dec_end = cfg.calib_images + n_dec
            dec_images = calib_images(calib_set, cfg.calib_images, dec_end)
            dec_truths = calib_set[cfg.calib_images:dec_end]["text"]
            dec_set = f"calibration-set rows {cfg.calib_images}..{dec_end - 1}"
        with optional_part("quantize's ort_cpu decoder plan", "quantize.decoder=false"):
            decoder_reading, decoder_trace, decoder_sens = _decoder_plan(
                cfg, graphs, folder, scratch, plan, given, dec_images, dec_truths, dec_set, sens_images, max_length,
                batch, int(mcfg.threads or 0), ctx.progress,
                # the same rows as the search set: the ort_cpu encoder's reading with the float decoder is made
                ort_reading if n_dec == len(search_truths) else None)
    else:
        plan.decoder, plan.decoder_nodes = "float", {}
    lap('decoder plan')
    plan.measured = {
        "search_set": search_set,
        "float_exact_match": float_reading.exact_match, "float_cer": float_reading.cer,
        "plan_exact_match": final_reading.exact_match, "plan_cer": final_reading.cer,
        "ort_cpu_exact_match": ort_reading.exact_match, "ort_cpu_cer": ort_reading.cer,
        "int8_mac_share": plan.int8_mac_share(), "all_int8_" + cfg.metric: _num(all_int8_score),
        **(decoder_reading or {}),
    }
    plan.smoothquant, plan.ort_cpu_activations, plan.qat = alpha, acts, qat_cfg
    plan.save(folder / "plan.json")

    # 5. the check on eval formulas, beside the anchors
    def validate(encoder: Path, idx: list[int]) -> tuple[float, list[float]]:
        """Rows ``idx`` of the search set read with ``encoder``: what NNCF's anchor is judged by."""
        r = read(readers, encoder, search_images[idx], [search_truths[i] for i in idx], max_length, batch)
        return r.exact_match, [float(e) for e in r.exact]

    table = _check_on_eval(cfg, ctx, adapter, graphs, folder, calib_set, by_name, plan, scratch, search_seconds,
                           validate, len(search_truths), reference) if cfg.check or cfg.anchors else []
    lap('check on eval and anchors')
    metrics = {
        "model": model_ref, "method": chosen, "methods": method_rows, "groups": len(groups),
        "applied_plan": cfg.plan, "carried": plan.carried,
        "int8_groups": len(int8), "float_groups": sorted(set(by_name) - set(int8)),
        "int8_mac_share": plan.int8_mac_share(), "met_budget": plan.met_budget, "budget": cfg.budget,
        "search": plan.measured, "search_n": len(search_truths), "search_trace": trace,
        "ort_cpu_search_trace": ort_trace,
        # the deployable ort_cpu plan's reading of the search set against float: its loss and how finely
        # the search set resolves it
        "ort_cpu_search": {"loss": float_reading.exact_match - ort_reading.exact_match,
                           **ort_reading.paired(float_reading)},
        "ort_cpu_int8_groups": len(ort_int8), "ort_cpu_groups": len(ort_groups),
        "ort_cpu_int8_mac_share": _mac_share(by_name, set(ort_int8)), "anchors": table,
        "decoder_search_trace": decoder_trace, "decoder_sensitivity": decoder_sens,
        "sensitivity": [{"group": s.group, "only": _num(s.only), "all_but": _num(s.all_but), "gain": _num(s.gain),
                         "macs": by_name[s.group].macs, "kind": by_name[s.group].kind} for s in ranked],
        "all_int8_score": _num(all_int8_score), "metric": cfg.metric, "smoothquant": alpha,
        "ort_cpu_activations": acts,
        "smoothing": smoothing, "qat": qat_report,
        "seconds": {"sensitivity": round(sens_seconds, 1), "search": round(search_seconds, 1),
                    "total": round(time.perf_counter() - started, 1)},
        "phase_seconds": phases.seconds,
        "decoder": (f"ort_cpu: {sum(v == 'int8' for v in plan.decoder_nodes.values())} of {len(plan.decoder_nodes)} "
                    f"weight matrices in 8 bits (ORT MatMulNBits, blocks of {qdec.BLOCK}, symmetric), the rest FP32"
                    if plan.decoder == "int8" else "ort_cpu: float (FP32)")
                   + "; TensorRT / Metax: float (export casts it to FP16)",
        "decoder_precision": plan.decoder,
    }
    (folder / "quantize.json").write_text(json.dumps(metrics, indent=2) + "\n")
    _plots(folder, ranked, by_name, cfg.metric, table)
    _write_report(folder, metrics, plan)
    shutil.rmtree(scratch)
    if not plan.met_budget and given:
        log.warning(f"[quantize] the plan from {cfg.plan} loses {trace[0]['loss']:.1%} exact match on the search set "
                    f"(TensorRT/Metax graph), over the budget of {cfg.budget:.1%}; written as given, marked as such")
    elif not plan.met_budget:
        log.warning(f"[quantize] no plan met the budget of {cfg.budget:.3f} exact-match loss; "
                    f"the best found is written to plan.json, marked as such")
    note = resolution_note(metrics)
    if note:
        log.warning(f"[quantize] {note}")
    return metrics


def carried_line(carried: dict[str, list[str]]) -> str:
    """How an applied plan's groups were mapped onto this graph's (a pooled layer's q/k/v onto a merged qkv)."""
    return "groups carried over by what they are: " + ", ".join(
        f"{', '.join(f'`{s}`' for s in src)} → `{dst}`" for dst, src in sorted(carried.items()))


def resolution_note(m: dict) -> Optional[str]:
    """One line when the budget is finer than the search set resolves: the ort_cpu plan's loss there has
    a paired standard error above the budget, so other formulas may well see a loss over it
    (docs/quantize.md: plans that read within one formula of float on the search set lost 1.2 points
    on the whole eval split)."""
    r = m.get("ort_cpu_search")
    if not r or r["loss_se"] <= m["budget"]:
        return None
    return (f"the budget ({m['budget']:.1%} exact match) is finer than the {m['search_n']} search formulas resolve: "
            f"the ort_cpu plan's loss there is {r['loss']:+.1%} with a paired standard error of {r['loss_se']:.1%} "
            f"({r['gained']} formulas gained, {r['lost']} lost vs float), so on other formulas it may exceed the "
            f"budget; more search formulas resolve it better (quantize.search_split=train "
            f"quantize.search_images=2000: the whole train split)")


def _smoothed(adapter, calib_set, rows: int, alpha: float):
    """A copy of ``adapter`` with SmoothQuant folded in from the activation maxima of the first ``rows``
    calibration images, each pair's channel range before / after, and a fingerprint of those images
    (the smoothed graphs' cache key)."""
    import hashlib

    import torch

    from pipeline.quantization import smooth

    images = calib_images(calib_set, 0, rows)
    smoothed, report = smooth.smoothed_copy(adapter, torch.from_numpy(images), alpha)
    return smoothed, report, hashlib.sha256(images.tobytes()).hexdigest()[:16]


def _qat(adapter, calib_set, cfg: QuantizeConfig, qat_cfg: dict, ctx: StageContext, reference: FloatGraphs,
         model_key: str):
    """A copy of ``adapter`` whose encoder learnt to tolerate INT8 (:mod:`pipeline.quantization.qat`),
    its report, and a fingerprint of the rows it saw (the graphs' cache key). The fake quantizers'
    ranges: the 99.99th percentile (the stage's default method) over the first ``calib_images`` rows;
    the training images: the first ``images`` rows; the targets the student is teacher-forced on:
    the float model's greedy readings of them by ``reference``'s float ONNX Runtime package: 60 s
    for 512 images of the original model against torch's KV-cached 336 s; in this setting the
    finetuned graphs came out byte-identical to those from torch's targets (docs/quantize.md)."""
    import hashlib

    import torch

    from pipeline.quantization import qat

    mcfg = ctx.cfg.model
    if int(qat_cfg["images"]) > len(calib_set):
        log.warning(f"[quantize] qat_images={qat_cfg['images']}: the calibration set holds {len(calib_set)} rows; "
                    f"the finetune trains on those {len(calib_set)}")
    images = calib_images(calib_set, 0, min(int(qat_cfg["images"]), len(calib_set)))
    ids, how = readings.greedy_readings(ctx, adapter, model_key, images, "onnxruntime", cfg.workers,
                                        "QAT's targets (the float package's readings)",
                                        packages=reference.open_readers(int(mcfg.threads or 0), cfg.workers))
    read_s = how["seconds"]
    ranges = torch.from_numpy(images[:cfg.calib_images])
    finetuned, report = qat.finetuned_copy(
        adapter, ranges, torch.from_numpy(images), steps=int(qat_cfg["steps"]), lr=float(qat_cfg["lr"]),
        minutes=cfg.qat_minutes, seed=ctx.seed, max_length=int(mcfg.max_length), read_batch=int(mcfg.batch_size),
        progress=ctx.progress, targets=readings.with_bos(adapter, ids), precision=qat_cfg.get("precision", "fp32"),
        device=ctx.device)
    report.update(teacher_readings="float ONNX Runtime package" + (" (cached)" if how["cached"] else ""),
                  teacher_readings_seconds=round(read_s, 1),
                  seconds=round(report["seconds"] + read_s, 1))
    return finetuned, report, hashlib.sha256(images.tobytes()).hexdigest()[:16]


def _decoder_plan(cfg: QuantizeConfig, graphs: FloatGraphs, folder: Path, scratch: Path, plan: Plan, given,
                  images: np.ndarray, truths, rows: str, sens_images: np.ndarray, max_length: int, batch: int,
                  threads: int,
                  progress: bool, base: Optional[Reading] = None) -> tuple[dict, list[dict], list[dict]]:
    """Rank the decoder-step weight matrices by the logit SNR each costs alone in 8 bits (recorded
    greedy step inputs), then return the most sensitive to float until the exact-match loss on the
    decoder search set, against the same package with the float decoder, is within the budget.
    Writes the two INT8 decoder graphs when any node stays INT8; sets ``plan.decoder*``."""
    import onnxruntime as ort

    mm = {}
    for g in DECODERS:
        if (graphs.package_dir / f"{g}.onnx").is_file():
            mm[g] = scratch / f"{g}.matmul.onnx"
            onnx.save(qdec.to_matmul(onnx.load(str(graphs.package_dir / f"{g}.onnx"))), str(mm[g]))
    step_model = onnx.load(str(mm["decoder_step"]))
    step_nodes = qdec.weight_nodes(step_model)
    # the other decoder graphs' nodes -> the step's weights they hold (followed by every candidate plan)
    parts = {g: qdec.weight_parts(step_model, onnx.load(str(mm[g]))) for g in mm if g != "decoder_step"}

    def made(int8_step: list[str], tag: str) -> dict[str, Path]:
        out = {"decoder_step": scratch / f"decoder_step.{tag}.onnx", "decoder_first": scratch / f"decoder_first.{tag}.onnx"}
        qdec.quantize(mm["decoder_step"], out["decoder_step"], int8_step)
        qdec.quantize(mm["decoder_first"], out["decoder_first"], qdec.follow_plan(parts["decoder_first"], int8_step))
        return out

    def reading(decoders: dict[str, Path], against: Optional[Reading] = None) -> Reading:
        readers = graphs.open_readers(threads, cfg.workers, decoders)
        if against is None:
            return read(readers, folder / QDQ_ENCODER_ORT, images, truths, max_length, batch)
        return read_or_reject(readers, folder / QDQ_ENCODER_ORT, images, truths, max_length, batch, against,
                              cfg.budget, _chunk(cfg, batch))

    if base is None:
        base = read(graphs.open_readers(threads, cfg.workers), folder / QDQ_ENCODER_ORT, images, truths, max_length,
                    batch)
    by_plan: dict[tuple, Reading] = {}  # INT8 nodes -> reading
    trace: list[dict] = []
    sens: list[dict] = []
    if given is not None:
        int8 = [n for n, p in given.decoder_nodes.items() if p == "int8"] if given.decoder_nodes else list(step_nodes)
        unknown = sorted(set(given.decoder_nodes) - set(step_nodes))
        if unknown:
            raise PipelineError(f"quantize.plan: {len(unknown)} decoder node(s) not in this model's decoder_step "
                                f"graph: {', '.join(unknown[:5])}")
    else:
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads or 0
        so.log_severity_level = 3
        feeds = qdec.StepFeeds(graphs.open_package(threads), sens_images, max_length)
        ref = feeds.logits(ort.InferenceSession(str(mm["decoder_step"]), so, providers=["CPUExecutionProvider"]))
        snr = sensitivity.SNR()
        for node in tqdm(step_nodes, desc="decoder sensitivity", disable=not progress):
            probe = scratch / "decoder_step.probe.onnx"
            qdec.quantize(mm["decoder_step"], probe, [node])
            out = feeds.logits(ort.InferenceSession(str(probe), so, providers=["CPUExecutionProvider"]))
            sens.append({"node": node, "logit_snr_db": _num(snr.score(ref, out))})
        sens.sort(key=lambda r: r["logit_snr_db"])  # most sensitive first
        order = [r["node"] for r in sens]

        def loss_with_float(k: int) -> float:
            int8_now = order[k:]
            r = by_plan[tuple(int8_now)] = reading(made(int8_now, "search"), base)
            loss = loss_against(r, base)
            trace.append({"float_nodes": k, "returned": order[k - 1] if k else None, "exact_match": r.exact_match,
                          "cer": r.cer, "loss": loss, "n": len(r.exact), "identical": r.identical_to(base),
                          **r.paired(base)})
            return loss

        k = _smallest_within(loss_with_float, len(order), cfg.budget, progress)
        int8 = order[k:]
    final = made(int8, "final")
    if "decoder_verify" in mm:  # not read by the search: a package's speculative readings are its greedy ones
        try:
            nodes = qdec.follow_plan(parts["decoder_verify"], int8)
        except ValueError as exc:
            log.warning(f"[quantize] no INT8 verify graph (the packages decode plain greedy): {exc}")
        else:
            final["decoder_verify"] = scratch / "decoder_verify.final.onnx"
            qdec.quantize(mm["decoder_verify"], final["decoder_verify"], nodes)
    r = by_plan.get(tuple(int8)) or reading(final)  # the search read this very plan already
    plan.decoder = "int8" if int8 else "float"
    plan.decoder_nodes = {n: ("int8" if n in set(int8) else "float") for n in step_nodes}
    if int8:
        for g, path in final.items():
            shutil.copyfile(path, folder / DECODERS[g])
    return ({"decoder_search_set": rows, "decoder_float_exact_match": base.exact_match, "decoder_float_cer": base.cer,
             "ort_cpu_int8_decoder_exact_match": r.exact_match, "ort_cpu_int8_decoder_cer": r.cer,
             "ort_cpu_int8_decoder_identical": r.identical_to(base), "decoder_int8_nodes": len(int8),
             "decoder_nodes": len(step_nodes)}, trace, sens)


def _smallest_within(loss_with_float, n: int, budget: float, progress: bool) -> int:
    """Smallest number of most-sensitive groups returned to float whose loss is within ``budget``,
    assuming the loss does not grow as groups return to float (the binary search's assumption).

    A galloping search from the all-INT8 end: k = 0, 1, 2, 4, ... until a candidate is within the
    budget, then a binary search between the last one over it and that one. Under the assumption it
    returns exactly what a binary search over 0..n returns, but a plan usually returns few groups to
    float, and there the candidates it reads are the cheap ones: a candidate clearly over the budget
    stops after its first chunk (:func:`read_or_reject`) while one within it is read whole, and a
    binary search from the middle reads every candidate above the answer whole (chain run 1: four
    whole readings of 512 formulas for k = 13, 6, 3, 1; galloping: k = 0 stopped, k = 1 whole). Every
    group float is the float model itself (loss 0 by definition): it is never read."""
    bar = tqdm(total=max(1, int(np.ceil(np.log2(n + 1)))), desc="plan search", disable=not progress)
    try:
        if n == 0 or loss_with_float(0) <= budget + 1e-9:
            return 0
        lo, hi = 0, n  # loss(lo) > budget; loss(hi) = 0
        step = 1
        while lo + step < hi:  # gallop: the first within the budget bounds the answer from above
            bar.update()
            if loss_with_float(lo + step) <= budget + 1e-9:
                hi = lo + step
                break
            lo, step = lo + step, step * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            bar.update()
            if loss_with_float(mid) <= budget + 1e-9:
                hi = mid
            else:
                lo = mid
        return hi
    finally:
        bar.close()


def _chunk(cfg: QuantizeConfig, batch: int) -> int:
    """Formulas a search reading takes at a time before it may stop (a whole number of batches for
    every session set, so each batch is the one a whole reading decodes); 0: read every candidate whole."""
    step = batch * max(1, cfg.workers)
    return -(-cfg.search_chunk // step) * step if cfg.search_chunk else 0


def _mac_share(by_name, names) -> float:
    total = sum(g.macs for g in by_name.values())
    return sum(by_name[n].macs for n in names) / total if total else 0.0


def _num(x: float) -> float:
    """A JSON-safe number: +-1e9 for infinities (SNR of an exact match), None-free."""
    if np.isnan(x):
        return float("nan")
    return round(float(x), 4) if np.isfinite(x) else (1e9 if x > 0 else -1e9)


def _split_set(ctx: StageContext, adapter, split: str, limit: int) -> tuple[np.ndarray, list[str]]:
    """The first ``limit`` formulas of a corpus split that render, as model inputs, with their LaTeX."""
    items = render_inputs([(f.id, f.latex) for f in ctx.split(split)], adapter.preprocess, limit,
                          ctx.progress, f"quantize {split}")
    if not items:
        raise PipelineError(f"quantize: no {split}-split formula could be rendered")
    return np.stack([x.numpy() for _, _, x in items]).astype(np.float32), [latex for _, latex, _ in items]


def _search_set(cfg: QuantizeConfig, ctx: StageContext, adapter, calib_set) -> tuple[np.ndarray, list[str], str]:
    """The formulas the plan search reads (images, truths, and a line saying which): calibration-set
    rows after the ranges' rows, or the first ``search_images`` of ``quantize.search_split``."""
    if cfg.search_split:
        images, truths = _split_set(ctx, adapter, cfg.search_split, cfg.search_images)
        return images, truths, f"{cfg.search_split} split, its first {len(truths)} formulas"
    end = cfg.calib_images + cfg.search_images
    return (calib_images(calib_set, cfg.calib_images, end), calib_set[cfg.calib_images:end]["text"],
            f"calibration-set rows {cfg.calib_images}..{end - 1}")


def _check_on_eval(cfg, ctx, adapter, graphs: FloatGraphs, folder: Path, calib_set, by_name, plan: Plan,
                   scratch: Path, search_seconds: float, validate: anchors.Validate | None = None,
                   search_rows: int = 0, reference: FloatGraphs | None = None) -> list[dict]:
    """Float, ours and the anchors on the same eval formulas and session options: one table; the
    accuracy columns also on the other ``quantize.eval_splits`` (the shift split: sources training
    never saw). ``reference``: the float model's graphs when ``graphs`` are of finetuned weights
    (QAT): float and the anchors are of the model handed over, ours of the finetuned one."""
    reference = reference or graphs
    max_length, batch = int(ctx.cfg.model.max_length), int(ctx.cfg.model.batch_size)
    sets = {split: _split_set(ctx, adapter, split, cfg.eval_limit) for split in cfg.eval_splits}
    images, truths = sets[cfg.eval_splits[0]]
    variants: dict[str, tuple[Path, float, float]] = {  # name -> (encoder, INT8 MAC share, search seconds)
        "float (ort_cpu package)": (reference.encoder_ort, 0.0, 0.0),
        "ours (plan, ort_cpu graph)": (folder / QDQ_ENCODER_ORT, _mac_share(by_name, set(plan.ort_cpu_int8_groups())),
                                       search_seconds),
        "ours (plan, TensorRT/Metax graph)": (folder / QDQ_ENCODER, plan.int8_mac_share(), search_seconds),
    }
    decoders = {g: folder / n for g, n in DECODERS.items()} if plan.decoder == "int8" else {}
    packages = {name: graphs.open_readers(int(ctx.cfg.model.threads or 0), cfg.workers,
                                          decoders if name.startswith("ours (plan, ort") else None) for name in variants}
    float_readers = graphs.open_readers(int(ctx.cfg.model.threads or 0), cfg.workers)
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


def _plots(folder: Path, ranked, by_name, metric: str, table: list[dict]) -> None:
    names = [r.group for r in ranked]
    fig, ax = plt.subplots(figsize=(8, max(3.5, 0.28 * len(names))))
    y = np.arange(len(names))
    ax.barh(y + 0.2, [_num(r.gain) for r in ranked], 0.4, color="#ee6677", label="gain when returned to float")
    ax.barh(y - 0.2, [min(_num(r.only), 80) for r in ranked], 0.4, color="#4477aa", label=f"{metric}, only this group INT8")
    ax.set_yticks(y, names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(metric)
    ax.set_title("Per-group quantization sensitivity (most sensitive first)")
    ax.legend(fontsize=7, loc="lower right")
    savefig(fig, folder / "sensitivity.png")
    blocks = sorted({by_name[n].block for n in names}, key=lambda b: (len(b), b))
    roles = sorted({by_name[n].role for n in names})
    grid = np.full((len(roles), len(blocks)), np.nan)
    for r in ranked:
        g = by_name[r.group]
        grid[roles.index(g.role), blocks.index(g.block)] = min(_num(r.only), 80)
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(blocks), 1 + 0.45 * len(roles)))
    im = ax.imshow(grid, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(blocks)), blocks, fontsize=7, rotation=20)
    ax.set_yticks(range(len(roles)), roles, fontsize=7)
    for i in range(len(roles)):
        for j in range(len(blocks)):
            if np.isfinite(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", fontsize=7, color="w")
    fig.colorbar(im, ax=ax, label=f"{metric}, only this group INT8 (low = sensitive)")
    ax.set_title("Sensitivity: layer x block")
    savefig(fig, folder / "sensitivity_heatmap.png")
    _pareto(folder, table)


def _pareto(folder: Path, table: list[dict]) -> None:
    rows = [r for r in table if "total_ms" in r]
    if not rows:  # quantize.check=false: nothing timed here
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    markers = "osD^vP*Xh<>"
    for i, r in enumerate(rows):  # a legend, not labels: the variants near float crowd one corner
        ax.scatter(r["total_ms"], r["exact_match"], s=45, marker=markers[i % len(markers)],
                   label=f"{r['variant']} ({r['total_ms']:.0f} ms, {r['exact_match']:.3f})")
    ax.legend(fontsize=7, loc="center right")  # the collapsed anchors sit at the bottom, the rest at the top
    ax.set_xlabel("end-to-end ms / formula (batch 1, 1 thread)")
    ax.set_ylabel(f"exact match ({rows[0]['n']} eval formulas)")
    ax.set_title("Latency vs exact match")
    savefig(fig, folder / "pareto.png")


def _write_report(folder: Path, m: dict, plan: Plan) -> None:
    ort_int8 = set(plan.ort_cpu_int8_groups())
    resolution = resolution_note(m)
    methods = markdown_table(["method", "exact match", "CER", "encoder SNR dB", "identical tokens vs float",
                              "calibration s"],
                             [[r["method"] + (" **(chosen)**" if r["method"] == m["method"] else ""),
                               f"{r['exact_match']:.3f}", f"{r['cer']:.3f}", f"{r['snr_db']:.1f}",
                               f"{r['identical']:.3f}", r["calibration_s"]] for r in m["methods"]])
    sens = markdown_table(["rank", "group", "kind", "MACs (M)", f"only this INT8 ({m['metric']})",
                           "all but this INT8", "gain", "plan", "plan (ort_cpu graph)"],
                          [[i + 1, f"`{r['group']}`", r["kind"], f"{r['macs'] / 1e6:.0f}", f"{r['only']:.1f}",
                            f"{r['all_but']:.1f}", f"{r['gain']:.1f}", plan.groups[r["group"]].precision,
                            ("int8" if r["group"] in ort_int8 else "float") if r["kind"] == "weights" else "fused, float"]
                           for i, r in enumerate(m["sensitivity"])])
    anchors_rows = []
    others = [sp for sp in next((list(r["splits"]) for r in m["anchors"] if "splits" in r), [])][1:]
    for r in m["anchors"]:
        if "total_ms" not in r:
            anchors_rows.append([r["variant"], "", "", *([""] * 2 * len(others)), "", "", "", "", "", "", "", r["note"]])
            continue
        anchors_rows.append([r["variant"], f"{r['exact_match']:.3f}", f"{r['cer']:.3f}",
                             *(f"{r['splits'][sp][k]:.3f}" for sp in others for k in ("exact_match", "cer")),
                             f"{r['identical_vs_float']:.3f}", f"{r['encoder_ms']:.1f}",
                             f"{r['decoder_ms_per_step']:.2f}", f"{r['total_ms']:.1f}", f"{r['size_mb']:.1f}",
                             f"{r['int8_mac_share']:.2f}", r["search_s"], r["note"]])
    anchors_t = markdown_table(["variant", "exact match", "CER",
                                *(f"{k} ({sp})" for sp in others for k in ("exact match", "CER")),
                                "identical tokens vs float", "encoder ms",
                                "decoder ms/step", "end-to-end ms", "encoder MB", "INT8 share of MatMul MACs",
                                "search s", "note"], anchors_rows)
    s = m["search"]
    def trace_table(rows: list[dict]) -> str:
        return markdown_table(["groups returned to float", "last returned", "exact match", "loss vs float",
                               "gained / lost vs float", "paired SE of the loss", "INT8 MAC share"],
                              [[t["float_groups"], f"`{t.get('returned')}`" if t.get("returned") else "",
                                f"{t['exact_match']:.3f}", f"{t['loss']:+.3f}", _paired_cell(t),
                                f"{t['loss_se']:.3f}" if "loss_se" in t else "",
                                f"{t.get('int8_mac_share', float('nan')):.2f}"] for t in rows])
    trace = trace_table(m["search_trace"])
    if m.get("ort_cpu_search_trace"):
        trace += ("\n\nThe ort_cpu graph (attention fused and float; its projections ranked the same way, "
                  f"searched on that graph): **{m['ort_cpu_int8_groups']} of {m['ort_cpu_groups']} projections "
                  f"INT8**, {m['ort_cpu_int8_mac_share']:.0%} of the encoder's MatMul MACs.\n\n"
                  + trace_table(m["ort_cpu_search_trace"]))
    applied = m.get("applied_plan")
    if applied:
        status = (f"met by the plan applied from `{applied}` (no search)" if m["met_budget"] else
                  f"**NOT met by the plan applied from `{applied}`** (no search: written as given, marked as such)")
        if m.get("carried"):
            status += f"; {carried_line(m['carried'])}"
    else:
        status = "met" if m["met_budget"] else "**NOT met: the best plan found is written, marked as such**"
    if not m["methods"]:
        methods = f"Not compared: the plan's method, {m['method']}."
    n_eval = next((r["n"] for r in m["anchors"] if "n" in r), 0)
    (folder / "report.md").write_text(
        f"# Quantization: {m['model']}\n\n"
        f"Symmetric INT8 (zero point 0), per-channel weights, per-tensor activations, explicit Q/DQ "
        f"(ONNX Runtime `quantize_static`, ranges from ORT's calibrators)"
        + ("; the ort_cpu graph's activations asymmetric UINT8 (zero point fitted to each range: ONNX Runtime "
           "CPU's U8S8)" if m.get("ort_cpu_activations") == "uint8" else "")
        + f". Decoder: {m['decoder']}.\n\n"
        f"Plan: **{m['int8_groups']} of {m['groups']} groups INT8**, {m['int8_mac_share']:.0%} of the encoder's "
        f"MatMul MACs; budget {m['budget']:.3f} exact-match loss vs float: {status}. "
        f"On the search set ({s['search_set']}): float {s['float_exact_match']:.3f} / CER {s['float_cer']:.3f}, "
        f"plan {s['plan_exact_match']:.3f} / {s['plan_cer']:.3f} (ort_cpu graph {s['ort_cpu_exact_match']:.3f}"
        + ").\n\n" + (f"**Resolution:** {resolution}.\n\n" if resolution else "")
        + _decoder_section(m) +
        f"Files: `plan.json` (edit a precision, feed it back with `quantize.plan=FILE`), `{QDQ_ENCODER}` "
        f"(TensorRT, Metax), `{QDQ_ENCODER_ORT}` (ONNX Runtime CPU, attention fused and float).\n\n"
        f"## Calibration methods (weight groups INT8, search set)\n\n{methods}\n\n{_smoothing_line(m)}\n\n"
        f"{_qat_line(m)}\n\n"
        f"## Sensitivity ({m['metric']} of the encoder output on calibration images; "
        f"all groups INT8: {m['all_int8_score']:.1f})"
        + (f": the numbers the plan file carries, measured on the model it was made for" if applied else "")
        + f"\n\n{sens}\n\n![sensitivity](sensitivity.png)\n\n"
        f"![heat map](sensitivity_heatmap.png)\n\n## Plan search (binary search over the ranking)\n\n"
        f"Loss: the float model's exact match minus the plan's on the {m['search_n']} search formulas (one formula "
        f"is {1 / max(1, m['search_n']):.3f}); the paired standard error says how finely they resolve it: a loss "
        f"within about one SE of the budget could be on either side of it on other formulas.\n\n{trace}\n\n"
        + (f"## Check on {n_eval} eval formulas (and as many of each other split: the shift split holds formulas "
           f"from packages training never saw), beside the anchors (same formulas, same session options)\n\n"
           f"{anchors_t}\n\n![pareto](pareto.png)\n\nLatency: batch 1, 1 intra-op thread, ONNX Runtime CPU, "
           f"images interleaved across variants; compare ratios within this run. " if m["anchors"] else
           "## Check\n\nOff (`quantize.check=false`, as in `stage=all`): export's parity check and the benchmark "
           "read the packages built from these graphs. ")
        + f"Seconds: sensitivity "
        f"{m['seconds']['sensitivity']}, search {m['seconds']['search']}, whole stage {m['seconds']['total']}"
        + (" (" + ", ".join(f"{k} {v:.0f}" for k, v in m.get("phase_seconds", {}).items()) + ")"
           if m.get("phase_seconds") else "") + ".\n")


def _paired_cell(t: dict) -> str:
    return f"{t['gained']} / {t['lost']}" if "gained" in t else ""


def _smoothing_line(m: dict) -> str:
    if m.get("smoothquant") is None:
        return ("SmoothQuant: off (`quantize.smoothquant=ALPHA` folds it into the model before export, "
                "`pipeline/quantization/smooth.py`).")
    ranges = ", ".join(f"`{k}` {v['before']:.0f} → {v['after']:.0f}" for k, v in m["smoothing"].items())
    return (f"SmoothQuant: alpha {m['smoothquant']} folded into the model's LayerNorms and value projections before "
            f"export (the graphs above are of that model; the float function is the same). Largest over median "
            f"input-channel maximum of each smoothed projection, before → after: {ranges}.")


def _qat_line(m: dict) -> str:
    q = m.get("qat") or {}
    if not q:
        return ("Quantization-aware finetune: off (`quantize.qat_steps=N` trains the encoder with INT8 fake "
                "quantizers first, `pipeline/quantization/qat.py`).")
    return (f"Quantization-aware finetune: {q['steps']} of {q['planned_steps']} steps (lr {q['lr']}, batch "
            f"{q['batch_size']}, {q['images']} calibration images, {q['quantized_modules']} encoder projections with "
            f"ModelOpt INT8 fake quantizers, {q['seconds']:.0f} s; targets: the float model's greedy readings by its "
            f"{q.get('teacher_readings', 'torch model')}, {q.get('teacher_readings_seconds', 0):.0f} s); the graphs above are of the finetuned weights, "
            f"every loss is against the float model handed over.")


def _decoder_section(m: dict) -> str:
    s = m["search"]
    if s.get("ort_cpu_int8_decoder_exact_match") is None:
        return ""
    sens = markdown_table(["rank", "decoder_step node", "logit SNR dB alone in 8 bits"],
                          [[i + 1, f"`{r['node']}`", f"{r['logit_snr_db']:.1f}"]
                           for i, r in enumerate(m.get("decoder_sensitivity", []))])
    trace = markdown_table(["nodes kept float", "last kept", "exact match", "loss vs float decoder",
                            "gained / lost", "paired SE of the loss", "identical readings"],
                           [[t["float_nodes"], f"`{t['returned']}`" if t.get("returned") else "", f"{t['exact_match']:.3f}",
                             f"{t['loss']:+.3f}", _paired_cell(t), f"{t['loss_se']:.3f}" if "loss_se" in t else "",
                             f"{t['identical']:.3f}"] for t in m.get("decoder_search_trace", [])])
    return (f"## ort_cpu decoder\n\n{m['decoder']}. On the decoder search set ({s['decoder_search_set']}), with the "
            f"INT8 encoder: float decoder {s['decoder_float_exact_match']:.3f} / CER {s['decoder_float_cer']:.3f}, "
            f"the plan's decoder {s['ort_cpu_int8_decoder_exact_match']:.3f} / {s['ort_cpu_int8_decoder_cer']:.3f} "
            f"({s['ort_cpu_int8_decoder_identical']:.0%} of readings identical).\n\n"
            + (f"Sensitivity (logits of recorded greedy decoder steps, each node alone in 8 bits):\n\n{sens}\n\n"
               f"Search:\n\n{trace}\n\n" if m.get("decoder_sensitivity") else ""))


def _print_summary(m: dict) -> None:
    ours = next((r for r in m["anchors"] if r["variant"].startswith("ours (plan, ort_cpu")), None)
    base = next((r for r in m["anchors"] if r["variant"].startswith("float")), None)
    speed = ""
    if ours and base and "total_ms" in ours:
        speed = (f"; eval check n={ours['n']}: exact match {base['exact_match']:.3f} -> {ours['exact_match']:.3f}, "
                 f"encoder {base['encoder_ms'] / ours['encoder_ms']:.2f}x, end to end "
                 f"{base['total_ms'] / ours['total_ms']:.2f}x faster (ort_cpu, 1 thread)"
                 + "".join(f"; {sp} n={v['n']}: {base['splits'][sp]['exact_match']:.3f} -> {v['exact_match']:.3f}"
                           for sp, v in list(ours.get("splits", {}).items())[1:]))
    log.info(f"[quantize] {m['model']}: {m['method']} ranges, {m['int8_groups']}/{m['groups']} groups INT8 "
          f"({m['int8_mac_share']:.0%} of MatMul MACs; ort_cpu graph {m.get('ort_cpu_int8_groups', '?')}/"
          f"{m.get('ort_cpu_groups', '?')} projections), ort_cpu decoder {m.get('decoder_precision', 'float')}, "
          f"budget {'met' if m['met_budget'] else 'NOT met'}{speed}")
