"""Calibration sets: sources, buckets, duplicate removal and stratified selection.

A calibration set is chosen so that every kind of input the model meets is present in about the
share it has in the source: each candidate image is preprocessed by the model's own inference
preprocessing (passed in as ``preprocess``; this module never reimplements it), measured on the
canvas the model sees, put in a bucket, and N are drawn per bucket with a seeded generator.

Buckets (fixed edges, so a bucket means the same thing for every source):

* labelled sources (text known for every image): normalized formula length x ink width x ink
  height x structure (``frac`` > ``bigop`` > ``scripts+`` (3 or more scripts) > ``scripts`` >
  ``plain``, the first that applies);
* unlabelled sources: ink width x ink height x ink density (share of ink pixels inside the ink box).
"""
from __future__ import annotations

import hashlib
import io
import os
import re
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
from PIL import Image
from tqdm import tqdm

from pipeline import files
from pipeline.data.render import INK_THRESHOLD, RenderError, render_formula
from pipeline.errors import ImageError, PipelineError
from pipeline.files import DECODE_ERRORS as FILE_DECODE_ERRORS
from pipeline.metrics import normalize
from pipeline.pools import process_pool

MIN_SIZE, MAX_SIZE = 32, 4096
# the data group's kinds (conf/data/*.yaml): the corpus, a folder of images, a saved HF dataset
KINDS = ("corpus", "image_folder", "hf_disk")

# one suffix list and one set of decode errors for every stage (pipeline/files.py)
DECODE_ERRORS = FILE_DECODE_ERRORS + (ImageError,)

# Bucket edges: a value v falls in [edges[i], edges[i+1]); the last bin is open.
LENGTH_EDGES = (0, 10, 20, 40, 80)            # normalized characters
WIDTH_EDGES = (0, 64, 128, 256, 384)          # ink px on the model's canvas
HEIGHT_EDGES = (0, 20, 32, 48, 72)            # ink px on the model's canvas
DENSITY_EDGES = (0.0, 0.15, 0.25, 0.35)       # ink share inside the ink box (unlabelled sources)

_FRAC = re.compile(r"\\(?:[dtc]?frac|over|binom|[dt]binom|choose)(?![a-zA-Z])")
_BIGOP = re.compile(r"\\(?:sum|prod|coprod|i+nt|oint|lim|limsup|liminf|bigcup|bigcap|bigoplus|bigotimes|"
                    r"bigvee|bigwedge|sup|inf|max|min|argmax|argmin)(?![a-zA-Z])")
_SCRIPT = re.compile(r"[_^]")


# ---- what a candidate is ------------------------------------------------------------------------
@dataclass
class Candidate:
    source_id: str
    text: Optional[str]
    ink_width: int
    ink_height: int
    ink_density: float
    digest: str                  # sha1 of the preprocessed tensor: exact duplicates
    thumb: np.ndarray            # the ink box at 16 x 64: near duplicates
    length: Optional[int] = None
    structure: Optional[str] = None
    bucket: str = ""


@dataclass
class SourceScan:
    """Everything a source yielded: usable candidates in source order, and what was skipped."""

    description: str
    candidates: list[Candidate]
    skipped: dict[str, str] = field(default_factory=dict)      # source id -> why
    duplicates: dict[str, str] = field(default_factory=dict)   # source id -> "exact|near duplicate of <id>"
    scheme: str = "text"                                       # text | image
    total: int = 0                                             # items the source offered


def structure_of(latex: str) -> str:
    if _FRAC.search(latex):
        return "frac"
    if _BIGOP.search(latex):
        return "bigop"
    scripts = len(_SCRIPT.findall(latex))
    if scripts >= 3:
        return "scripts+"
    return "scripts" if scripts else "plain"


def bin_label(value: float, edges: Sequence[float], fmt: str = "{:g}") -> str:
    i = int(np.searchsorted(np.asarray(edges, dtype=float), value, side="right")) - 1
    i = max(i, 0)
    if i == len(edges) - 1:
        return fmt.format(edges[i]) + "+"
    hi = edges[i + 1]
    return fmt.format(edges[i]) + "-" + (fmt.format(hi - 1) if isinstance(hi, int) else "<" + fmt.format(hi))


def bucket_axes(c: Candidate, scheme: str) -> dict[str, str]:
    """The bucket of one candidate, axis by axis (the joint key is these joined)."""
    axes = {"width": "W" + bin_label(c.ink_width, WIDTH_EDGES), "height": "H" + bin_label(c.ink_height, HEIGHT_EDGES)}
    if scheme == "text":
        return {"length": "L" + bin_label(c.length or 0, LENGTH_EDGES), **axes, "structure": c.structure or "plain"}
    return {**axes, "density": "D" + bin_label(c.ink_density, DENSITY_EDGES, "{:.2f}")}


