"""The variants a benchmark compares behind one decode call: the torch model (full-prefix or
KV-cached decoding) and exported ONNX Runtime packages; where each lives and its size on disk."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from pipeline.adapters.base import DecodeResult, ModelAdapter
from pipeline.errors import PipelineError
from pipeline.files import package_path
from pipeline.export.runtime import PACKAGE_META, OnnxPackage
from pipeline.names import MANIFEST

log = logging.getLogger(__name__)

TORCH = "torch"           # the shipped decoder: the whole prefix re-run at each step
TORCH_KV = "torch_kv"     # the same model with the adapter's KV cache
PACKAGE = "package"       # an exported package on ONNX Runtime (KV-cached decoder graphs)

# files of a package that a deployment ships (reports, plots and parity rows do not count)
PACKAGE_SHIPPED = ("tokenizer.json", "preprocess.json", PACKAGE_META, "provider_options.json")


@dataclass
class Variant:
    label: str
    kind: str                 # TORCH | TORCH_KV | PACKAGE
    location: str             # model reference (torch) or package folder
    size_bytes: int           # what it occupies on disk as shipped
    decode: Callable[[np.ndarray, int, int], DecodeResult]  # (images [B, C, H, W], max_length, batch size)
    spec: dict = field(default_factory=dict)  # how a fresh process rebuilds it (peak memory)
    package: Optional[OnnxPackage] = None


def resolve_packages(requested: dict[str, str], defaults: dict[str, str], root: Path,
                     comparisons: dict[str, str] | None = None) -> tuple[dict[str, Path], list[str]]:
    """Label -> package folder: every default that exists, then every requested one.

    A requested package that is missing is an error; a missing default is skipped and named in
    the returned notes (one line each; for a comparison row, with the setting that makes it)."""
    found: dict[str, Path] = {}
    notes = []
    for label, ref in defaults.items():
        if label in requested:
            continue
        folder = package_path(ref, root)
        if folder is None:
            how = (comparisons or {}).get(label)
            notes.append(f"no package {ref!r} under {root}: variant '{label}' skipped"
                         + (f" (a comparison row: {how} with stage=all, or preset=thorough, makes it)" if how else ""))
        else:
            found[label] = folder
    requested = expand_patterns(requested, root)
    missing = [f"{label}={ref}" for label, ref in requested.items() if package_path(ref, root) is None]
    if missing:
        raise PipelineError(f"benchmark.packages: no exported package (no {PACKAGE_META}) at {', '.join(missing)} "
                            f"(a folder, or an export stage's name under {root})")
    for label, ref in requested.items():
        found[label] = package_path(ref, root)  # type: ignore[assignment]
    return found, notes


def expand_patterns(requested: dict[str, str], root: Path) -> dict[str, str]:
    """A reference with ``*`` (``export-ort_cpu-*``: the packages of a sweep's jobs) becomes one entry
    per package it matches under ``root`` (or as a path), labelled ``<label> <folder name>``; a pattern
    that matches no package is an error."""
    out: dict[str, str] = {}
    for label, ref in requested.items():
        if "*" not in ref:
            out[label] = ref
            continue
        base = Path(ref) if Path(ref).is_absolute() else root / ref
        found = sorted(p for p in base.parent.glob(base.name) if (p / PACKAGE_META).is_file())
        if not found:
            raise PipelineError(f"benchmark.packages: {label}={ref} matches no exported package under {base.parent}")
        out.update({f"{label} {p.name}": str(p) for p in found})
    return out


def dir_bytes(paths: list[Path]) -> int:
    total = 0
    for p in paths:
        if p.is_dir():
            total += sum(q.stat().st_size for q in p.rglob("*") if q.is_file())
        elif p.is_file():
            total += p.stat().st_size
    return total


def package_files(folder: Path) -> list[Path]:
    """The files a package ships: its graphs (with external weights) and its JSON."""
    meta = json.loads((folder / PACKAGE_META).read_text())
    graphs = [folder / g for g in meta["graphs"].values()]
    data = [folder / f"{g}.data" for g in meta["graphs"].values() if (folder / f"{g}.data").is_file()]
    shared = [folder / meta["weights"]["file"]] if "weights" in meta else []  # the decoder graphs' one copy
    return graphs + data + shared + [folder / n for n in PACKAGE_SHIPPED if (folder / n).is_file()]


def torch_variant(label: str, adapter: ModelAdapter, ref: str, source: str, family: str, use_cache: bool,
                  trust_checkpoint: bool = False, device=None) -> Variant:
    """The torch model as a variant; ``device`` (model.device): where its readings run (None: where it is)."""
    import torch

    if use_cache and adapter.cached_decoder() is None:
        raise PipelineError(f"model family {family!r} has no KV-cached decoder")

    def decode(images: np.ndarray, max_length: int, batch_size: int) -> DecodeResult:
        from pipeline.device import placed

        with torch.inference_mode(), placed(device if device is not None else adapter.device, adapter):
            return adapter.generate(torch.from_numpy(images), max_length=max_length, batch_size=batch_size,
                                    use_cache=use_cache)

    files = adapter.source_files()
    size = dir_bytes(files) if files else sum(t.numel() * t.element_size() for t in adapter.model.state_dict().values())
    spec = {"kind": TORCH_KV if use_cache else TORCH, "family": family, "source": source,
            "trust_checkpoint": trust_checkpoint, "layout_run_cap": int(adapter.layout_run_cap)}
    return Variant(label, spec["kind"], ref, size, decode, spec)


def package_variant(label: str, folder: Path, threads: int, speculative: bool = True,
                    flush_denormals: Optional[bool] = None) -> Variant:
    """A package as a variant; ``speculative=False``: plain greedy even at batch 1 where it has a drafter;
    ``flush_denormals`` False: ONNX Runtime's plain sessions, denormals computed (None: the package's own)."""
    package = OnnxPackage(folder, threads=threads, provider="CPUExecutionProvider", speculative=speculative,
                          flush_denormals=flush_denormals)

    def decode(images: np.ndarray, max_length: int, batch_size: int) -> DecodeResult:
        return package.generate(images, max_length=max_length, batch_size=batch_size)

    return Variant(label, PACKAGE, str(folder), dir_bytes(package_files(folder)), decode,
                   {"kind": PACKAGE, "folder": str(folder), "speculative": speculative,
                    "flush_denormals": flush_denormals}, package)


@dataclass
class Lineup:
    """The variants of one benchmark in row order (the shipped torch model first), and the greedy
    twins among them: "<label> (greedy)" -> the speculative package that twin decodes plain greedy."""
    variants: list[Variant]
    twins: dict[str, Variant] = field(default_factory=dict)

    @property
    def shipped(self) -> Variant:
        return self.variants[0]

    @property
    def reference(self) -> Variant:
        """What identical tokens and Δ points compare with: the KV-cached torch model (the full prefix's
        tokens, on more formulas), else the shipped one."""
        second = self.variants[1] if len(self.variants) > 1 else None
        return second if second is not None and second.kind == TORCH_KV else self.shipped

    @property
    def sharing(self) -> dict[str, Variant]:
        """The twins that share their package's batched readings: those whose package decodes a batch of
        several images in plain greedy steps too (not ``speculative_batches``)."""
        return {label: v for label, v in self.twins.items() if not v.package.speculative_batches}

    @property
    def read(self) -> list[Variant]:
        """The variants with a batched reading of their own (a sharing twin has its package's)."""
        return [v for v in self.variants if v.label not in self.sharing]

    @property
    def packages(self) -> list[Variant]:
        """The packages with a batched reading of their own: they read the other splits too."""
        return [v for v in self.read if v.kind == PACKAGE]


def with_greedy_twins(variants: list[Variant], threads: int) -> Lineup:
    """``variants``, then each package that decodes speculatively at batch 1 again as "<label> (greedy)":
    the same package, plain greedy. Where the package decodes batches of more than one image in greedy
    steps too, the twin shares its package's batched readings (:attr:`Lineup.sharing`); where it reads
    them speculatively image by image (``speculative_batches``), the twin reads its own."""
    twins = {f"{v.label} (greedy)": v for v in variants if v.package is not None and v.package.speculative}
    return Lineup(variants + [package_variant(label, Path(v.location), threads, speculative=False)
                              for label, v in twins.items()], twins)


def vocabulary(v: Variant, adapter: ModelAdapter) -> str:
    """What a variant's token ids index: the char vocabulary, distill's BPE or an HF tokenizer, and its
    size (a package says which in ``package.json``; the torch variants run ``adapter``'s model)."""
    from pipeline.tokenization.bpe import BpeTokenizer

    if v.package is not None:
        tok = v.package.tokenizer
        kind = (v.package.meta.get("tokenizer") or {}).get("kind") or ("bpe" if isinstance(tok, BpeTokenizer) else "char")
        size = tok.vocab_size if hasattr(tok, "vocab_size") else len(tok.id_to_token)
    else:
        kind, size = adapter.tokenizer_kind(), adapter.vocab_size
    return f"{kind}, {size} entries"


def layout_run_cap(v: Variant, adapter: ModelAdapter) -> int:
    """The layout-run cap a variant decodes with: a package's own (the one it was exported with)."""
    return v.package.layout_run_cap if v.package is not None else adapter.layout_run_cap


def package_model(folder: Path) -> Optional[str]:
    """The model a package was exported from (its manifest's ``model_ref``), if it says."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return None
    try:
        return json.loads(manifest.read_text()).get("config", {}).get("model_ref")
    except (json.JSONDecodeError, OSError):
        return None


def rebuild(spec: dict[str, Any], threads: int) -> Callable[[np.ndarray, int, int], DecodeResult]:
    """The decode call of a variant from its ``spec``, in a fresh process (see :mod:`.memory`)."""
    if spec["kind"] == PACKAGE:
        return package_variant("", Path(spec["folder"]), threads, bool(spec.get("speculative", True)),
                               spec.get("flush_denormals")).decode
    from pipeline.adapters.base import load_adapter

    adapter = load_adapter(spec["family"], spec["source"], trust_checkpoint=bool(spec["trust_checkpoint"]))
    adapter.layout_run_cap = int(spec.get("layout_run_cap", 0))
    return torch_variant("", adapter, spec["source"], spec["source"], spec["family"],
                         spec["kind"] == TORCH_KV, bool(spec["trust_checkpoint"])).decode
