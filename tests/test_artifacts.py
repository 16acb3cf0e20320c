"""Atomic stage outputs with manifests; reuse when unchanged; a failure keeps the old folder."""
from __future__ import annotations

import json

import pytest

from pipeline.artifacts import sha256_file, stage_output


def _write(root, value, config=None, inputs=None, force=False, fail=False):
    with stage_output(root, "demo", config or {"a": 1}, inputs or {"x": "h1"}, force=force) as out:
        if out.reused:
            return out
        (out.path / "result.txt").write_text(value)
        out.metrics["value"] = value
        if fail:
            raise RuntimeError("boom mid-stage")
    return out


def test_manifest_records_config_inputs_outputs_versions(tmp_path):
    out = _write(tmp_path, "first")
    m = json.loads((tmp_path / "demo" / "manifest.json").read_text())
    assert m["config"] == {"a": 1} and m["inputs"] == {"x": "h1"}
    assert m["outputs"]["result.txt"] == sha256_file(tmp_path / "demo" / "result.txt")
    assert "torch" in m["libraries"] and m["metrics"] == {"value": "first"}
    assert out.path == tmp_path / "demo"


def test_failure_mid_stage_leaves_old_folder_untouched(tmp_path):
    _write(tmp_path, "first")
    before = (tmp_path / "demo" / "manifest.json").read_bytes()
    with pytest.raises(RuntimeError, match="boom"):
        _write(tmp_path, "second", config={"a": 2}, fail=True)
    assert (tmp_path / "demo" / "result.txt").read_text() == "first"
    assert (tmp_path / "demo" / "manifest.json").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]  # no temp folder left behind


def test_reuse_when_unchanged_rerun_when_changed_or_forced(tmp_path):
    _write(tmp_path, "first")
    assert _write(tmp_path, "ignored").reused
    assert (tmp_path / "demo" / "result.txt").read_text() == "first"
    assert not _write(tmp_path, "second", inputs={"x": "h2"}).reused
    assert (tmp_path / "demo" / "result.txt").read_text() == "second"
    assert not _write(tmp_path, "third", inputs={"x": "h2"}, force=True).reused
    assert (tmp_path / "demo" / "result.txt").read_text() == "third"


def test_missing_or_altered_output_file_is_not_reused(tmp_path):
    _write(tmp_path, "first")
    (tmp_path / "demo" / "result.txt").unlink()
    assert not _write(tmp_path, "again").reused
    (tmp_path / "demo" / "result.txt").write_text("truncat")
    assert not _write(tmp_path, "again").reused
    assert (tmp_path / "demo" / "result.txt").read_text() == "again"
    assert (tmp_path / "demo").stat().st_mode & 0o777 == 0o755
