"""One helper per job for what users hand the pipeline: formulas files, labels files, images, image
folders, exported packages, output names and paths. Every stage calls these, so a fix (a new image
suffix, the UTF-8 policy, the decompression-bomb guard) lands once.

Each helper takes ``key``, the config key the value came from, and raises a
:class:`pipeline.errors.PipelineError` subclass whose message names the key, the file and what to do.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import BinaryIO, Optional

from PIL import Image, UnidentifiedImageError

from pipeline.errors import ConfigError, ImageError, InputError, OutputError
from pipeline.names import PACKAGE_META

# what PIL reads and the model was tried on; one list for evaluate, infer and calibrate
IMAGE_SUFFIXES = (".bmp", ".gif", ".jpeg", ".jpg", ".png", ".tif", ".tiff", ".webp")
# a formula image is at most a few thousand pixels a side; above this a file is refused before it is
# decoded (a 20000 x 20000 PNG of a few kB would need 400 MB once decoded)
MAX_IMAGE_PIXELS = 50_000_000
# what PIL raises for files it cannot decode (truncated, corrupt, not an image, a bomb)
DECODE_ERRORS = (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError, IndexError,
                 Image.DecompressionBombError)


def _utf8_error(key: str, path: Path, exc: UnicodeDecodeError, data: bytes) -> InputError:
    line = data.count(b"\n", 0, exc.start) + 1
    return InputError(f"{key}: {path} is not UTF-8 text ({exc.reason} at line {line}, byte {exc.start}); "
                      f"save it as UTF-8")


def read_text(path: str | Path, key: str) -> str:
    """A whole UTF-8 text file (a BOM is dropped); a missing or non-UTF-8 file is one :class:`InputError`."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{key}: {path} is a folder; give a file")
    if not path.is_file():
        raise InputError(f"{key}: no such file {path}")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{key}: cannot read {path} ({exc.strerror or type(exc).__name__})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise _utf8_error(key, path, exc, data) from None


def read_formulas(path: str | Path, key: str) -> list[tuple[int, str]]:
    """(line number, formula) for each non-blank line of a one-formula-per-line UTF-8 file."""
    lines = [(i, ln.strip()) for i, ln in enumerate(read_text(path, key).splitlines(), 1)]
    formulas = [(i, ln) for i, ln in lines if ln]
    if not formulas:
        raise InputError(f"{key}: {path} holds no formula (one LaTeX formula per line)")
    return formulas


def read_labels(path: str | Path, key: str) -> list[tuple[str, str]]:
    """(file name, latex) pairs of a ``<file>\\t<latex>`` labels file, in file order."""
    labels = []
    for i, line in enumerate(read_text(path, key).splitlines(), 1):
        if not line.strip():
            continue
        if "\t" not in line:
            raise InputError(f"{key}: {path}:{i}: expected '<file>\\t<latex>', got {line[:40]!r}")
        name, latex = line.split("\t", 1)
        labels.append((name.strip(), latex.strip()))
    return labels


LABELS_NAME = "labels.tsv"  # an image folder's own labels file, used when no labels file is given


def labels_file(folder: str | Path, labels: Optional[str | Path], key: str, required: bool = False) -> Optional[Path]:
    """The labels file of an image folder: ``labels`` when given (it must exist), else
    ``folder/labels.tsv`` when there is one, else None (``required``: one error naming ``key``)."""
    path = Path(labels) if labels else Path(folder) / LABELS_NAME
    if path.is_file():
        return path
    if labels:
        raise InputError(f"{key}: no such file {path}")
    if required:
        raise InputError(f"{key} is not set and {path} does not exist: give a labels file "
                         f"('<file>\\t<latex>' lines)")
    return None


