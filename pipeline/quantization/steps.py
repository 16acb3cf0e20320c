"""The quantize stage's steps, in order: the float graphs (after SmoothQuant and QAT when asked), the
search set's float reading, the calibration methods side by side, each group's sensitivity, the plan
search (plain graph, then the ort_cpu graph), the final QDQ encoders, the ort_cpu decoder's plan, and
the stage's metrics and report. Each step reads and fills a :class:`QuantizeRun`, the state one run
of the stage carries from step to step."""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import onnx

from calibration import sensitivity
from calibration.calibrators import METHODS, CalibSetReader, calib_images, token_feeds
from pipeline.errors import optional_part
from pipeline.names import QDQ_ENCODER, QDQ_ENCODER_ORT
from pipeline.quantization import prepare, qdq, report
from pipeline.quantization.decoder_plan import decoder_plan
from pipeline.quantization.encoder_plan import EncoderGraphs, apply_given, check_given_ort, compare_methods, \
    given_sensitivity, search_ort, search_plain
from pipeline.quantization.groups import find_groups
from pipeline.quantization.measure import encoder_outputs
from pipeline.quantization.plan import load as load_plan, qat_of as plan_qat, smoothquant_of as plan_smoothquant
from pipeline.quantization.report import resolution_note
from pipeline.quantization.search import PlanSearch, SearchReads, json_number, mac_share, search_chunk
from pipeline.quantization.sets import decoder_search_set, search_set as search_rows

log = logging.getLogger(__name__)


@dataclass
class QuantizeRun:
    """What one run of the stage knows so far (each step below adds its part)."""
    cfg: Any                        # the stage's QuantizeConfig
    ctx: Any                        # its StageContext
    model_ref: str
    calib_set: Any
    folder: Path                    # the artifact being written
    scratch: Path                   # its .work folder (removed at the end)
    max_length: int
    batch: int
    threads: int
    started: float = 0.0           # set once the model is loaded (metrics' seconds.total)
    # the float graphs
    adapter: Any = None
    prepared: Any = None
    graphs: Any = None
    reference: Any = None
    groups: list = field(default_factory=list)
    by_name: dict = field(default_factory=dict)
    given: Any = None               # a plan file's plan (quantize.plan), else None
    alpha: Optional[float] = None   # SmoothQuant's
    qat_cfg: Optional[dict] = None
    acts: str = "uint8"             # the ort_cpu encoder's activations
    # the search set and its float reading
    search_images: Any = None
    search_truths: list = field(default_factory=list)
    search_set: Any = None
    sens_images: Any = None
    reads: Any = None
    float_reading: Any = None
    ref_memory: Any = None
    # calibration
    enc: Any = None
    method_rows: list = field(default_factory=list)
    method_readings: dict = field(default_factory=dict)
    chosen: str = ""
    cache: Optional[Path] = None
    # sensitivity and the plan
    all_int8_score: Any = None
    sens: Any = None
    ranked: list = field(default_factory=list)
    sens_seconds: float = 0.0
    plan: Any = None
    std: Any = None
    ort: Any = None
    search_seconds: float = 0.0
    int8: list = field(default_factory=list)
    ort_int8: list = field(default_factory=list)
    final_reading: Any = None
    ort_reading: Any = None
    decoder_reading: Optional[dict] = None
    decoder_trace: list = field(default_factory=list)
    decoder_sens: list = field(default_factory=list)

    def reader(self) -> CalibSetReader:
        """The calibration rows the ranges come from (with a token policy, each batch's kept indices too)."""
        return CalibSetReader(self.calib_set, "images", batch_size=8, limit=self.cfg.calib_images,
                              extra_feeds=token_feeds(self.graphs.package.token_policy))


