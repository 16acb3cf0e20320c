"""Shared fixtures. The real model and the real corpus are built once per test session."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("MPLBACKEND", "Agg")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


# fixtures that hold the real model or the real corpus (built once a machine: about a minute of two
# cores): a test that asks for one is `slow`, so `-m "not slow"` (make test-fast) runs no real-model
# inference and builds no corpus (modules that use them without a fixture mark themselves)
REAL_MODEL_FIXTURES = frozenset({"real_adapter", "corpus", "corpus_root"})


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def compose_cfg(overrides: list[str] | None = None):
    """The resolved root config, as ``python -m pipeline`` would build it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from pipeline.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides or []))
    GlobalHydra.instance().clear()
    return cfg


def make_ctx(artifacts_dir: Path, overrides: list[str] | None = None):
    from pipeline.context import StageContext

    return StageContext(compose_cfg([f"artifacts.dir={artifacts_dir}", "progress=false", *(overrides or [])]))


def run_cli(*args: str, cwd: Path = REPO, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``python -m pipeline ARGS`` the way a user does; returns the finished process."""
    env = {**os.environ, "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def real_adapter():
    """The shipped latex-ocr-junia model, loaded safely (weights_only) and rewritten to explicit q/k/v."""
    from pipeline.adapters import load_adapter

    return load_adapter("latex_ocr_junia", "package")


def _shared_corpus() -> Path:
    """An artifacts root holding the real corpus, built once for all the suite's workers (about a
    minute of two cores) in the temp folder, keyed by the code that builds it; a lock makes a worker
    that needs it while another builds it wait for that build."""
    import hashlib
    import tempfile

    from filelock import FileLock

    code = b"".join(p.read_bytes() for p in sorted((REPO / "pipeline" / "data").glob("*.py")))
    code += (REPO / "conf" / "data" / "corpus.yaml").read_bytes() if (REPO / "conf" / "data" / "corpus.yaml").is_file() else b""
    root = Path(tempfile.gettempdir()) / f"formula-compress-test-corpus-{hashlib.sha256(code).hexdigest()[:16]}"
    with FileLock(str(root) + ".lock"):
        make_ctx(root).corpus()  # reused when built (the stage's manifest holds its config and inputs)
    return root


def copy_corpus(root: Path) -> Path:
    """``root`` (an artifacts folder) with the suite's shared corpus in it; returns ``root``."""
    import shutil

    if not (root / "corpus").exists():
        shutil.copytree(_shared_corpus() / "corpus", root / "corpus")
    return root


@pytest.fixture(scope="session")
def corpus_root(tmp_path_factory) -> Path:
    """An artifacts root holding the real corpus (a copy of the suite's shared one)."""
    return copy_corpus(tmp_path_factory.mktemp("artifacts"))


@pytest.fixture(scope="session")
def corpus(corpus_root):
    return make_ctx(corpus_root).corpus()
