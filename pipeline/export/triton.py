"""A Triton Inference Server model repository inside a package (``<package>/triton/``).

A recognizer is not one graph: greedy or speculative decoding is a loop, which Triton's ensembles
cannot express, and a BLS call per token costs a round trip per token. So the model Triton serves is
the whole reading, image in and LaTeX out, in a Python-backend model (``model.py``, this folder's
``triton_model.py``) that loads the package with the package's own runtime
(:class:`pipeline.export.runtime.OnnxPackage`) and reads each batch Triton's dynamic batcher hands it
with one encoder call and the package's decoding::

    triton/
      formula/                 # MODEL: the name clients address (/v2/models/formula/infer)
        config.pbtxt           # backend python, max_batch_size, dynamic_batching, instance_group,
                               # input IMAGE_INPUT (encoded bytes), output LATEX_OUTPUT (TYPE_STRING)
        1/model.py             # triton_model.py
        1/pipeline/...         # the runtime's torch-free modules (RUNTIME_ROOTS and what they import)

The graphs and the contract stay where they are: ``config.pbtxt``'s parameter ``package`` names the
package folder relative to the model's folder (``../..``), so the package folder is what a server
mounts. The names below are declared here once: ``config.pbtxt`` is written from them,
``package.json: triton`` records them, ``model.py`` reads them from the config Triton hands it, and
the export validator (:func:`pipeline.export.validator.check_triton_repository`) holds the three
together.
"""
from __future__ import annotations

import ast
import functools
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from pipeline.choices import choices
from pipeline.errors import PipelineError
from pipeline.export.runtime import PACKAGE_META

REPOSITORY = "triton"        # the repository's folder in the package
MODEL = "formula"            # the model's name in the repository
VERSION = "1"                # its one version
IMAGE_INPUT = "IMAGE"        # TYPE_STRING [1] a request row: the image file's bytes (PNG, JPEG ...)
LATEX_OUTPUT = "LATEX"       # TYPE_STRING [1] a request row: the LaTeX, UTF-8
PACKAGE_PARAMETER = "package"  # config.pbtxt parameter: the package folder, relative to the model's folder
PACKAGE_REF = "../.."        # <package>/triton/<model> -> <package>
MODEL_FILE = "model.py"
CONFIG_FILE = "config.pbtxt"
TEMPLATE = Path(__file__).resolve().parent / "triton_model.py"
# the modules model.py imports; they and the project modules they import are copied beside it
RUNTIME_ROOTS = ("pipeline.export.runtime", "pipeline.files")
INSTANCE_KINDS = ("KIND_CPU", "KIND_GPU")
InstanceKind = choices("InstanceKind", INSTANCE_KINDS, __name__)  # target.triton_instance_kind


@dataclass
class TritonConfig:
    """``export.triton``: the Triton repository written into packages whose target names an instance
    kind (``target.triton_instance_kind``: ort_cpu KIND_CPU, tensorrt KIND_GPU)."""

    enabled: bool = True                 # false: no triton/ folder
    max_batch_size: int = 8              # images a model execution reads at most (tensorrt: <= export.trt_max_batch)
    preferred_batch_sizes: list[int] = field(default_factory=lambda: [4, 8])  # the dynamic batcher forms these
    max_queue_delay_us: int = 5000       # a request waits this long at most for others to batch with
    instances: int = 1                   # model instances (per GPU for KIND_GPU); a CPU instance's ONNX
                                         # Runtime already uses every core
    threads: int = 0                     # ONNX Runtime intra-op threads per instance; 0 = its default

    def check(self, trt_max_batch: Optional[int] = None) -> None:
        if self.max_batch_size < 1:
            raise PipelineError(f"export.triton.max_batch_size must be >= 1, got {self.max_batch_size}")
        bad = [b for b in self.preferred_batch_sizes if not 1 <= int(b) <= self.max_batch_size]
        if bad:
            raise PipelineError(f"export.triton.preferred_batch_sizes must be in [1, max_batch_size="
                                f"{self.max_batch_size}], got {bad}")
        if self.max_queue_delay_us < 0:
            raise PipelineError(f"export.triton.max_queue_delay_us must be >= 0, got {self.max_queue_delay_us}")
        if self.instances < 1:
            raise PipelineError(f"export.triton.instances must be >= 1, got {self.instances}")
        if self.threads < 0:
            raise PipelineError(f"export.triton.threads must be >= 0 (0 = ONNX Runtime's default), got {self.threads}")
        if trt_max_batch is not None and self.max_batch_size > trt_max_batch:
            raise PipelineError(f"export.triton.max_batch_size={self.max_batch_size} exceeds export.trt_max_batch="
                                f"{trt_max_batch}, the TensorRT profiles' largest batch")


def model_config_pb2():
    """Triton's own ``ModelConfig`` schema: ``tritonclient``'s generated ``model_config_pb2``, loaded
    from its file (``tritonclient.grpc``'s ``__init__`` needs the grpc extra; the schema needs protobuf
    alone)."""
    return _model_config_pb2()


