"""A real tritonserver for the tests, from the side venv ``make triton`` creates (``.venv-triton/``).
(No tests here: a helper test modules import.)

The nvidia-pytriton wheel bundles tritonserver 2.51 (``pytriton/tritonserver/bin``), its Python
backend and one backend stub per Python version, and the libraries they link (``nvidia_pytriton.libs``).
The server runs as PyTriton itself runs it, without PyTriton's API: the Python backend and the stub for
the venv's Python copied into a backend folder of their own, the wheel's libraries and the venv's
``libpython`` on ``LD_LIBRARY_PATH``, the venv's ``bin`` first on ``PATH`` (the stub's embedded Python
finds the venv, and so onnxruntime and numpy < 2, from it). HTTP and metrics on 127.0.0.1 only, gRPC off.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv-triton"
STAMP = VENV / ".installed"
CLIENT = Path(__file__).resolve().parent / "triton_client.py"
READY_TIMEOUT_S = 180   # a guard against a server that never comes up, not a measure (ready in ~2 s here)


def side_python() -> Path | None:
    """The side venv's interpreter, or None where ``make triton`` has not made it."""
    python = VENV / "bin" / "python"
    return python if STAMP.is_file() and python.is_file() else None


def _layout(python: Path) -> dict:
    """Where the wheel's server, backend, stub and libraries are, and the venv's libpython folder."""
    code = ("import json, sys, sysconfig, pathlib, pytriton; "
            "root = pathlib.Path(pytriton.__file__).parent; "
            "print(json.dumps({'server': str(root / 'tritonserver'), 'libs': str(root.parent / 'nvidia_pytriton.libs'), "
            "'version': f'{sys.version_info[0]}.{sys.version_info[1]}', 'libdir': sysconfig.get_config_var('LIBDIR')}))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TritonServer:
    """``tritonserver --model-repository=REPOSITORY`` on 127.0.0.1; :meth:`stop` ends it."""

    def __init__(self, python: Path, repository: Path, work: Path):
        layout = _layout(python)
        server = Path(layout["server"])
        stub = server / "python_backend_stubs" / layout["version"] / "triton_python_backend_stub"
        if not stub.is_file():
            raise RuntimeError(f"nvidia-pytriton has no Python backend stub for Python {layout['version']}")
        backends = work / "backends"  # the backend (its .so and triton_python_backend_utils.py) and its stub
        shutil.copytree(server / "backends", backends, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(stub, backends / "python" / "triton_python_backend_stub")
        self.http_port, self.metrics_port = _free_port(), _free_port()
        env = {**os.environ,
               "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}",
               "LD_LIBRARY_PATH": os.pathsep.join(p for p in (layout["libs"], layout["libdir"],
                                                              os.environ.get("LD_LIBRARY_PATH")) if p),
               "PYTHONDONTWRITEBYTECODE": "1"}
        self.log_path = work / "tritonserver.log"
        cmd = [str(server / "bin" / "tritonserver"), f"--model-repository={repository}",
               f"--backend-directory={backends}", f"--cache-directory={server / 'caches'}",
               "--http-address=127.0.0.1", f"--http-port={self.http_port}", "--allow-grpc=false",
               "--allow-metrics=true", "--allow-gpu-metrics=false", "--metrics-address=127.0.0.1",
               f"--metrics-port={self.metrics_port}", "--exit-timeout-secs=10"]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=work)
        self.url = f"127.0.0.1:{self.http_port}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.url}/v2/health/ready", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"tritonserver not ready after {READY_TIMEOUT_S} s: {self.log_tail()}")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30) as r:
            return r.read().decode("utf-8")

    def log_tail(self, chars: int = 3000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()


def query(python: Path, url: str, package: Path, images: list[Path], timeout: int = 600) -> dict:
    """Every image sent at once, one request each, by ``triton_client.py`` with tritonclient (HTTP) in
    the side venv; ``{file name: {"latex": ...} or {"error": ...}}``."""
    done = subprocess.run([str(python), str(CLIENT), url, str(package), *map(str, images)],
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"triton_client.py failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def metric(text: str, name: str, model: str) -> float:
    """One counter of the model from Prometheus text (``name{model="...",version="1"} N``)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name} for model {model} not in the metrics")
