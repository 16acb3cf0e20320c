"""Stage outputs: atomic folders with a manifest, reused when inputs and config are unchanged.

A stage writes into ``<artifacts.dir>/.tmp-<name>-<random>/`` and the folder is renamed to
``<artifacts.dir>/<name>/`` only after the stage returned, so an interrupted or failed run leaves
the previous artifacts untouched. ``manifest.json`` records the resolved config, the input hashes,
the sha256 of every output file, library versions and metrics.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

from pipeline import interrupts
from pipeline.errors import InputError, OutputError, PipelineError
from pipeline.names import MANIFEST

TRACKED_LIBRARIES = (
    "torch", "onnx", "onnxruntime", "onnxsim", "nvidia-modelopt", "datasets", "hydra-core",
    "tokenizers", "transformers", "safetensors", "matplotlib", "numpy", "latex-ocr-junia",
)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_dir(path: Path) -> str:
    """Hash of a folder's files (names and contents), manifest excluded; stable across machines."""
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            h.update(str(p.relative_to(path)).encode())
            h.update(sha256_file(p).encode())
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in TRACKED_LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def read_manifest(folder: Path) -> dict[str, Any]:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise PipelineError(f"no artifact at {folder} (missing {MANIFEST}); run its stage first")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InputError(f"{path} is not a readable manifest; rerun its stage (artifacts.force=true)") from None


@dataclass
class StageOutput:
    """What a stage fills while it runs inside :func:`stage_output`."""

    path: Path
    manifest: dict[str, Any]
    reused: bool = False
    metrics: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def stage_output(root: Path, name: str, config: dict[str, Any], inputs: dict[str, str],
                 force: bool = False) -> Iterator[StageOutput]:
    """Open ``root/name`` for writing, atomically; yields a reused output when nothing changed.

    ``inputs`` maps an input's name to its hash; together with ``config`` it forms the key that
    decides reuse. The caller checks ``out.reused`` and returns early when it is set.
    """
    root = Path(root)
    final = root / name
    key = sha256_json({"config": config, "inputs": inputs})
    if not force and (final / MANIFEST).is_file():
        try:
            old = json.loads((final / MANIFEST).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            old = {}  # a damaged manifest: rebuild, never reuse
        if isinstance(old, dict) and old.get("key") == key and _outputs_intact(final, old):
            yield StageOutput(path=final, manifest=old, reused=True, metrics=old.get("metrics", {}))
            return
    _make_root(root)
    with interrupts.recorded():  # a signal right after the folder is made must not leave it behind
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    started = time.time()
    out = StageOutput(path=tmp, manifest={})
    try:
        interrupts.check(f"before {name}")
        yield out
        manifest = {
            "stage": name,
            "key": key,
            "config": config,
            "inputs": inputs,
            "outputs": {str(p.relative_to(tmp)): sha256_file(p)
                        for p in sorted(tmp.rglob("*")) if p.is_file()},
            "libraries": library_versions(),
            "metrics": out.metrics,
            "seconds": round(time.time() - started, 2),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; an artifact folder is meant to be shared
        _replace_dir(tmp, final)
        out.path = final
        out.manifest = manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _make_root(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise OutputError(f"artifacts folder {root}: a file is in the way; point artifacts.dir at a folder") from None
    except PermissionError:
        raise OutputError(f"artifacts folder {root}: not writable") from None


def _outputs_intact(folder: Path, manifest: dict[str, Any]) -> bool:
    """Every recorded output still there with its recorded sha256 (a truncated file is not reused)."""
    for rel, digest in manifest.get("outputs", {}).items():
        path = folder / rel
        if not path.is_file() or sha256_file(path) != digest:
            return False
    return True


@contextlib.contextmanager
def _swap_lock(root: Path) -> Iterator[None]:
    """One folder swap at a time under ``root``: two runs publishing together would otherwise rename
    onto each other's folder (ENOTEMPTY) and leave ``.old-*`` behind. flock on the directory itself,
    so no lock file is left in the artifacts root; the kernel drops it when a process dies."""
    fd = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _replace_dir(new: Path, final: Path) -> None:
    """Swap ``new`` into ``final``; the old folder is removed only once the new one is in place.

    Never after a signal: the swap is the commit point (:func:`pipeline.interrupts.publishing`)."""
    old = None
    with _swap_lock(final.parent):
        try:
            with interrupts.publishing(str(final)):
                if final.exists():
                    old = final.with_name(f".old-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
                    os.replace(final, old)
                try:
                    os.replace(new, final)
                except BaseException:
                    if old is not None:
                        os.replace(old, final)
                        old = None
                    raise
        finally:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)


def atomic_write_dir(final: Path) -> contextlib.AbstractContextManager[Path]:
    """A temporary sibling folder renamed to ``final`` on success (for files outside a stage)."""

    @contextlib.contextmanager
    def _ctx() -> Iterator[Path]:
        _make_root(final.parent)
        with interrupts.recorded():
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        try:
            interrupts.check(f"before {final.name}")
            yield tmp
            os.chmod(tmp, 0o755)
            _replace_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    return _ctx()