@functools.lru_cache(maxsize=1)
def _model_config_pb2():
    import importlib.util

    spec = importlib.util.find_spec("tritonclient")
    if spec is None or not spec.submodule_search_locations:
        raise PipelineError("tritonclient is not installed: it holds Triton's model config schema "
                            "(pip install tritonclient, a declared dependency)")
    path = Path(list(spec.submodule_search_locations)[0]) / "grpc" / "model_config_pb2.py"
    if not path.is_file():
        raise PipelineError(f"tritonclient has no model config schema at {path}")
    module_spec = importlib.util.spec_from_file_location("formula_compress_triton_model_config_pb2", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def parse_config(text: str, where: str):
    """``config.pbtxt`` text parsed with Triton's schema; a text it refuses is one error naming ``where``."""
    from google.protobuf import text_format

    try:
        return text_format.Parse(text, model_config_pb2().ModelConfig())
    except text_format.ParseError as exc:
        raise PipelineError(f"{where}: not a Triton model config: {exc}") from None


def config_text(settings: TritonConfig, kind: str, target: str) -> str:
    """``config.pbtxt``: written as text (its comments are for the reader), parsed back by the validator."""
    preferred = ", ".join(str(int(b)) for b in settings.preferred_batch_sizes)
    return f"""# formula-compress package ({target}): image bytes in, LaTeX out; the reading runs in model.py
# (Python backend) with the package's own runtime. Generated by stage export (export.triton.*).
name: "{MODEL}"
backend: "python"
max_batch_size: {int(settings.max_batch_size)}
input [
  {{
    name: "{IMAGE_INPUT}"
    data_type: TYPE_STRING  # the encoded image file (PNG, JPEG, ...), one per row
    dims: [ 1 ]
  }}
]
output [
  {{
    name: "{LATEX_OUTPUT}"
    data_type: TYPE_STRING  # UTF-8 LaTeX, one per row
    dims: [ 1 ]
  }}
]
dynamic_batching {{
  preferred_batch_size: [ {preferred} ]
  max_queue_delay_microseconds: {int(settings.max_queue_delay_us)}
}}
instance_group [
  {{
    count: {int(settings.instances)}
    kind: {kind}
  }}
]
parameters {{
  key: "{PACKAGE_PARAMETER}"  # the package folder, relative to this model's folder
  value: {{ string_value: "{PACKAGE_REF}" }}
}}
parameters {{
  key: "threads"  # ONNX Runtime intra-op threads per instance; 0 = its default
  value: {{ string_value: "{int(settings.threads)}" }}
}}
"""


def _module_file(root: Path, name: str) -> Optional[Path]:
    path = root.joinpath(*name.split("."))
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return None


def runtime_modules(root: Optional[Path] = None) -> dict[str, Path]:
    """The project's modules ``model.py`` needs: :data:`RUNTIME_ROOTS`, every project module they
    import (at module level or inside a function), and the packages above them; name -> file."""
    root = Path(__file__).resolve().parents[2] if root is None else root
    found: dict[str, Path] = {}
    todo = list(RUNTIME_ROOTS)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        path = _module_file(root, name)
        if path is None:
            raise PipelineError(f"the Triton model's runtime module {name} has no file under {root}")
        found[name] = path
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            todo += [n for n in names if n.split(".")[0] == "pipeline" and _module_file(root, n) is not None]
    return dict(sorted(found.items()))


def vendored_path(name: str, source: Path) -> str:
    """Where module ``name`` lies in the model's version folder (``pipeline/export/runtime.py`` ...)."""
    rel = Path(*name.split("."))
    return (rel / "__init__.py").as_posix() if source.name == "__init__.py" else rel.with_suffix(".py").as_posix()


def contract(settings: TritonConfig, kind: str) -> dict[str, Any]:
    """``package.json: triton``: what the repository declares, for the validator and the reader."""
    return {"repository": REPOSITORY, "model": MODEL, "version": VERSION, "input": IMAGE_INPUT,
            "output": LATEX_OUTPUT, "max_batch_size": int(settings.max_batch_size), "instance_kind": kind,
            "backend": "python", "runtime_modules": [vendored_path(n, p) for n, p in runtime_modules().items()]}


def write_repository(folder: Path, settings: TritonConfig, kind: str, target: str) -> dict[str, Any]:
    """``<folder>/triton/``: the model's ``config.pbtxt``, ``model.py`` and the runtime's modules,
    byte for byte the same for the same settings; ``package.json`` gets ``triton`` (returned)."""
    if kind not in INSTANCE_KINDS:
        raise PipelineError(f"target.triton_instance_kind must be one of {', '.join(INSTANCE_KINDS)} or null, "
                            f"got {kind!r}")
    repo = folder / REPOSITORY
    if repo.exists():
        shutil.rmtree(repo)
    version = repo / MODEL / VERSION
    version.mkdir(parents=True)
    (repo / MODEL / CONFIG_FILE).write_text(config_text(settings, kind, target), encoding="utf-8")
    shutil.copyfile(TEMPLATE, version / MODEL_FILE)
    for name, source in runtime_modules().items():
        dest = version / vendored_path(name, source)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest)
    entry = contract(settings, kind)
    meta_path = folder / PACKAGE_META
    meta = json.loads(meta_path.read_text())
    meta["triton"] = entry
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return entry
