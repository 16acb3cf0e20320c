"""formula-compress: prune, re-tokenize, calibrate, quantize and export a formula recognizer."""

from pathlib import Path

__version__ = "0.1.0"


def _conf_dir() -> Path:
    """Hydra's ``conf/``: shipped inside the package by a non-editable install (``pipeline/conf``,
    pyproject's package-dir), the checkout's ``conf/`` otherwise."""
    here = Path(__file__).resolve().parent
    for cand in (here / "conf", here.parent / "conf"):
        if (cand / "config.yaml").is_file():
            return cand
    return here.parent / "conf"


CONF_DIR = _conf_dir()
