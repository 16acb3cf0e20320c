"""The real model exported once per test session (ORT CPU), shared by the export and infer tests.
(No tests here: helpers other test modules import.)"""
from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

from conftest import copy_corpus, make_ctx

# formulas the shipped model reads correctly at this cap (BOS included)
FORMULAS = [r"x_1 + x_2", r"e^{i\pi}+1=0"]
MAX_LENGTH = 64


@functools.lru_cache(maxsize=None)
def artifacts_root() -> Path:
    root = copy_corpus(Path(tempfile.mkdtemp(prefix="export-test-")))  # the drafter reads train formulas
    (root / "formulas.txt").write_text("\n".join(FORMULAS) + "\n")
    return root


def run_export(*overrides: str):
    """Run the export stage in-process with a small parity subset; returns its manifest."""
    from pipeline.stages import export

    root = artifacts_root()
    settings = {"export.formulas": str(root / "formulas.txt"), "model.max_length": str(MAX_LENGTH),
                "export.parity_images": "1", "export.parity_limit": "2",
                "export.drafter": "ngram",  # speculative decoding on (off by default)
                "export.draft_images": "8"}  # the ngram drafter from the package's readings of 8 train formulas
    settings.update(o.split("=", 1) for o in overrides)
    ctx = make_ctx(root, [f"{k}={v}" for k, v in settings.items()])
    return export.run(OmegaConf.to_object(ctx.cfg.export), ctx)


@functools.lru_cache(maxsize=None)
def ort_package() -> Path:
    """The real model exported once per session for ORT CPU (shared with test_infer.py)."""
    run_export("target=ort_cpu")
    return artifacts_root() / "export-ort_cpu"


def session_ops(graph) -> list[str]:
    """The op types ONNX Runtime's CPU session runs for ``graph`` (a ModelProto or a path), after its own
    fusions."""
    import onnx
    import onnxruntime as ort

    from pipeline.export.runtime import session_options

    source = str(graph) if isinstance(graph, (str, Path)) else graph.SerializeToString()
    with tempfile.TemporaryDirectory() as tmp:
        so = session_options(threads=1)
        so.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
        return [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node]
