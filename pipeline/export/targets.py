"""Deployment targets: what each runtime accepts and which graph transforms it gets."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from pipeline.choices import choices
from pipeline.errors import PipelineError
from pipeline.export.triton import INSTANCE_KINDS as TRITON_INSTANCE_KINDS, InstanceKind
from pipeline.export.validator import FLOAT_ONLY_OPS, MIN_OPSET, Rules

KNOWN = ("ort_cpu", "tensorrt", "metax")
TargetName = choices("TargetName", KNOWN, __name__)  # target.name, export.targets


@dataclass
class TargetConfig:
    """The ``target`` group (``conf/target/<name>.yaml``): a runtime's rules and defaults, as data."""
    name: TargetName = TargetName.ort_cpu  # ort_cpu | tensorrt | metax
    opset: int = 17
    max_opset: Optional[int] = None   # a runtime's ceiling (metax: 17)
    max_ir_version: Optional[int] = None
    allow_contrib_ops: bool = True    # com.microsoft ops (ORT fusions)
    fp16_weights: bool = False
    fuse: bool = True                 # ORT transformer optimizer fusions
    # residual Adds read by a LayerNorm written as Sum: ORT's session cannot fuse them into
    # SkipLayerNormalization, whose CPU kernel is slower than both ops (pipeline/export/transforms.py)
    residual_sum: bool = False
    # what the runtime's INT8 and FP16 kernels need, checked by the export validator (pipeline/export/validator.py)
    symmetric_int8: bool = False      # INT8 zero points 0 (TensorRT, Metax)
    per_channel_weights: bool = False   # weight scales per output channel (Metax)
    per_tensor_activations: bool = False  # one scale per activation tensor (Metax)
    float_only_ops: bool = False      # LayerNorm, Softmax, GELU stay float in the FP16 graph (Metax)
    provider: str = "CPUExecutionProvider"
    provider_options: Dict[str, Any] = field(default_factory=dict)
    required_provider_options: List[str] = field(default_factory=list)  # the package refuses to be written without them
    # the ngram drafter's defaults for this target's packages (export.ngram_min_confidence / ngram_tail
    # override them): what a verify call costs there decides how many drafts it should check. A CPU pays
    # for every token a call checks (~0.14 ms each on the deployable): only the drafts likely to pass,
    # and one guess after them (least decoder time on calib, docs/export.md). A GPU at batch 1 pays for
    # the call, about the same whatever its width: every draft the table has, up to export.draft_len.
    draft_min_confidence: float = 0.7
    draft_tail: int = 1
    # a batch of several images in a package with a drafter: true, each image decoded speculatively on its
    # own after the batch's encoder call; false, the batch in plain greedy steps. A CPU: true (a batched
    # step reads every row's cross-attention K/V from memory and gains nothing from the batch: 1 thread,
    # 64 calib formulas, batch 8 greedy 131 ms a formula, speculatively row by row 97; eval 140 / 100,
    # shift 146 / 102; docs/export.md).
    # A GPU: false (a batched step costs about what one row's does: the premise, untimed)
    speculative_batches: bool = True
    # the Triton model repository export writes into this target's packages (triton/, docs/triton.md):
    # its instance_group's kind, KIND_CPU or KIND_GPU; null: none (metax: Triton has no MACA backend)
    triton_instance_kind: Optional[InstanceKind] = None


@dataclass(frozen=True)
class Target:
    name: str
    opset: int
    fuse: bool              # ONNX Runtime transformer fusions (contrib ops)
    fp16_weights: bool
    provider: str
    provider_options: dict[str, Any]
    rules: Rules
    draft_min_confidence: float  # the ngram drafter's defaults for its packages (TargetConfig, conf/target/*.yaml)
    draft_tail: int
    speculative_batches: bool   # a batch's rows decoded speculatively one by one (true) or in greedy steps
    required_provider_options: tuple[str, ...] = ()
    triton_instance_kind: Optional[str] = None  # KIND_CPU | KIND_GPU: a Triton repository in the package
    residual_sum: bool = False  # residual Add + LayerNorm kept out of ORT's SkipLayerNormalization fusion


