"""A non-editable install ships every subpackage and every Hydra config file: pyproject's explicit
package list must name each source folder and each conf group (a missing one installs without error
and fails at import or at config time, on the user's machine only)."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_lists_every_source_package_and_conf_group():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    code = {".".join(p.parent.relative_to(ROOT).parts) for top in ("pipeline", "calibration")
            for p in (ROOT / top).rglob("__init__.py") if "__pycache__" not in p.parts}
    conf_root = ROOT / setup["package-dir"]["pipeline.conf"]
    groups = {".".join(("pipeline", "conf", *p.relative_to(conf_root).parts))
              for p in [conf_root, *conf_root.rglob("*")] if p.is_dir() and any(p.rglob("*.yaml"))}
    assert code <= listed, f"not in pyproject's packages: {sorted(code - listed)}"
    assert groups <= listed, f"conf groups not in pyproject's packages: {sorted(groups - listed)}"
    assert "*.yaml" in setup["package-data"]["*"]
