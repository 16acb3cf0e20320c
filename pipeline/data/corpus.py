"""The formula corpus: real formulas from the docstrings of pinned scientific Python packages.

Sources are the ``:math:`...``` roles and ``.. math::`` blocks in the string literals of the
installed (pinned) packages' source files, read with ``ast`` (no module is imported or run). A
formula is kept only where mathtext renders it; formulas are de-duplicated after normalization and
split into disjoint train / calib / eval parts by a seeded hash, so a formula's split does not
depend on what else is in the corpus.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import re
import warnings
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Iterable

from tqdm import tqdm

from pipeline.choices import choices
from pipeline.data.render import RenderError, render_formula
from pipeline.errors import PipelineError
from pipeline.metrics import normalize
from pipeline.pools import process_pool

SPLITS = ("train", "calib", "eval")
SHIFT = "shift"  # formulas from packages the corpus never read (pipeline.context: corpus-shift)
Split = choices("Split", (*SPLITS, SHIFT), __name__)  # a stage option naming a split


def check_splits(key: str, names) -> None:
    """``key`` names corpus splits (or the shift split) a stage reads: one error line at config time for a
    name that is none of them (the stage would find no such split only when it starts reading)."""
    unknown = [n for n in ([names] if isinstance(names, str) else list(names)) if n not in (*SPLITS, SHIFT)]
    if unknown:
        raise PipelineError(f"{key}: unknown split(s) {', '.join(map(repr, unknown))}; known: "
                            f"{', '.join((*SPLITS, SHIFT))}")


_ROLE = re.compile(r":math:`([^`]+)`")
_DIRECTIVE = re.compile(r"^([ \t]*)\.\. math::[ \t]*(.*)$", re.M)
# docutils also reads ``.. math ::`` (one space before the colons), mpmath's spelling. The corpus is
# built without it (its splits and every figure measured on them stay as they are); the shift split
# reads both spellings.
_DIRECTIVE_SPACED = re.compile(r"^([ \t]*)\.\. math ?::[ \t]*(.*)$", re.M)
# Multi-line layouts mathtext cannot draw.
_UNSUPPORTED = re.compile(r"\\\\|&|\\begin|\\end|\\label|\\tag|\\require|\\newcommand|\\def|\\eqref|\\ref\b|%")


@dataclass(frozen=True)
class Formula:
    id: str          # sha1 of the normalized formula (first 12 hex)
    latex: str       # as written in the docstring (first spelling seen)
    normalized: str
    split: str
    source: str      # package/relative/path.py


def package_files(package: str) -> list[tuple[str, str]]:
    """(absolute path, path relative to the distribution) of every .py file of ``package``."""
    try:
        dist = metadata.distribution(package)
    except metadata.PackageNotFoundError:
        raise PipelineError(f"corpus package {package!r} is not installed") from None
    files = sorted(str(f) for f in (dist.files or []) if str(f).endswith(".py"))
    return [(str(dist.locate_file(rel)), rel) for rel in files]


def file_formulas(path: str, spaced_directive: bool = False) -> list[str]:
    """Formulas in the string literals of one source file (parsed with ``ast``, never imported)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return []
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                "math:" in node.value or (spaced_directive and "math ::" in node.value)):
            found.extend(extract_math(node.value, spaced_directive))
    return found


def _render_size(latex: str) -> tuple[int, int] | None:
    try:
        img = render_formula(latex)
    except RenderError:
        return None
    return img.width, img.height


def _pool_map(fn, items: list, workers: int, desc: str, progress: bool) -> list:
    """Ordered parallel map (deterministic: results come back in input order)."""
    bar = tqdm(total=len(items), desc=desc, disable=not progress)
    if workers <= 1 or len(items) < 64:
        out = []
        for it in items:
            out.append(fn(it))
            bar.update()
    else:
        with process_pool(workers) as pool:
            out = []
            for r in pool.imap(fn, items, chunksize=16):
                out.append(r)
                bar.update()
    bar.close()
    return out


def extract_math(doc: str, spaced_directive: bool = False) -> list[str]:
    found = [m.group(1) for m in _ROLE.finditer(doc)]
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        m = (_DIRECTIVE_SPACED if spaced_directive else _DIRECTIVE).match(line)
        if not m:
            continue
        indent, inline = len(m.group(1).expandtabs()), m.group(2).strip()
        if inline:
            found.append(inline)
            continue
        block: list[str] = []
        for nxt in lines[i + 1:]:
            if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                break
            block.append(nxt.strip())
        # each blank-line separated paragraph of a math block is one formula
        para: list[str] = []
        for b in block + [""]:
            if b:
                para.append(b)
            elif para:
                found.append(" ".join(para))
                para = []
    return [clean(f) for f in found if clean(f)]