def is_image_file(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES


def image_files(folder: str | Path, key: str) -> list[Path]:
    """The image files directly in ``folder``, sorted by name."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"{key}: no such folder {folder}")
    paths = sorted(p for p in folder.iterdir() if is_image_file(p))
    if not paths:
        raise InputError(f"{key}: no image ({' '.join(IMAGE_SUFFIXES)}) in {folder}")
    return paths


def image_list(path: str | Path, key: str) -> list[Path]:
    """The images a text file lists, one path a line (blank lines and ``#`` comments skipped), relative
    ones from the list's folder, in the list's order. A listed file that is missing is kept: the
    reader reports it with the others it cannot read."""
    path = Path(path)
    lines = [ln.strip() for ln in read_text(path, key).splitlines()]
    paths = [Path(ln) if Path(ln).is_absolute() else path.parent / ln for ln in lines if ln and not ln.startswith("#")]
    if not paths:
        raise InputError(f"{key}={path}: lists no image path (one path a line)")
    return paths


def open_image(path: str | Path) -> Image.Image:
    """Decode one image fully, refusing what is not an image or too big before it is decoded.

    Raises :class:`ImageError` naming the file and why; the caller skips it or, when it is the only
    input, lets the CLI print it."""
    path = Path(path)
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise ImageError(f"{path.name}: unsupported file type {path.suffix or '(no suffix)'!r}; "
                         f"reads {' '.join(IMAGE_SUFFIXES)}")
    return decode_image(path, path.name)


def decode_image(src: str | Path | BinaryIO, name: str) -> Image.Image:
    """:func:`open_image` for a path of any suffix or an in-memory file (dataset rows): the same guard."""

    def too_big(size: str) -> ImageError:
        return ImageError(f"{name}: {size} is above the {MAX_IMAGE_PIXELS:,}-pixel limit for a formula "
                          f"image (a decompression bomb?); crop or downscale it")

    try:
        with Image.open(src) as im:  # reads the header only
            w, h = im.size
            if w * h > MAX_IMAGE_PIXELS:
                raise too_big(f"{w}x{h} pixels")
            if w == 0 or h == 0:
                raise ImageError(f"{name}: image has zero size")
            im.load()
            return im.copy()
    except ImageError:
        raise
    except FileNotFoundError:
        raise ImageError(f"{name}: no such file") from None
    except Image.DecompressionBombError as exc:  # PIL's own guard fires in open() above twice its limit
        pixels = re.search(r"\((\d+) pixels\)", str(exc))
        raise too_big(f"{int(pixels.group(1)):,} pixels" if pixels else "the image") from None
    except DECODE_ERRORS as exc:
        msg = str(exc).splitlines()[0] if str(exc) else ""
        raise ImageError(f"{name}: cannot decode ({type(exc).__name__}{': ' + msg[:120] if msg else ''})") from None


def check_name(value: Optional[str], key: str) -> None:
    """An artifact folder name: one path component, so nothing is written outside the artifacts root."""
    if value is None:
        return
    bad = (not value or value in (".", "..") or "/" in value or os.sep in value
           or (os.altsep and os.altsep in value) or "\0" in value)
    if bad:
        raise ConfigError(f"{key}={value!r}: a name must be one folder name (no '/', not '.' or '..'); "
                          f"use {key}=<name> and artifacts.dir to move the root")


def check_output_dir(path: str | Path, key: str) -> Path:
    """A folder the run will create or write into: not a file, its nearest existing ancestor writable."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{key}={path}: is a file, not a folder; point it at a folder")
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise OutputError(f"{key}={path}: {probe} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"{key}={path}: {probe} is not writable")
    return path


def check_output_file(path: str | Path, key: str) -> Path:
    """A file the run will write at the end: checked before the work, not after it."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{key}={path}: is a folder; give a file path")
    parent = path.parent
    if not parent.is_dir():
        raise OutputError(f"{key}={path}: folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise OutputError(f"{key}={path}: not writable")
    return path


def package_path(ref: str, artifacts_dir: Path) -> Optional[Path]:
    """An exported package: ``ref`` as a folder holding ``package.json``, or an export stage's name
    under the root; None when neither is one."""
    for cand in (Path(ref), Path(artifacts_dir) / ref):
        if (cand / PACKAGE_META).is_file():
            return cand
    return None


def find_package(ref: Optional[str], artifacts_dir: Path, key: str) -> Path:
    """:func:`package_path`, or one error line naming ``key``."""
    if not ref:
        raise ConfigError(f"{key} is not set: give {key}=<exported package folder or export stage name>")
    found = package_path(ref, artifacts_dir)
    if found is not None:
        return found
    raise InputError(f"{key}={ref}: not an exported package folder (no {PACKAGE_META}) nor an export "
                     f"under {artifacts_dir}; run stage=export first")


def write_text_atomic(path: str | Path, text: str) -> Path:
    """``text`` into ``path`` through a temporary file beside it, renamed into place: a reader (or an
    interrupted run) sees the old file or the whole new one, never half of it."""
    return replace_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def replace_file(path: str | Path, write) -> Path:
    """``write(tmp)`` fills a temporary file beside ``path``, then it is renamed onto ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
