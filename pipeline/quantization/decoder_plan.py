"""The ort_cpu decoder's plan: its decoder-step weight matrices ranked by the logit SNR each costs
alone in 8 bits, then as many of them in 8 bits (``MatMulNBits``) as the exact-match budget allows
with the encoder plan in place (:func:`~pipeline.quantization.search.search_plan`)."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import onnx
from tqdm import tqdm

from calibration import sensitivity
from pipeline.errors import PipelineError
from pipeline.export.runtime import session_options
from pipeline.names import DECODER_FIRST, DECODER_STEP, DECODER_VERIFY, INT8_DECODERS as DECODERS, QDQ_ENCODER_ORT
from pipeline.quantization import decoder as qdec
from pipeline.quantization.graphs import FloatGraphs
from pipeline.quantization.measure import Reading, loss_against, read, read_or_reject
from pipeline.quantization.plan import Plan
from pipeline.quantization.search import json_number, search_plan

log = logging.getLogger(__name__)


def decoder_plan(graphs: FloatGraphs, folder: Path, scratch: Path, plan: Plan, given: Optional[Plan],
                 images: np.ndarray, truths, rows: str, sens_images: np.ndarray, max_length: int, batch: int,
                 threads: int, workers: int, budget: float, chunk: int,
                 progress: bool, base: Optional[Reading] = None, cross_kv: bool = True
                 ) -> tuple[dict, list[dict], list[dict]]:
    """Rank the decoder-step weight matrices by the logit SNR each costs alone in 8 bits (recorded
    greedy step inputs), then return the most sensitive to float until the exact-match loss on the
    decoder search set, against the same package with the float decoder, is within the budget.
    ``cross_kv``: then also ``decoder_first``'s cross-attention K/V projections in dynamic INT8
    (:func:`~pipeline.quantization.decoder.quantize_cross_kv`), kept where the budget still holds
    (``given``: its ``decoder_cross_kv`` instead). Writes the INT8 decoder graphs when any node is
    INT8; sets ``plan.decoder*``."""
    import onnxruntime as ort

    mm = {}
    for g in DECODERS:
        if (graphs.package_dir / f"{g}.onnx").is_file():
            mm[g] = scratch / f"{g}.matmul.onnx"
            onnx.save(qdec.to_matmul(onnx.load(str(graphs.package_dir / f"{g}.onnx"))), str(mm[g]))
    step_model = onnx.load(str(mm[DECODER_STEP]))
    step_nodes = qdec.weight_nodes(step_model)
    # the other decoder graphs' nodes -> the step's weights they hold (followed by every candidate plan)
    parts = {g: qdec.weight_parts(step_model, onnx.load(str(mm[g]))) for g in mm if g != DECODER_STEP}

    cross_nodes = qdec.cross_kv_nodes(onnx.load(str(mm[DECODER_FIRST])), parts[DECODER_FIRST])

    def made(int8_step: list[str], tag: str, cross: bool = False) -> dict[str, Path]:
        out = {g: scratch / f"{g}.{tag}.onnx" for g in (DECODER_STEP, DECODER_FIRST)}
        qdec.quantize(mm[DECODER_STEP], out[DECODER_STEP], int8_step)
        first = scratch / f"{DECODER_FIRST}.{tag}.nbits.onnx" if cross else out[DECODER_FIRST]
        qdec.quantize(mm[DECODER_FIRST], first, qdec.follow_plan(parts[DECODER_FIRST], int8_step))
        if cross:
            qdec.quantize_cross_kv(first, out[DECODER_FIRST], cross_nodes)
        return out

    def reading(decoders: dict[str, Path], against: Optional[Reading] = None) -> Reading:
        readers = graphs.open_readers(threads, workers, decoders)
        if against is None:
            return read(readers, folder / QDQ_ENCODER_ORT, images, truths, max_length, batch)
        return read_or_reject(readers, folder / QDQ_ENCODER_ORT, images, truths, max_length, batch, against,
                              budget, chunk)

    if base is None:
        base = read(graphs.open_readers(threads, workers), folder / QDQ_ENCODER_ORT, images, truths, max_length,
                    batch)
    searched = None
    sens: list[dict] = []
    if given is not None:
        int8 = [n for n, p in given.decoder_nodes.items() if p == "int8"] if given.decoder_nodes else list(step_nodes)
        if given.decoder_cross_kv == "int8" and not cross_nodes:
            raise PipelineError("quantize.plan: decoder_cross_kv is int8 but this model's decoder_first has no "
                                "cross-attention K/V projection of its own to quantize")
        unknown = sorted(set(given.decoder_nodes) - set(step_nodes))
        if unknown:
            raise PipelineError(f"quantize.plan: {len(unknown)} decoder node(s) not in this model's decoder_step "
                                f"graph: {', '.join(unknown[:5])}")
    else:
        so = session_options(threads or 0)
        feeds = qdec.StepFeeds(graphs.open_package(threads), sens_images, max_length)
        ref = feeds.logits(ort.InferenceSession(str(mm[DECODER_STEP]), so, providers=["CPUExecutionProvider"]))
        snr = sensitivity.SNR()
        for node in tqdm(step_nodes, desc="decoder sensitivity", disable=not progress):
            probe = scratch / f"{DECODER_STEP}.probe.onnx"
            qdec.quantize(mm[DECODER_STEP], probe, [node])
            out = feeds.logits(ort.InferenceSession(str(probe), so, providers=["CPUExecutionProvider"]))
            sens.append({"node": node, "logit_snr_db": json_number(snr.score(ref, out))})
        sens.sort(key=lambda r: r["logit_snr_db"])  # most sensitive first
        order = [r["node"] for r in sens]
        searched = search_plan(order, lambda k: reading(made(order[k:], "search"), base), base, budget, progress,
                               counted="float_nodes", identical=True)
        int8 = order[searched.float_count:]
    cross = given.decoder_cross_kv if given is not None else "float"
    final = made(int8, "final", cross == "int8")
    if DECODER_VERIFY in mm:  # not read by the search: a package's speculative readings are its greedy ones
        try:
            nodes = qdec.follow_plan(parts[DECODER_VERIFY], int8)
        except ValueError as exc:
            log.warning(f"[quantize] no INT8 verify graph (the packages decode plain greedy): {exc}")
        else:
            final[DECODER_VERIFY] = scratch / f"{DECODER_VERIFY}.final.onnx"
            qdec.quantize(mm[DECODER_VERIFY], final[DECODER_VERIFY], nodes)
    # the search read this very plan already
    r = (searched.readings.get(searched.float_count) if searched else None) or reading(final)
    cross_check = None
    if given is None and cross_kv and cross_nodes:
        candidate = made(int8, "cross", True)
        rc = reading(candidate, base)
        loss = loss_against(rc, base)
        cross_check = {"exact_match": rc.exact_match, "cer": rc.cer, "loss": loss, "n": len(rc.exact),
                       "identical": rc.identical_to(base), **rc.paired(base)}
        if len(rc.exact) == len(base.exact) and loss <= budget + 1e-9:
            cross, r = "int8", rc
            final.update(candidate)
    plan.decoder = "int8" if int8 or cross == "int8" else "float"
    plan.decoder_nodes = {n: ("int8" if n in set(int8) else "float") for n in step_nodes}
    plan.decoder_cross_kv = cross
    if plan.decoder == "int8":
        for g, path in final.items():
            shutil.copyfile(path, folder / DECODERS[g])
    return ({"decoder_search_set": rows, "decoder_float_exact_match": base.exact_match, "decoder_float_cer": base.cer,
             "ort_cpu_int8_decoder_exact_match": r.exact_match, "ort_cpu_int8_decoder_cer": r.cer,
             "ort_cpu_int8_decoder_identical": r.identical_to(base), "decoder_int8_nodes": len(int8),
             "decoder_nodes": len(step_nodes), "decoder_cross_kv": cross, "decoder_cross_kv_nodes": len(cross_nodes),
             "decoder_cross_kv_check": cross_check}, searched.trace if searched else [], sens)