def float_graphs(r: QuantizeRun) -> None:
    """The model handed over (SmoothQuant folded and QAT applied when asked), its float graphs, their
    matrix-multiply groups and a given plan's settings."""
    cfg, ctx = r.cfg, r.ctx
    r.adapter = ctx.load_model(r.model_ref)
    r.started = time.perf_counter()  # the stage's "total" seconds: from the model loaded
    r.alpha = plan_smoothquant(cfg.plan) if cfg.plan else cfg.smoothquant
    r.qat_cfg = plan_qat(cfg.plan) if cfg.plan else (
        {"steps": cfg.qat_steps, "lr": cfg.qat_lr, "images": cfg.qat_images,
         **({"precision": cfg.qat_precision} if cfg.qat_precision != "fp32" else {})} if cfg.qat_steps else None)
    r.prepared = prepare.prepared_graphs(r.adapter, ctx.model_hash(r.model_ref), r.calib_set, ctx, r.scratch,
                                         alpha=r.alpha, qat_cfg=r.qat_cfg, calib_rows=cfg.calib_images,
                                         workers=cfg.workers, qat_minutes=cfg.qat_minutes)
    r.adapter, r.graphs, r.reference = r.prepared.adapter, r.prepared.graphs, r.prepared.reference
    r.groups = find_groups(onnx.load(str(r.graphs.encoder_std)), r.graphs.memory_length, r.graphs.hidden_size)
    r.by_name = {g.name: g for g in r.groups}
    r.given = load_plan(cfg.plan, list(r.by_name), list(METHODS)) if cfg.plan else None
    r.acts = r.given.ort_cpu_activations if r.given else cfg.ort_cpu_activations


def float_reading(r: QuantizeRun) -> None:
    """The search set, its reading by the float model handed over (every loss is against it; with
    QAT on, not the finetuned one: same decoders) and the float encoder outputs the sensitivity
    compares against."""
    cfg = r.cfg
    r.search_images, r.search_truths, r.search_set = search_rows(r.ctx, r.adapter, r.calib_set, cfg.calib_images,
                                                                 cfg.search_images, cfg.search_split)
    r.sens_images = calib_images(r.calib_set, cfg.calib_images, cfg.calib_images + cfg.sensitivity_images)
    r.reads = SearchReads(r.graphs.open_readers(r.threads, cfg.workers), r.search_images, r.search_truths,
                          r.max_length, r.batch, cfg.budget, search_chunk(cfg.search_chunk, cfg.workers, r.batch))
    r.reads.float_reading = r.float_reading = r.reads.read(r.reference.encoder_std)
    r.ref_memory = encoder_outputs(r.graphs.package, r.graphs.encoder_std, r.sens_images)


def calibration_methods(r: QuantizeRun) -> None:
    """Calibration methods side by side, on the ort_cpu graph with every weight group INT8: the same
    groups as in the plain graph, but the fused attention leaves ORT's histogram calibrators 16
    tensors to watch instead of 32 (the 1024 x 1024 attention maps among them); then the chosen
    method's ranges for the plain graph, attention products included."""
    cfg, graphs = r.cfg, r.graphs
    r.enc = EncoderGraphs(graphs, r.scratch, r.by_name,
                          {g.name: g for g in find_groups(onnx.load(str(graphs.encoder_ort)))}, r.acts)
    r.method_rows, r.method_readings = compare_methods(r.enc, [] if r.given else cfg.methods, r.reader, r.reads,
                                                       r.ref_memory, r.sens_images, r.ctx.progress)
    r.chosen = r.given.method if r.given else cfg.method if cfg.method != "auto" else max(
        r.method_rows, key=lambda m: (round(m["exact_match"], 6), m["snr_db"]))["method"]
    if r.chosen not in r.enc.ort_caches:
        r.enc.calibrate_ort(r.reader(), r.chosen)
    r.cache = r.scratch / f"ranges.{r.chosen}.json"
    qdq.calibrate(graphs.encoder_std, r.reader(), r.chosen, r.cache)


