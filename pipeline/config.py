"""Typed configuration: dataclasses held in Hydra's ConfigStore.

The root schema is :class:`RootConfig`; each stage contributes its own dataclass under its key
(``eval``, ``prune``, ``tokenizer`` ...), so a typo or a wrong type in an override fails at once
with the key's name. Defaults live in the dataclasses; ``conf/`` selects groups.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore

from calibration.sets import KINDS as DATA_KINDS
from pipeline.choices import choices
from pipeline.errors import ConfigError, check_range
from pipeline.export.targets import TargetConfig
from pipeline.stages import STAGES

DataKind = choices("DataKind", DATA_KINDS, __name__)  # data.kind: the data group's kinds (conf/data/*.yaml)


@dataclass
class ArtifactsConfig:
    dir: str = "artifacts"   # root of every stage's output folder
    force: bool = False      # rerun a stage even when its inputs and config are unchanged

    def __post_init__(self) -> None:
        if not self.dir:
            raise ConfigError("artifacts.dir is empty; give a folder")


@dataclass
class ModelConfig:
    adapter: str = "latex_ocr_junia"  # model family (pipeline/adapters/)
    # where the original model is: None = the adapter's own (latex_ocr_junia: the weights in its wheel);
    # a local folder otherwise (hf_vision_encoder_decoder: a save_pretrained folder, safetensors only)
    path: Optional[str] = None
    trust_checkpoint: bool = False    # allow a checkpoint that needs pickled code (never by default)
    max_length: int = 160             # decode cap, BOS included; the same for every variant compared
    # greedy decoding lets no reading end in more than this many layout-only atoms in a row (spacing,
    # &, \\, style switches: runaway loops; pipeline/decoding.py); 0 = no cap. Exported packages carry it
    layout_run_cap: int = 8
    batch_size: int = 16              # images per decode batch
    threads: int = 0                  # torch intra-op threads; 0 = torch's default
    # where torch computes (training, torch readings): auto = CUDA when torch sees it, else cpu | cpu |
    # cuda | cuda:N (pipeline/device.py); ONNX export and ONNX Runtime are not moved by it
    device: str = "auto"
    # denormal floats flushed to zero in torch and in every ONNX Runtime session (exported packages record
    # it): the same readings, and x86 no longer spends ~100x on the softmax tails (pipeline/denormals.py)
    flush_denormals: bool = True

    def __post_init__(self) -> None:
        # the model's own ceiling (its position table) is checked when the model is loaded
        check_range("model.max_length", self.max_length, 2, why="BOS plus at least one token")
        check_range("model.layout_run_cap", self.layout_run_cap, 0, why="0 = no cap")
        check_range("model.batch_size", self.batch_size, 1)
        check_range("model.threads", self.threads, 0, why="0 = torch's default")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"model.device={self.device!r}: must be auto, cpu, cuda or cuda:N")


@dataclass
class DataConfig:
    kind: DataKind = DataKind.corpus  # corpus | image_folder | hf_disk
    path: Optional[str] = None        # image folder or save_to_disk dataset (image_folder, hf_disk)
    labels: Optional[str] = None      # labels file for an image folder: "<file>\t<latex>" lines
    image_column: str = "image"       # hf_disk: column holding the images
    text_column: Optional[str] = "latex"  # hf_disk: column holding the LaTeX, if any
    # corpus: formulas from the docstrings of these pinned packages
    corpus_packages: List[str] = field(default_factory=lambda: ["numpy", "scipy", "sympy", "torch"])
    # shift split (eval.split=shift): formulas from these pinned packages, none of them in the corpus;
    # for measuring only, never for training, calibration or choosing defaults
    shift_packages: List[str] = field(default_factory=lambda: ["networkx", "matplotlib", "pandas", "mpmath"])
    seed: int = 0                     # the corpus split seed
    shares: Dict[str, float] = field(default_factory=lambda: {"train": 0.6, "calib": 0.2, "eval": 0.2})
    min_chars: int = 3                # normalized length bounds
    max_chars: int = 120
    max_width_px: int = 496           # rendered at 32 px/em it must fit the canvas without shrinking
    max_height_px: int = 112


def _root_fields() -> list[tuple[str, Any, Any]]:
    fields: list[tuple[str, Any, Any]] = [
        ("stage", str, field(default="evaluate")),
        ("seed", int, field(default=0)),
        # progress bars: null = only when stderr is a terminal (a log file of `make run` gets none)
        ("progress", Optional[bool], field(default=None)),
        ("artifacts", ArtifactsConfig, field(default_factory=ArtifactsConfig)),
        ("model", ModelConfig, field(default_factory=ModelConfig)),
        ("data", DataConfig, field(default_factory=DataConfig)),
        ("target", TargetConfig, field(default_factory=TargetConfig)),
    ]
    for spec in STAGES.values():
        if spec.config_cls is not None and spec.config_key not in {f[0] for f in fields}:
            fields.append((spec.config_key, spec.config_cls, field(default_factory=spec.config_cls)))
    return fields


RootConfig = make_dataclass("RootConfig", _root_fields())


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="root_schema", node=RootConfig)