def measure(source_id: str, text: Optional[str], tensor) -> Optional[Candidate]:
    """Measure a preprocessed tensor [C, H, W] in [0, 1]; None when the canvas holds no ink."""
    arr = np.asarray(tensor, dtype=np.float32)
    canvas = arr if arr.ndim == 2 else arr.mean(axis=0)  # [C, H, W]: the mean over channels
    ink = canvas < INK_THRESHOLD / 255.0
    ys, xs = np.nonzero(ink)
    if len(xs) == 0:
        return None
    y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
    box = canvas[y0:y1, x0:x1]
    thumb = Image.fromarray(np.round(box * 255).astype(np.uint8)).resize((64, 16), Image.BOX)
    c = Candidate(source_id=source_id, text=text, ink_width=int(x1 - x0), ink_height=int(y1 - y0),
                  ink_density=float(ink[y0:y1, x0:x1].mean()),
                  digest=hashlib.sha1(arr.tobytes()).hexdigest(),
                  thumb=np.asarray(thumb, dtype=np.float32) / 255.0)
    if text is not None:
        c.length = len(normalize(text))
        c.structure = structure_of(text)
    return c


# ---- rendering in parallel ------------------------------------------------------------------
def _render_png(latex: str) -> tuple[bool, bytes | str]:
    try:
        img = render_formula(latex)
    except RenderError as exc:
        return False, str(exc)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return True, buf.getvalue()


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def idle_cores() -> int:
    """Cores this process may use minus the 1-minute load (at least 1): on a machine already busy
    with other work a pool only adds start-up and transfer cost (measured: docs/calibrate.md)."""
    cores = available_cores()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return cores
    return max(1, min(cores, int(cores - load + 1)))


def render_many(latexes: Sequence[str], workers: int = 0, progress: bool = True,
                min_parallel: int = 64) -> list[Image.Image | RenderError]:
    """Render formulas in order; a process pool when there are enough formulas and idle cores
    (``workers=0``) or ``workers`` processes.

    ``imap`` keeps the input order, so the result does not depend on which worker rendered what.
    """
    workers = workers or idle_cores()
    bar = tqdm(total=len(latexes), desc="render", unit="formula", disable=not progress)
    results: list[Image.Image | RenderError] = []

    def keep(ok: bool, payload: bytes | str) -> None:
        if ok:
            with Image.open(io.BytesIO(payload)) as im:
                results.append(im.convert("L"))
        else:
            results.append(RenderError(payload))
        bar.update()

    if workers > 1 and len(latexes) >= min_parallel:
        with process_pool(workers) as pool:
            for ok, payload in pool.imap(_render_png, latexes, chunksize=8):
                keep(ok, payload)
    else:
        for latex in latexes:
            keep(*_render_png(latex))
    bar.close()
    return results


# ---- sources ----------------------------------------------------------------------------------
def check_source(data) -> None:
    """The ``data`` group as a config, before any stage's work (calibrate opens it after prune's minutes
    under ``stage=all``): a known kind, and for a folder of images or a saved dataset a ``data.path`` that
    exists (and ``data.labels``, when named, a file). Reads no file."""
    from omegaconf import OmegaConf

    from pipeline.errors import ConfigError

    kind = str(data.kind)
    if kind not in KINDS:
        raise ConfigError(f"data.kind {kind!r} unknown; known: {', '.join(KINDS)}")
    if kind == "corpus":
        return
    if OmegaConf.is_missing(data, "path") or not data.get("path"):
        raise ConfigError(f"data.path is required for data={kind}")
    if not Path(str(data.path)).exists():
        raise ConfigError(f"data.path: {data.path} does not exist")
    if kind == "image_folder" and data.get("labels") and not Path(str(data.labels)).is_file():
        raise ConfigError(f"data.labels: no such file {data.labels}")


Preprocess = Callable[[Image.Image], "object"]


