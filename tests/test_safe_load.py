"""Checkpoints load as tensors only; pickled code is refused unless explicitly trusted."""
from __future__ import annotations

import os

import pytest
import torch

from pipeline.adapters.latex_ocr_junia import safe_load_checkpoint
from pipeline.errors import PipelineError

MARKER = "formula_compress_pwned"


class Exploit:
    """Unpickling this runs code (creates a marker file)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


class Harmless:
    def __init__(self):
        self.x = torch.ones(2)


def test_pickle_with_code_is_refused(tmp_path):
    marker = tmp_path / MARKER
    ckpt = tmp_path / "evil.pt"
    torch.save({"model_state_dict": {}, "payload": Exploit(str(marker))}, ckpt)
    with pytest.raises(PipelineError, match="needs more than tensors.*model.trust_checkpoint=true"):
        safe_load_checkpoint(ckpt)
    assert not marker.exists()


def test_trusted_checkpoint_with_objects_loads_only_when_asked(tmp_path):
    ckpt = tmp_path / "objects.pt"
    torch.save({"obj": Harmless()}, ckpt)
    with pytest.raises(PipelineError):
        safe_load_checkpoint(ckpt)
    assert torch.equal(safe_load_checkpoint(ckpt, trust=True)["obj"].x, torch.ones(2))


def test_corrupt_and_missing_checkpoints(tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(PipelineError, match="corrupt checkpoint"):
        safe_load_checkpoint(bad)
    with pytest.raises(PipelineError, match="checkpoint not found"):
        safe_load_checkpoint(tmp_path / "nope.pt")


def test_shipped_checkpoint_loads_with_weights_only():
    from pipeline.adapters.latex_ocr_junia import package_assets
    ckpt = safe_load_checkpoint(package_assets() / "best.pt")
    assert "model_state_dict" in ckpt


def test_saved_model_round_trip_is_identical(tmp_path, real_adapter):
    from pipeline.adapters import load_adapter
    from pipeline.data.render import render_formula

    real_adapter.save(tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").is_file()
    again = load_adapter("latex_ocr_junia", str(tmp_path / "m"))
    x = real_adapter.preprocess(render_formula(r"\frac{a}{b}"))[None]
    with torch.no_grad():
        assert torch.equal(real_adapter.encode(x), again.encode(x))


def test_corrupt_saved_model_is_one_error(tmp_path, real_adapter):
    from pipeline.adapters import load_adapter

    real_adapter.save(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(PipelineError, match="corrupt model weights"):
        load_adapter("latex_ocr_junia", str(tmp_path / "m"))