def group_sensitivity(r: QuantizeRun) -> None:
    """Each group's sensitivity, both views (only it INT8; all but it INT8); a given plan carries the
    numbers it was made with."""
    started = time.perf_counter()
    if r.given:
        r.all_int8_score, r.sens = given_sensitivity(r.given, r.groups, r.cfg.metric)
    else:
        r.all_int8_score, r.sens = sensitivity.measure(
            [g.name for g in r.groups], lambda names: encoder_outputs(
                r.graphs.package, r.enc.plain(r.cache, r.chosen, names, r.scratch / "probe.onnx"), r.sens_images),
            r.ref_memory, sensitivity.metric(r.cfg.metric), r.ctx.progress)
    r.sens_seconds = time.perf_counter() - started
    r.ranked = sensitivity.ranking(r.sens)


def search_plan(r: QuantizeRun, lap) -> None:
    """The plan, given or searched: one search for the plain graph, then the ort_cpu encoder's own
    on that graph (its attention is fused and float, so only the projections are groups, and the
    attention products that cost the plain graph's plan most of its budget are not there to spend
    it: same ranking, same budget, same search set). ``lap(name)`` marks each search's end."""
    started = time.perf_counter()
    if r.given:
        r.plan, r.std = r.given, apply_given(r.given, r.enc, r.reads, r.cache, r.cfg.plan)
    else:
        r.plan, r.std = search_plain(r.enc, r.ranked, r.groups, r.sens, r.reads, r.cache, r.chosen, r.ctx.progress)
    lap('plan search (plain graph)')
    if r.given:
        check_given_ort(r.plan, r.enc)
        r.ort = PlanSearch(-1)
    else:
        r.ort = search_ort(r.enc, r.plan, r.ranked, r.chosen, r.method_readings, r.reads, r.ctx.progress)
    lap('plan search (ort_cpu graph)')
    r.search_seconds = time.perf_counter() - started


def final_encoders(r: QuantizeRun) -> None:
    """Both QDQ encoders from the plan, and their readings of the search set (the search read these
    very graphs already, same plan, same images: those readings are reused)."""
    r.int8 = r.plan.int8_groups()
    r.ort_int8 = [n for n in r.plan.ort_cpu_int8_groups() if n in r.enc.ort_groups]
    final_std = r.enc.plain(r.cache, r.chosen, r.int8, r.folder / QDQ_ENCODER)
    final_ort = r.enc.ort(r.chosen, r.ort_int8, r.folder / QDQ_ENCODER_ORT)
    r.final_reading = r.std.readings.get(r.std.float_count) or r.reads.read(final_std)
    r.ort_reading = r.ort.readings.get(r.ort.float_count) or r.reads.read(final_ort)


def decoder(r: QuantizeRun) -> None:
    """The ort_cpu decoder: 8-bit weights node by node, as many as the budget allows with the encoder
    plan in place (the loss is measured against the package with the float decoder)."""
    cfg, plan, given = r.cfg, r.plan, r.given
    if not ((given.decoder == "int8") if given else cfg.decoder):
        plan.decoder, plan.decoder_nodes, plan.decoder_cross_kv = "float", {}, "float"
        return
    n_dec, dec_images, dec_truths, dec_set = decoder_search_set(
        r.calib_set, cfg.calib_images, cfg.decoder_search_images, cfg.search_split, r.search_images, r.search_truths)
    with optional_part("quantize's ort_cpu decoder plan", "quantize.decoder=false"):
        r.decoder_reading, r.decoder_trace, r.decoder_sens = decoder_plan(
            r.graphs, r.folder, r.scratch, plan, given, dec_images, dec_truths, dec_set, r.sens_images, r.max_length,
            r.batch, r.threads, cfg.workers, cfg.budget, r.reads.chunk, r.ctx.progress,
            # the same rows as the search set: the ort_cpu encoder's reading with the float decoder is made
            r.ort_reading if n_dec == len(r.search_truths) else None, cfg.decoder_cross_kv)