class Source:
    """A deterministic, ordered stream of (source id, text or None, PIL image) and a way back."""

    description = ""

    def scan(self, preprocess: Preprocess, progress: bool) -> SourceScan:
        raise NotImplementedError

    def image(self, source_id: str) -> Image.Image:
        """The image of one usable candidate again (to build the set's tensors)."""
        raise NotImplementedError

    def _measure_all(self, items: Iterable[tuple[str, Optional[str], Image.Image | Exception]],
                     preprocess: Preprocess, scan: SourceScan) -> None:
        for source_id, text, image in items:
            scan.total += 1
            if isinstance(image, Exception):
                scan.skipped[source_id] = _reason(image)
                continue
            try:
                tensor = preprocess(image)
            except DECODE_ERRORS as exc:  # decoding is lazy for some formats: errors surface here
                scan.skipped[source_id] = _reason(exc)
                continue
            cand = measure(source_id, text, tensor)
            if cand is None:
                scan.skipped[source_id] = "blank (no ink)"
                continue
            scan.candidates.append(cand)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ImageError):  # already says what and why
        return str(exc)[:160]
    msg = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {msg}"[:160] if msg else type(exc).__name__


class CorpusSource(Source):
    """The project's formula corpus, calibration split only, rendered at the model's scale."""

    def __init__(self, formulas: Sequence, workers: int = 0):
        self.formulas = list(formulas)
        self.workers = workers
        self.description = f"corpus split 'calib' ({len(self.formulas)} formulas)"
        self._images: dict[str, Image.Image] = {}

    def scan(self, preprocess: Preprocess, progress: bool) -> SourceScan:
        scan = SourceScan(self.description, [], scheme="text")
        rendered = render_many([f.latex for f in self.formulas], self.workers, progress)
        items = []
        for f, img in zip(self.formulas, rendered):
            if isinstance(img, Image.Image):
                self._images[f.id] = img
            items.append((f.id, f.latex, img))
        self._measure_all(items, preprocess, scan)
        return scan

    def image(self, source_id: str) -> Image.Image:
        return self._images[source_id]


class ImageFolderSource(Source):
    """Every file under a folder (sorted); images decode, everything else is a named skip."""

    def __init__(self, folder: str | Path, labels: str | Path | None = None):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise PipelineError(f"data.path: no such folder {self.folder}")
        self.labels_path = files.labels_file(self.folder, labels, "data.labels")
        self.labels = dict(files.read_labels(self.labels_path, "data.labels")) if self.labels_path else {}
        self.files = sorted((p for p in self.folder.rglob("*") if p.is_file()
                             and (self.labels_path is None or p.resolve() != self.labels_path.resolve())),
                            key=lambda p: p.relative_to(self.folder).as_posix())
        if not self.files:
            raise PipelineError(f"data.path: folder {self.folder} holds no files")
        self.description = f"image folder {self.folder} ({len(self.files)} files" + \
            (f", labels {self.labels_path})" if self.labels_path else ", unlabelled)")

    def _open(self, path: Path) -> Image.Image:
        return files.open_image(path)

    def scan(self, preprocess: Preprocess, progress: bool) -> SourceScan:
        labelled = bool(self.labels)
        scan = SourceScan(self.description, [], scheme="text" if labelled else "image")

        def items():
            for path in tqdm(self.files, desc="read", unit="file", disable=not progress):
                rel = path.relative_to(self.folder).as_posix()
                try:
                    img: Image.Image | Exception = self._open(path)
                except DECODE_ERRORS as exc:
                    img = exc
                yield rel, self.labels.get(rel), img

        self._measure_all(items(), preprocess, scan)
        if labelled:
            missing = sorted(set(self.labels) - {c.source_id for c in scan.candidates} - set(scan.skipped))
            for name in missing:
                scan.skipped[name] = "labelled but no such file"
            unlabelled = [c.source_id for c in scan.candidates if c.text is None]
            if unlabelled:  # a partly labelled folder is bucketed by image statistics alone
                scan.scheme = "image"
        return scan

    def image(self, source_id: str) -> Image.Image:
        return self._open(self.folder / source_id)


