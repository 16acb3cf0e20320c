"""The README's results table from a run's ``summary.json`` (``stage=benchmark`` writes it, with the
machine it ran on): printed, or checked against the README.

    python benchmarks/readme_table.py artifacts/summary.json            # print it
    python benchmarks/readme_table.py docs/results/X.json --check README.md   # exit 1 if the README differs
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.benchmarking.summary import readme_table  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("summary", type=Path, help="a run's summary.json")
    ap.add_argument("--check", type=Path, default=None, help="a Markdown file that must hold the table as printed")
    args = ap.parse_args(argv)
    try:
        table = readme_table(json.loads(args.summary.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {args.summary}: {exc}", file=sys.stderr)
        return 2
    if args.check is None:
        print(table)
        return 0
    if table not in args.check.read_text(encoding="utf-8"):
        print(f"error: {args.check} does not hold the table {args.summary} gives; paste it:\n\n{table}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
