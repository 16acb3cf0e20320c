"""Markdown tables and PNG plots for stage reports (matplotlib, Agg backend, deterministic)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# No timestamps or software versions in PNG metadata: same data, same bytes.
_PNG_META = {"Software": None}


class Phases:
    """Where a stage's minutes go: ``lap(name)`` adds the seconds since the last lap to ``name``."""

    def __init__(self) -> None:
        import time

        self._now = time.perf_counter
        self._last = self._now()
        self.seconds: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = self._now()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + now - self._last, 1)
        self._last = now

    def line(self) -> str:
        return ", ".join(f"{k} {v:.0f} s" for k, v in self.seconds.items())


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(cell, r)) + " |" for r in rows]
    return "\n".join(lines)


def savefig(fig: "plt.Figure", path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata=_PNG_META)
    plt.close(fig)


def grouped_bar_plot(path: Path, labels: Sequence[str], series: dict[str, Sequence[float]], title: str,
                     ylabel: str, annotations: dict[str, Sequence[Any]] | None = None) -> None:
    """Bars of several series (e.g. eval splits) side by side per label; one series is a plain bar plot."""
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    width = 0.8 / max(len(series), 1)
    colors = ["#4477aa", "#ee6677", "#228833", "#ccbb44"]
    top = 0.0
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        bars = ax.bar(xs, list(values), width=width, color=colors[i % len(colors)], label=name)
        top = max(top, max(values, default=0))
        for b, a in zip(bars, (annotations or {}).get(name, [])):
            ax.annotate(f"n={a}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(labels)), list(labels))
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, max(1.0, top * 1.15))
    if len(series) > 1:
        ax.legend(fontsize=8)
    savefig(fig, path)
