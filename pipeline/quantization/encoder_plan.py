"""The encoder's plan: calibration methods compared on the ort_cpu graph, a given plan's numbers, and
the plan search on the plain graph (TensorRT, Metax) and on the ort_cpu graph (attention fused and
float), both by :func:`~pipeline.quantization.search.search_plan` over the same sensitivity ranking."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from tqdm import tqdm

from calibration import sensitivity
from pipeline.errors import PipelineError
from pipeline.quantization import qdq
from pipeline.quantization.graphs import FloatGraphs
from pipeline.quantization.groups import Group
from pipeline.quantization.measure import Reading, encoder_outputs
from pipeline.quantization.plan import GroupPlan, Plan
from pipeline.quantization.report import carried_line
from pipeline.quantization.search import PlanSearch, SearchReads, json_number, mac_share, search_plan


@dataclass
class EncoderGraphs:
    """The float encoder graphs a plan is made on, their quantizable groups (the ort_cpu graph's: its
    projections, the attention fused), and where candidates and ranges are written."""

    graphs: FloatGraphs
    scratch: Path
    by_name: dict[str, Group]
    ort_groups: dict[str, Group]
    acts: str                                   # the ort_cpu graph's activations: uint8 | int8
    ort_caches: dict[str, Path] = field(default_factory=dict)  # method -> the ort_cpu graph's ranges

    def plain(self, cache: Path, method: str, names, out: Path) -> Path:
        """The plain graph with groups ``names`` INT8."""
        qdq.quantize(self.graphs.encoder_std, out, cache, method, [self.by_name[n].node for n in names])
        return out

    def ort(self, method: str, names, out: Path) -> Path:
        """The ort_cpu graph with projections ``names`` INT8."""
        qdq.quantize(self.graphs.encoder_ort, out, self.ort_caches[method], method,
                     [self.ort_groups[n].node for n in names], self.acts)
        return out

    def calibrate_ort(self, reader, method: str) -> float:
        self.ort_caches[method] = self.scratch / f"ranges.ort_cpu.{method}.json"
        return qdq.calibrate(self.graphs.encoder_ort, reader, method, self.ort_caches[method])


def compare_methods(enc: EncoderGraphs, methods, reader: Callable, reads: SearchReads, ref_memory: np.ndarray,
                    sens_images: np.ndarray, progress: bool) -> tuple[list[dict], dict[str, Reading]]:
    """Each calibration method's ranges on the ort_cpu graph with every projection INT8: its search-set
    reading, encoder SNR, readings identical to float and calibration time (rows), and the readings."""
    rows, readings = [], {}
    for method in tqdm(methods, desc="calibration methods", disable=not progress):
        seconds = enc.calibrate_ort(reader(), method)
        variant = enc.ort(method, [n for n, g in enc.ort_groups.items() if g.kind == "weights"],
                          enc.scratch / f"enc.{method}.onnx")
        r = readings[method] = reads.read(variant)
        rows.append({"method": method, "exact_match": r.exact_match, "cer": r.cer,
                     "snr_db": sensitivity.SNR().score(ref_memory, encoder_outputs(enc.graphs.package, variant,
                                                                                   sens_images)),
                     "identical": r.identical_to(reads.float_reading), "calibration_s": round(seconds, 1)})
    return rows, readings


def given_sensitivity(given: Plan, groups: list[Group], metric: str) -> tuple[float, list]:
    """The sensitivity numbers a plan file carries (measured on the model it was made for)."""
    sens = [sensitivity.GroupSensitivity(g.name, *[float(given.groups[g.name].sensitivity.get(k, float("nan")))
                                                    if g.name in given.groups else float("nan")
                                                    for k in ("only", "all_but", "gain")]) for g in groups]
    return float(given.measured.get("all_int8_" + metric, float("nan"))), sens


def apply_given(given: Plan, enc: EncoderGraphs, reads: SearchReads, cache: Path, plan_file: str) -> PlanSearch:
    """A plan file on this graph, no search: its plain graph read once; ``given`` takes this graph's
    nodes and MACs, the budget and whether it met it."""
    by_name = enc.by_name
    for name in by_name:  # groups the file leaves out stay float
        given.groups.setdefault(name, GroupPlan("float", by_name[name].node, by_name[name].kind, by_name[name].macs))
    for name, g in given.groups.items():  # the file's nodes and MACs are of the graph it was made on
        g.node, g.kind, g.macs = by_name[name].node, by_name[name].kind, by_name[name].macs
    int8 = given.int8_groups()
    r = reads.read(enc.plain(cache, given.method, int8, enc.scratch / "plan.onnx"))
    loss = reads.float_reading.exact_match - r.exact_match
    given.met_budget = loss <= reads.budget + 1e-9
    given.budget = reads.budget
    k = len(by_name) - len(int8)
    found = PlanSearch(k, [{"float_groups": k, "exact_match": r.exact_match, "loss": loss,
                            **r.paired(reads.float_reading)}], {k: r})
    given.note = f"applied from {plan_file}" + (f"; {carried_line(given.carried)}" if given.carried else "")
    return found


def search_plain(enc: EncoderGraphs, ranked, groups: list[Group], sens, reads: SearchReads, cache: Path,
                 method: str, progress: bool) -> tuple[Plan, PlanSearch]:
    """The plain graph's plan: the most sensitive groups back to float until the loss is within the budget."""
    order = [r.group for r in ranked]

    def int8_with_float(k: int) -> list[str]:
        return [g for g in enc.by_name if g not in set(order[:k])]

    found = search_plan(order, lambda k: reads.candidate(enc.plain(cache, method, int8_with_float(k),
                                                                   enc.scratch / "plan.onnx")),
                        reads.float_reading, reads.budget, progress,
                        mac_share_of=lambda k: mac_share(enc.by_name, int8_with_float(k)))
    float_set = set(order[:found.float_count])
    plan = Plan(method=method, budget=reads.budget, met_budget=True, groups={
        g.name: GroupPlan("float" if g.name in float_set else "int8", g.node, g.kind, g.macs,
                          {"only": json_number(x.only), "all_but": json_number(x.all_but), "gain": json_number(x.gain)})
        for g, x in zip(groups, sens)})
    if found.float_count == len(order):
        plan.note = "every group float: no INT8 group fits the budget on the search set"
    return plan, found


