"""The ONNX Runtime 1.12.1 venv that stands in for MacaRT (a fork of ORT 1.12) in the tests.
(No tests here: a helper test modules import.)

ORT 1.12.1 has wheels up to CPython 3.10 only, so the venv is made from a Python 3.10 interpreter
(``MACART_PYTHON``, else ``python3.10`` on PATH, else pyenv's ``~/.pyenv/versions/3.10*``), once,
into the git-ignored ``.venv-macart/`` at the repository root, and reused while its pins are unchanged.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv-macart"
STAMP = VENV / ".installed"
DECODER = Path(__file__).resolve().parent / "macart_decode.py"
# onnxruntime 1.12.1 is built against numpy 1.x; its dependencies pinned too (what resolves today)
PINS = ("onnxruntime==1.12.1", "numpy==1.26.4", "protobuf==7.36.2", "flatbuffers==25.12.19",
        "coloredlogs==15.0.1", "humanfriendly==10.0", "packaging==26.4", "sympy==1.14.0", "mpmath==1.3.0")
INSTALL_TIMEOUT_S = 900


class MacaRTEnvError(RuntimeError):
    """The ORT 1.12.1 venv cannot be made here; the message says what is missing."""


def _is_py310(exe: str) -> bool:
    try:
        out = subprocess.run([exe, "-c", "import sys, venv, ensurepip; print(sys.version_info[:2] == (3, 10))"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip() == "True"  # a pyenv shim without 3.10 exits 127


def find_python310() -> str:
    candidates = [os.environ.get("MACART_PYTHON"), shutil.which("python3.10"),
                  *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10*/bin/python3.10")), reverse=True),
                  *sorted(glob.glob("/root/.pyenv/versions/3.10*/bin/python3.10"), reverse=True)]
    tried = [c for c in dict.fromkeys(candidates) if c]
    for exe in tried:
        if _is_py310(exe):
            return exe
    raise MacaRTEnvError(
        "no Python 3.10 interpreter with venv found (onnxruntime==1.12.1, the MacaRT stand-in, has wheels only "
        f"up to CPython 3.10); looked at MACART_PYTHON, python3.10 on PATH, ~/.pyenv/versions/3.10*; "
        f"tried: {', '.join(tried) or 'none found'}. Install one (e.g. `pyenv install 3.10`) or set MACART_PYTHON.")


def macart_python() -> Path:
    """The venv's interpreter, making the venv first when it is missing or its pins changed."""
    python = VENV / "bin" / "python"
    wanted = "\n".join(PINS) + "\n"
    if STAMP.is_file() and STAMP.read_text() == wanted and python.is_file():
        return python
    base = find_python310()
    shutil.rmtree(VENV, ignore_errors=True)
    started = time.perf_counter()
    steps = [[base, "-m", "venv", str(VENV)],
             [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *PINS]]
    for cmd in steps:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise MacaRTEnvError(f"{' '.join(cmd[:4])} ... did not finish in {INSTALL_TIMEOUT_S} s") from None
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise MacaRTEnvError(f"{' '.join(cmd[:4])} ... failed (exit {done.returncode}): " + " | ".join(tail))
    STAMP.write_text(wanted)
    (VENV / ".build_seconds").write_text(f"{time.perf_counter() - started:.1f}\n")
    return python


def decode(package: Path, images: Path, out: Path, threads: int = 1, timeout: int = 900, speculative: bool = False
           ) -> dict:
    """Greedy token ids of ``images`` (an .npy of preprocessed images) read by ``package`` on ORT 1.12.1
    (``speculative``: batch 1 with the package's drafter and verify graph)."""
    import json

    done = subprocess.run([str(macart_python()), str(DECODER), str(package), str(images), str(out),
                           "--threads", str(threads), *(["--speculative"] if speculative else [])],
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise MacaRTEnvError(f"macart_decode.py failed on {package.name} (exit {done.returncode}): "
                             + done.stderr.strip()[-2000:])
    return json.loads(out.read_text())