class HFDiskSource(Source):
    """A Hugging Face dataset saved with ``save_to_disk`` (a Dataset, or one split of a DatasetDict)."""

    SPLIT_PREFERENCE = ("calibration", "calib", "validation", "train")

    def __init__(self, path: str | Path, image_column: str = "image", text_column: Optional[str] = "latex"):
        import datasets

        self.path = Path(path)
        if not self.path.exists():
            raise PipelineError(f"data.path: no such dataset folder {self.path}")
        try:
            ds = datasets.load_from_disk(str(self.path))
        except (FileNotFoundError, ValueError, OSError) as exc:
            raise PipelineError(f"data.path: {self.path} is not a dataset saved with save_to_disk "
                                f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
        split = None
        if isinstance(ds, datasets.DatasetDict):
            names = list(ds)
            split = names[0] if len(names) == 1 else next((s for s in self.SPLIT_PREFERENCE if s in ds), None)
            if split is None:
                raise PipelineError(f"data.path: {self.path} holds splits {names}; none of "
                                    f"{list(self.SPLIT_PREFERENCE)} to calibrate on")
            ds = ds[split]
        if image_column not in ds.column_names:
            raise PipelineError(f"data.image_column: {image_column!r} is not a column of {self.path} "
                                f"(columns: {', '.join(ds.column_names)})")
        if len(ds) == 0:
            raise PipelineError(f"data.path: dataset {self.path} is empty")
        if isinstance(ds.features[image_column], datasets.Image):
            ds = ds.cast_column(image_column, datasets.Image(decode=False))  # decode here: a corrupt row is a skip
        self.text_column = text_column if text_column and text_column in ds.column_names else None
        self.ds, self.image_column = ds, image_column
        self.description = (f"dataset {self.path}" + (f" split {split!r}" if split else "")
                            + f" ({len(ds)} rows, " + (f"text column {self.text_column!r})" if self.text_column
                                                       else "unlabelled)"))

    def _decode(self, value) -> Image.Image:
        if isinstance(value, Image.Image):
            img = value
        elif isinstance(value, dict) and (value.get("bytes") or value.get("path")):
            src = io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"]
            img = files.decode_image(src, "this row's image")
        elif isinstance(value, (bytes, bytearray)):
            img = files.decode_image(io.BytesIO(value), "this row's image")
        elif value is not None and np.asarray(value).ndim in (2, 3) and np.asarray(value).size:
            img = Image.fromarray(np.asarray(value))
        else:
            raise ValueError(f"no image in this row ({type(value).__name__})")
        if img.width == 0 or img.height == 0:
            raise ValueError("image has zero size")
        return img

    def _row(self, i: int) -> tuple[Optional[str], Image.Image]:
        row = self.ds[i]
        text = row[self.text_column] if self.text_column else None
        return (str(text) if text is not None else None), self._decode(row[self.image_column])

    def scan(self, preprocess: Preprocess, progress: bool) -> SourceScan:
        scan = SourceScan(self.description, [], scheme="text" if self.text_column else "image")

        def items():
            for i in tqdm(range(len(self.ds)), desc="read", unit="row", disable=not progress):
                try:
                    text, img = self._row(i)
                except DECODE_ERRORS + (TypeError,) as exc:
                    text, img = None, exc
                yield f"row{i}", text, img

        self._measure_all(items(), preprocess, scan)
        if any(c.text is None for c in scan.candidates):
            scan.scheme = "image"
        return scan

    def image(self, source_id: str) -> Image.Image:
        return self._row(int(source_id[3:]))[1]


# ---- duplicates, buckets, selection ---------------------------------------------------------
def remove_duplicates(scan: SourceScan, near_mad: float, size_tolerance: int = 2) -> None:
    """Drop exact duplicates (same tensor) and near duplicates (ink boxes within
    ``size_tolerance`` px and 16x64 thumbnails closer than ``near_mad`` mean absolute difference).
    The first in source order is kept, so the result does not depend on anything but the source."""
    first_by_digest: dict[str, str] = {}
    cells: dict[tuple[int, int], list[Candidate]] = {}
    step = 2 * size_tolerance + 1
    kept = []
    for c in scan.candidates:
        if c.digest in first_by_digest:
            scan.duplicates[c.source_id] = f"exact duplicate of {first_by_digest[c.digest]}"
            continue
        cw, ch = c.ink_width // step, c.ink_height // step
        neighbours = (o for dw in (-1, 0, 1) for dh in (-1, 0, 1) for o in cells.get((cw + dw, ch + dh), ()))
        twin = next((o for o in neighbours if near_mad > 0
                     and abs(o.ink_width - c.ink_width) <= size_tolerance
                     and abs(o.ink_height - c.ink_height) <= size_tolerance
                     and float(np.abs(o.thumb - c.thumb).mean()) < near_mad), None)
        if twin is not None:
            scan.duplicates[c.source_id] = f"near duplicate of {twin.source_id}"
            continue
        first_by_digest[c.digest] = c.source_id
        cells.setdefault((cw, ch), []).append(c)
        kept.append(c)
    scan.candidates = kept


def assign_buckets(scan: SourceScan) -> None:
    for c in scan.candidates:
        c.bucket = " ".join(bucket_axes(c, scan.scheme).values())


def allocate(counts: dict[str, int], size: int) -> dict[str, int]:
    """Seats per bucket, coverage first: one for every non-empty bucket (for the ``size`` most
    populous ones when there are more buckets than seats), the rest by largest remainder of the
    proportional quota, never more than a bucket holds."""
    total = sum(counts.values())
    keys = sorted(k for k, n in counts.items() if n > 0)
    quota = {k: size * counts[k] / total for k in keys}
    if size < len(keys):
        largest = sorted(keys, key=lambda k: -counts[k])[:size]  # stable: ties stay in name order
        return {k: int(k in largest) for k in keys}
    seats = {k: 1 for k in keys}
    left = size - sum(seats.values())
    # each round gives one seat to the bucket furthest below its quota (ties: larger, then by name)
    while left > 0:
        open_keys = [k for k in keys if seats[k] < counts[k]]
        best = max(open_keys, key=lambda k: (quota[k] - seats[k], counts[k]))  # first in name order on ties
        seats[best] += 1
        left -= 1
    return seats


def select(scan: SourceScan, size: int, seed: int) -> list[Candidate]:
    """Stratified, seeded draw of ``size`` candidates; the set's order is a seeded shuffle (so a
    moving-average calibrator does not see one bucket after another)."""
    usable = len(scan.candidates)
    if usable < size:
        raise PipelineError(
            f"only {usable} usable images in {scan.description} ({len(scan.skipped)} skipped, "
            f"{len(scan.duplicates)} duplicates removed); calibrate.size={size} needs at least that many: "
            f"lower calibrate.size or add images")
    by_bucket: dict[str, list[Candidate]] = {}
    for c in scan.candidates:
        by_bucket.setdefault(c.bucket, []).append(c)
    seats = allocate({k: len(v) for k, v in by_bucket.items()}, size)
    chosen: list[Candidate] = []
    for key in sorted(by_bucket):
        members = by_bucket[key]
        # one generator per bucket: a bucket's draw does not depend on the other buckets
        rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
        picks = np.sort(rng.choice(len(members), size=seats.get(key, 0), replace=False))
        chosen.extend(members[i] for i in picks)
    order = np.random.default_rng([seed, 1]).permutation(len(chosen))
    return [chosen[i] for i in order]


# ---- coverage ---------------------------------------------------------------------------------
def coverage_report(scan: SourceScan, chosen: Sequence[Candidate]) -> dict:
    """Per-bucket counts (source vs set), coverage of non-empty source buckets, share distances."""
    src = Counter(c.bucket for c in scan.candidates)
    got = Counter(c.bucket for c in chosen)
    n_src, n_set = sum(src.values()), max(1, len(chosen))
    buckets = {k: {"source": src[k], "set": got.get(k, 0)} for k in sorted(src)}
    covered = sum(1 for k in src if got.get(k, 0) > 0)
    tv = 0.5 * sum(abs(got.get(k, 0) / n_set - src[k] / n_src) for k in src)
    marginals = {}
    axes = list(bucket_axes(scan.candidates[0], scan.scheme)) if scan.candidates else []
    for axis in axes:
        s = Counter(bucket_axes(c, scan.scheme)[axis] for c in scan.candidates)
        g = Counter(bucket_axes(c, scan.scheme)[axis] for c in chosen)
        marginals[axis] = {
            "source": dict(sorted(s.items())), "set": dict(sorted(g.items())),
            "tv_distance": round(0.5 * sum(abs(g.get(k, 0) / n_set - s[k] / n_src) for k in s), 6),
        }
    return {
        "scheme": scan.scheme,
        "buckets": buckets,
        "nonempty_source_buckets": len(src),
        "covered_buckets": covered,
        "coverage": round(covered / len(src), 6) if src else 0.0,
        "share_tv_distance": round(tv, 6),
        "share_max_abs_diff": round(max((abs(got.get(k, 0) / n_set - src[k] / n_src) for k in src), default=0.0), 6),
        "marginals": marginals,
    }


def tv_bound(n_buckets: int, size: int) -> float:
    """What :func:`allocate` guarantees for the joint bucket shares: each bucket is within one
    seat of its quota except where the one-seat floor lifts it, so TV <= buckets / size."""
    return min(1.0, n_buckets / size)


def iter_batches(items: Sequence, size: int) -> Iterator[Sequence]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def choose(scan: SourceScan, near_duplicate: float, size: int, seed: int) -> list[Candidate]:
    """The set: duplicates removed, the rest bucketed, ``size`` drawn by bucket (:func:`select`)."""
    remove_duplicates(scan, near_duplicate)
    assign_buckets(scan)
    return select(scan, size, seed)