def resolve_target(tcfg: Any) -> Target:
    """The target config (``conf/target/<name>.yaml``) checked and turned into rules."""
    name = str(tcfg.name)
    if name not in KNOWN:
        raise PipelineError(f"unknown export target {name!r}; known: {', '.join(KNOWN)}")
    opset = int(tcfg.opset)
    if opset < MIN_OPSET:
        raise PipelineError(f"target.opset={opset}: need >= {MIN_OPSET} so LayerNorm stays one LayerNormalization op")
    if tcfg.max_opset is not None and opset > int(tcfg.max_opset):
        raise PipelineError(f"target.opset={opset} exceeds target.max_opset={tcfg.max_opset} of {name}")
    allow_contrib = bool(tcfg.allow_contrib_ops)
    if bool(tcfg.fuse) and not allow_contrib:
        raise PipelineError(f"target {name}: fuse=true needs contrib ops (allow_contrib_ops=false)")
    rules = Rules(  # the runtime's rules, as its conf/target/<name>.yaml declares them
        target=name,
        max_opset=None if tcfg.max_opset is None else int(tcfg.max_opset),
        max_ir_version=None if tcfg.max_ir_version is None else int(tcfg.max_ir_version),
        allow_contrib_ops=allow_contrib,
        symmetric_int8=bool(tcfg.symmetric_int8),
        per_channel_weights=bool(tcfg.per_channel_weights),
        per_tensor_activations=bool(tcfg.per_tensor_activations),
        float_only_ops=FLOAT_ONLY_OPS if tcfg.float_only_ops else (),
    )
    options = dict(tcfg.provider_options or {})
    if not 0.0 <= float(tcfg.draft_min_confidence) <= 1.0:
        raise PipelineError(f"target.draft_min_confidence must be in [0, 1], got {tcfg.draft_min_confidence}")
    if int(tcfg.draft_tail) < 0:
        raise PipelineError(f"target.draft_tail must be >= 0, got {tcfg.draft_tail}")
    kind = tcfg.triton_instance_kind
    if kind is not None and str(kind) not in TRITON_INSTANCE_KINDS:
        raise PipelineError(f"target.triton_instance_kind must be one of {', '.join(TRITON_INSTANCE_KINDS)} or "
                            f"null (no Triton repository), got {kind!r}")
    return Target(name, opset, bool(tcfg.fuse), bool(tcfg.fp16_weights), str(tcfg.provider), options, rules,
                  float(tcfg.draft_min_confidence), int(tcfg.draft_tail), bool(tcfg.speculative_batches),
                  tuple(str(k) for k in tcfg.required_provider_options or ()),
                  None if kind is None else str(kind), bool(tcfg.residual_sum))


def target_configs(names, chosen) -> dict[str, Any]:
    """Each of ``names``' target config (``export.targets``): the composed ``target`` group (``chosen``,
    with the command line's ``target.*`` overrides) for the target it names, every other one from its
    YAML. Overrides of a target the list leaves out would be dropped: one error line instead."""
    from omegaconf import OmegaConf

    yaml = OmegaConf.to_container(target_config(str(chosen.name)))
    changed = sorted(k for k, v in OmegaConf.to_container(chosen).items() if yaml.get(k) != v)
    if changed and str(chosen.name) not in names:
        raise PipelineError(f"target.{changed[0]} is set for target {chosen.name}, which export.targets="
                            f"[{','.join(names)}] does not export: add it, or choose the target the override is "
                            f"for with target=<name>")
    return {name: chosen if name == str(chosen.name) else target_config(name) for name in names}


def target_config(name: str):
    """The target group option ``conf/target/<name>.yaml`` on the typed schema, as Hydra composes it."""
    from omegaconf import OmegaConf

    if name not in KNOWN:
        raise PipelineError(f"unknown export target {name!r}; known: {', '.join(KNOWN)}")
    from pipeline import CONF_DIR

    path = CONF_DIR / "target" / f"{name}.yaml"
    return OmegaConf.merge(OmegaConf.structured(TargetConfig), OmegaConf.load(path))
