"""Deployment targets: what each runtime accepts and which graph transforms it gets."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pipeline.errors import PipelineError
from pipeline.export.triton import INSTANCE_KINDS as TRITON_INSTANCE_KINDS
from pipeline.export.validator import FLOAT_ONLY_OPS, MIN_OPSET, Rules

KNOWN = ("ort_cpu", "tensorrt", "metax")


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
                  None if kind is None else str(kind))


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

    from pipeline.config import TargetConfig

    if name not in KNOWN:
        raise PipelineError(f"unknown export target {name!r}; known: {', '.join(KNOWN)}")
    from pipeline import CONF_DIR

    path = CONF_DIR / "target" / f"{name}.yaml"
    return OmegaConf.merge(OmegaConf.structured(TargetConfig), OmegaConf.load(path))