def clean(formula: str) -> str:
    s = " ".join(formula.split())
    return s.strip().strip(".,;").strip()


def keep(latex: str, min_chars: int, max_chars: int) -> bool:
    norm = normalize(latex)
    if not (min_chars <= len(norm) <= max_chars) or _UNSUPPORTED.search(latex):
        return False
    return "math:" not in latex and ":" not in latex.split("\\")[0][:1]


def assign_split(norm: str, seed: int, shares: dict[str, float]) -> str:
    """Split from a seeded hash of the normalized text: stable, disjoint, order-independent."""
    h = int(hashlib.sha256(f"{seed}:{norm}".encode()).hexdigest()[:12], 16) / float(16 ** 12)
    acc = 0.0
    for name in SPLITS:
        acc += shares[name]
        if h < acc:
            return name
    return SPLITS[-1]


def _candidates(packages: Iterable[str], min_chars: int, max_chars: int, workers: int, progress: bool,
                spaced_directive: bool = False) -> list[tuple[str, tuple[str, str]]]:
    """(normalized, (first spelling, source)) of every kept formula of ``packages``, sorted, de-duplicated."""
    files = [(pkg, path, rel) for pkg in packages for path, rel in package_files(pkg)]
    read = functools.partial(file_formulas, spaced_directive=spaced_directive)
    per_file = _pool_map(read, [f[1] for f in files], workers, "read docstrings", progress)
    seen: dict[str, tuple[str, str]] = {}
    for (package, _, rel), found in zip(files, per_file):
        for latex in found:
            if not keep(latex, min_chars, max_chars):
                continue
            norm = normalize(latex)
            if norm not in seen:
                seen[norm] = (latex, f"{package}/{rel}")
    return sorted(seen.items())


def _fitting(candidates: list[tuple[str, tuple[str, str]]], max_width_px: int, max_height_px: int,
             workers: int, progress: bool) -> list[tuple[str, str, str]]:
    """(normalized, latex, source) of the candidates mathtext renders within the canvas bounds."""
    sizes = _pool_map(_render_size, [latex for _, (latex, _) in candidates], workers, "render-check formulas", progress)
    return [(norm, latex, source) for (norm, (latex, source)), size in zip(candidates, sizes)
            # unrenderable, or would have to shrink below the scale the model reads
            if size is not None and size[0] <= max_width_px and size[1] <= max_height_px]


def _formula_id(norm: str) -> str:
    return hashlib.sha1(norm.encode()).hexdigest()[:12]


def build_corpus(packages: Iterable[str], seed: int, shares: dict[str, float], min_chars: int,
                 max_chars: int, max_width_px: int, max_height_px: int, progress: bool = True,
                 workers: int | None = None) -> list[Formula]:
    """Extract, filter (renderable, size), de-duplicate and split. Deterministic for pinned packages."""
    total = sum(shares.get(s, 0.0) for s in SPLITS)
    if abs(total - 1.0) > 1e-6:
        raise PipelineError(f"data split shares must sum to 1, got {total}")
    workers = workers or os.cpu_count() or 1
    candidates = _candidates(packages, min_chars, max_chars, workers, progress)
    return [Formula(_formula_id(norm), latex, norm, assign_split(norm, seed, shares), source)
            for norm, latex, source in _fitting(candidates, max_width_px, max_height_px, workers, progress)]


def build_shift_split(packages: Iterable[str], exclude: set[str], min_chars: int, max_chars: int,
                      max_width_px: int, max_height_px: int, progress: bool = True,
                      workers: int | None = None) -> list[Formula]:
    """The shift split: formulas of packages the corpus never read, extracted and filtered like the
    corpus, minus every formula whose normalized text is in ``exclude`` (the corpus, all splits).
    Only for measuring: never train, calibrate or choose a default on it."""
    workers = workers or os.cpu_count() or 1
    candidates = [c for c in _candidates(packages, min_chars, max_chars, workers, progress, spaced_directive=True)
                  if c[0] not in exclude]
    return [Formula(_formula_id(norm), latex, norm, SHIFT, source)
            for norm, latex, source in _fitting(candidates, max_width_px, max_height_px, workers, progress)]


def write_jsonl(path: Path, formulas: Iterable[Formula]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for item in formulas:
            f.write(json.dumps(asdict(item), ensure_ascii=False, sort_keys=True) + "\n")


def read_jsonl(path: Path) -> list[Formula]:
    with open(path, encoding="utf-8") as f:
        return [Formula(**json.loads(line)) for line in f if line.strip()]