def save_plan(r: QuantizeRun) -> None:
    """``plan.json`` with what it measured on the search set."""
    plan = r.plan
    plan.measured = {
        "search_set": r.search_set,
        "float_exact_match": r.float_reading.exact_match, "float_cer": r.float_reading.cer,
        "plan_exact_match": r.final_reading.exact_match, "plan_cer": r.final_reading.cer,
        "ort_cpu_exact_match": r.ort_reading.exact_match, "ort_cpu_cer": r.ort_reading.cer,
        "int8_mac_share": plan.int8_mac_share(), "all_int8_" + r.cfg.metric: json_number(r.all_int8_score),
        **(r.decoder_reading or {}),
    }
    plan.smoothquant, plan.ort_cpu_activations, plan.qat = r.alpha, r.acts, r.qat_cfg
    plan.save(r.folder / "plan.json")


def stage_metrics(r: QuantizeRun, table: list, phase_seconds: dict) -> dict:
    """The stage's metrics (``quantize.json`` and the manifest): the plan, both searches, the anchors'
    table, the sensitivity ranking and where the time went."""
    cfg, plan, by_name, fr, orr = r.cfg, r.plan, r.by_name, r.float_reading, r.ort_reading
    return {
        "model": r.model_ref, "method": r.chosen, "methods": r.method_rows, "groups": len(r.groups),
        "applied_plan": cfg.plan, "carried": plan.carried,
        "int8_groups": len(r.int8), "float_groups": sorted(set(by_name) - set(r.int8)),
        "int8_mac_share": plan.int8_mac_share(), "met_budget": plan.met_budget, "budget": cfg.budget,
        "search": plan.measured, "search_n": len(r.search_truths), "search_trace": r.std.trace,
        "ort_cpu_search_trace": r.ort.trace,
        # the deployable ort_cpu plan's reading of the search set against float: its loss and how finely
        # the search set resolves it
        "ort_cpu_search": {"loss": fr.exact_match - orr.exact_match, **orr.paired(fr)},
        "ort_cpu_int8_groups": len(r.ort_int8), "ort_cpu_groups": len(r.enc.ort_groups),
        "ort_cpu_int8_mac_share": mac_share(by_name, set(r.ort_int8)), "anchors": table,
        "decoder_search_trace": r.decoder_trace, "decoder_sensitivity": r.decoder_sens,
        "sensitivity": [{"group": s.group, "only": json_number(s.only), "all_but": json_number(s.all_but),
                         "gain": json_number(s.gain), "macs": by_name[s.group].macs, "kind": by_name[s.group].kind}
                        for s in r.ranked],
        "all_int8_score": json_number(r.all_int8_score), "metric": cfg.metric, "smoothquant": r.alpha,
        "ort_cpu_activations": r.acts,
        "smoothing": r.prepared.smoothing, "qat": r.prepared.qat,
        "seconds": {"sensitivity": round(r.sens_seconds, 1), "search": round(r.search_seconds, 1),
                    "total": round(time.perf_counter() - r.started, 1)},
        "phase_seconds": phase_seconds,
        "decoder": report.decoder_line(plan),
        "decoder_precision": plan.decoder,
    }


def write_outputs(r: QuantizeRun, metrics: dict, table: list) -> None:
    """``quantize.json``, the plots and ``report.md``; a warning when the plan is over the budget or
    the search set cannot resolve it."""
    folder, cfg = r.folder, r.cfg
    (folder / "quantize.json").write_text(json.dumps(metrics, indent=2) + "\n")
    report.plots(folder, r.ranked, r.by_name, cfg.metric, table)
    report.write_report(folder, metrics, r.plan)
    if not r.plan.met_budget and r.given:
        log.warning(f"[quantize] the plan from {cfg.plan} loses {r.std.trace[0]['loss']:.1%} exact match on the "
                    f"search set (TensorRT/Metax graph), over the budget of {cfg.budget:.1%}; written as given, "
                    f"marked as such")
    elif not r.plan.met_budget:
        log.warning(f"[quantize] no plan met the budget of {cfg.budget:.3f} exact-match loss; "
                    f"the best found is written to plan.json, marked as such")
    note = resolution_note(metrics)
    if note:
        log.warning(f"[quantize] {note}")