def search_ort(enc: EncoderGraphs, plan: Plan, ranked, method: str, method_readings: dict[str, Reading],
               reads: SearchReads, progress: bool) -> PlanSearch:
    """The ort_cpu graph's own plan (``plan.ort_cpu_groups``), searched on that graph over the same ranking."""
    order = [r.group for r in ranked if r.group in enc.ort_groups]
    weights = {n for n, g in enc.ort_groups.items() if g.kind == "weights"}

    def reading(k: int) -> Reading:
        if method in method_readings and set(order[k:]) == weights:
            return method_readings[method]  # the method comparison read this very graph (same ranges, same set)
        return reads.candidate(enc.ort(method, order[k:], enc.scratch / "plan.ort.onnx"))

    found = search_plan(order, reading, reads.float_reading, reads.budget, progress,
                        mac_share_of=lambda k: mac_share(enc.by_name, order[k:]))
    plan.ort_cpu_groups = {n: ("int8" if i >= found.float_count else "float") for i, n in enumerate(order)}
    return found


def check_given_ort(plan: Plan, enc: EncoderGraphs) -> None:
    """A plan file's ort_cpu groups are projections of this ort_cpu graph."""
    unknown = sorted(set(plan.ort_cpu_groups) - set(enc.ort_groups))
    if unknown:
        raise PipelineError(f"quantize.plan: ort_cpu_groups {', '.join(unknown[:5])} are not projections of the "
                            f"ort_cpu graph (its attention is fused): known {', '.join(enc.ort_groups)}")
