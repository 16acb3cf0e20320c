"""The mixed-precision plan: which group runs INT8 and which stays float, as a JSON file a person
can read, edit and feed back (``quantize.plan=FILE``)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from pipeline.errors import PipelineError

FORMAT = "formula-compress quantize plan v1"
PRECISIONS = ("int8", "float")
ACTIVATIONS = ("int8", "uint8")  # pipeline.quantization.qdq.ACTIVATIONS
# one layer's query/key/value projections are separate groups where its keys are pooled (prune's
# key_pool_layers) and one merged group where they are not: the same weights in another graph
SPLIT_QKV = ("q_proj", "k_proj", "v_proj")
FUSED_QKV = "qkv_proj"


@dataclass
class GroupPlan:
    precision: str             # int8 | float
    node: str                  # ONNX node name in the plain (TensorRT / Metax) encoder graph
    kind: str                  # weights | activations
    macs: int = 0
    sensitivity: dict[str, float] = field(default_factory=dict)  # only / all_but / gain (metric units)


@dataclass
class Plan:
    method: str                # calibration method the ranges come from
    groups: dict[str, GroupPlan]
    budget: float              # allowed exact-match loss vs float (share, 0.005 = 0.5 point)
    met_budget: bool = True
    measured: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    decoder: str = "float"     # ort_cpu decoder graphs: int8 (some weights in 8 bits) | float
    # decoder_step weight nodes -> int8 | float (decoder_first follows: same weights); empty with
    # decoder "int8" = every weight node in 8 bits
    decoder_nodes: dict[str, str] = field(default_factory=dict)
    # decoder_first's cross-attention K/V projections of the encoder output (not in decoder_step):
    # int8 = dynamic INT8 (per-channel weights, per-tensor activations at run time) | float
    decoder_cross_kv: str = "float"
    # the ort_cpu encoder (attention fused and float: only the projections are groups there) ->
    # int8 | float, searched on that graph; empty = the projections' precision in `groups`
    ort_cpu_groups: dict[str, str] = field(default_factory=dict)
    smoothquant: float | None = None  # SmoothQuant alpha folded into the model before its graphs (None: off)
    # the ort_cpu encoder's activations: uint8 (asymmetric) | int8 (symmetric; what a plan file without
    # the key was made with). The plain graph's are symmetric int8 always (TensorRT, MacaRT)
    ort_cpu_activations: str = "int8"
    # the quantization-aware finetune the graphs were made after ({steps, lr, images}; None: none)
    qat: dict[str, Any] | None = None
    # groups of this graph that stand for groups of another named otherwise in the plan file (a
    # merged qkv_proj for a pooled layer's q/k/v): {group here: [the file's groups]}
    carried: dict[str, list[str]] = field(default_factory=dict)

    def int8_groups(self) -> list[str]:
        return [g for g, p in self.groups.items() if p.precision == "int8"]

    def ort_cpu_int8_groups(self) -> list[str]:
        if self.ort_cpu_groups:
            return [g for g, p in self.ort_cpu_groups.items() if p == "int8"]
        return [g for g in self.int8_groups() if self.groups[g].kind == "weights"]

    def int8_mac_share(self) -> float:
        total = sum(p.macs for p in self.groups.values())
        return sum(p.macs for p in self.groups.values() if p.precision == "int8") / total if total else 0.0

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=2, sort_keys=False) + "\n"

    def save(self, path: Path) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")


def load(path: str | Path, known_groups: Sequence[str], known_methods: Sequence[str]) -> Plan:
    """Read a plan file and check it against the groups of the graph it will be applied to."""
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"quantize.plan: no such file {path}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PipelineError(f"quantize.plan: {path} is not a JSON plan ({exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise PipelineError(f"quantize.plan: {path} is not a plan (format must be {FORMAT!r})")
    if raw.get("method") not in known_methods:
        raise PipelineError(f"quantize.plan: method {raw.get('method')!r} unknown; known: {', '.join(known_methods)}")
    groups = raw.get("groups")
    if not isinstance(groups, dict) or not groups:
        raise PipelineError(f"quantize.plan: {path} has no 'groups' object")
    parsed = {}
    for name, g in groups.items():
        if not isinstance(g, dict) or g.get("precision") not in PRECISIONS:
            raise PipelineError(f"quantize.plan: group {name!r}: precision must be one of {PRECISIONS}")
        try:
            parsed[name] = GroupPlan(precision=g["precision"], node=str(g["node"]), kind=str(g.get("kind", "")),
                                     macs=int(g.get("macs", 0)), sensitivity=dict(g.get("sensitivity", {})))
        except (KeyError, TypeError, ValueError) as exc:
            raise PipelineError(f"quantize.plan: group {name!r}: bad field ({exc})") from None
    precisions, carried, unknown = carry({n: g.precision for n, g in parsed.items()}, known_groups)
    if unknown:
        raise PipelineError(f"quantize.plan: {len(unknown)} group(s) not in this model's graph: "
                            f"{', '.join(unknown[:5])}; known groups are listed in the generated plan.json")
    parsed = {n: parsed[n] if n in parsed else GroupPlan(p, "", parsed[carried[n][0]].kind) for n, p in precisions.items()}
    try:
        budget = float(raw.get("budget", 0.005))
    except (TypeError, ValueError):
        raise PipelineError("quantize.plan: 'budget' must be a number") from None
    decoder = raw.get("decoder", "float")
    if decoder not in PRECISIONS:
        raise PipelineError(f"quantize.plan: 'decoder' must be one of {PRECISIONS}, got {decoder!r}")
    nodes = raw.get("decoder_nodes") or {}
    if not isinstance(nodes, dict) or any(v not in PRECISIONS for v in nodes.values()):
        raise PipelineError(f"quantize.plan: 'decoder_nodes' must map node names to one of {PRECISIONS}")
    cross_kv = raw.get("decoder_cross_kv", "float")
    if cross_kv not in PRECISIONS:
        raise PipelineError(f"quantize.plan: 'decoder_cross_kv' must be one of {PRECISIONS}, got {cross_kv!r}")
    ort = raw.get("ort_cpu_groups") or {}
    if not isinstance(ort, dict) or any(v not in PRECISIONS for v in ort.values()):
        raise PipelineError(f"quantize.plan: 'ort_cpu_groups' must map group names to one of {PRECISIONS}")
    ort, _, unknown = carry(ort, known_groups)
    if unknown:
        raise PipelineError(f"quantize.plan: {len(unknown)} ort_cpu group(s) not in this model's graph: "
                            f"{', '.join(unknown[:5])}")
    acts = raw.get("ort_cpu_activations", "int8")
    if acts not in ACTIVATIONS:
        raise PipelineError(f"quantize.plan: 'ort_cpu_activations' must be one of {ACTIVATIONS}, got {acts!r}")
    return Plan(method=raw["method"], groups=parsed, budget=budget, met_budget=bool(raw.get("met_budget", True)),
                smoothquant=_alpha(raw.get("smoothquant"), path), ort_cpu_activations=acts,
                qat=_qat(raw.get("qat"), path),
                measured=dict(raw.get("measured") or {}), note=str(raw.get("note", "")), decoder=decoder,
                decoder_nodes={str(k): str(v) for k, v in nodes.items()}, decoder_cross_kv=cross_kv,
                ort_cpu_groups={str(k): str(v) for k, v in ort.items()}, carried=carried)


def carry(precisions: dict[str, str], known: Iterable[str]) -> tuple[dict[str, str], dict[str, list[str]], list[str]]:
    """A plan's group precisions carried to a graph whose groups are ``known``, each group mapped by
    what it is: a name the graph has is kept; a layer's separate q/k/v projections become its merged
    ``qkv_proj`` (INT8 only when every one of them is INT8), a merged ``qkv_proj`` becomes separate
    q/k/v projections of its precision. Returns the precisions by this graph's names, which of them
    were carried ({name here: [the plan's names]}) and the plan's names with no counterpart."""
    known = set(known)
    out: dict[str, str] = {}
    carried: dict[str, list[str]] = {}
    unknown: list[str] = []
    for name, precision in precisions.items():
        prefix, _, role = name.rpartition(".")
        if name in known:
            out[name] = precision
        elif role in SPLIT_QKV and f"{prefix}.{FUSED_QKV}" in known:
            fused = f"{prefix}.{FUSED_QKV}"
            carried.setdefault(fused, []).append(name)
            out[fused] = "float" if "float" in (precision, out.get(fused)) else "int8"
        elif role == FUSED_QKV and all(f"{prefix}.{r}" in known for r in SPLIT_QKV):
            for r in SPLIT_QKV:
                out[f"{prefix}.{r}"] = precision
                carried[f"{prefix}.{r}"] = [name]
        else:
            unknown.append(name)
    return out, {k: sorted(v) for k, v in carried.items()}, sorted(unknown)


def _alpha(value: Any, path: Path) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) <= 1.0:
        raise PipelineError(f"quantize.plan: {path}: 'smoothquant' must be null or a number in (0, 1], got {value!r}")
    return float(value)


def _qat(value: Any, path: Path) -> dict[str, Any] | None:
    if value is None:
        return None
    try:
        steps, lr, images = int(value["steps"]), float(value["lr"]), int(value["images"])
    except (TypeError, KeyError, ValueError):
        raise PipelineError(f"quantize.plan: {path}: 'qat' must be null or {{steps, lr, images}}, got {value!r}") from None
    if steps < 1 or not lr > 0 or images < 1:
        raise PipelineError(f"quantize.plan: {path}: 'qat' needs steps >= 1, lr > 0, images >= 1, got {value!r}")
    precision = value.get("precision", "fp32")  # plans from before the option trained in fp32
    if precision not in ("fp32", "bf16"):
        raise PipelineError(f"quantize.plan: {path}: 'qat.precision' must be fp32 or bf16, got {precision!r}")
    return {"steps": steps, "lr": lr, "images": images, **({"precision": precision} if precision != "fp32" else {})}


def qat_of(path: str | Path) -> dict[str, Any] | None:
    """The quantization-aware finetune a plan file was made after (read before its groups can be
    checked, like :func:`smoothquant_of`)."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # load() names what is wrong with the file
    return _qat(raw.get("qat"), Path(path)) if isinstance(raw, dict) else None


def smoothquant_of(path: str | Path) -> float | None:
    """The SmoothQuant alpha a plan file was made with (read before its groups can be checked: the
    groups belong to the graphs made with it)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # load() names what is wrong with the file
    return _alpha(raw.get("smoothquant"), path) if isinstance(raw, dict) else None
