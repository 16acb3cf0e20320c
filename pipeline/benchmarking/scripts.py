"""What the benchmark scripts that read packages on a split's first formulas share (``benchmarks/
encoder_tokens.py``, ``benchmarks/verify_deviation.py``): their command line's common part, the package
lookup with its one error line, and the formulas rendered as a package reads them."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from pipeline.data.render import render_inputs
from pipeline.errors import PipelineError
from pipeline.files import find_package


def split_packages_parser(description: str, n: int, packages_help: str = "package folders (under artifacts, or paths)"
                          ) -> argparse.ArgumentParser:
    """``artifacts packages... [--split S] [--n N]``; a script adds its own options after."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("artifacts", type=Path)
    ap.add_argument("packages", nargs="+", help=packages_help)
    ap.add_argument("--split", default="eval")
    ap.add_argument("--n", type=int, default=n)
    return ap


def find_packages(args: argparse.Namespace) -> Optional[list[Path]]:
    """``args.packages``' folders (:func:`pipeline.files.find_package`), or None after one error line on
    stderr: the script then exits 2."""
    try:
        return [find_package(p, args.artifacts, "packages") for p in args.packages]
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def rendered(formulas: Sequence, preprocess: Callable) -> list[np.ndarray]:
    """The corpus ``formulas`` (``.id``, ``.latex``) rendered and preprocessed as a package reads them, float32."""
    return [np.asarray(x, np.float32) for _, _, x in
            render_inputs([(f.id, f.latex) for f in formulas], preprocess, None, False, "render")]
