"""The calibration set's report: its metrics, a contact sheet of its images, the bucket-share plot
and ``report.md``."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from calibration import sets
from pipeline.reports import markdown_table, savefig


def set_metrics(scan: sets.SourceScan, chosen: list[sets.Candidate], seed: int, input_shape, tensor_column: str,
                max_share_distance: float, timings_s: dict) -> dict:
    """Coverage of the source's buckets by the chosen set, what was skipped and removed, and the wall
    seconds of each phase (kept out of report.md, which stays byte-identical between runs)."""
    metrics = sets.coverage_report(scan, chosen)
    metrics.update({
        "source": scan.description, "source_items": scan.total, "usable": len(scan.candidates),
        "skipped": len(scan.skipped), "skipped_items": scan.skipped,
        "duplicates": len(scan.duplicates), "duplicate_items": scan.duplicates,
        "size": len(chosen), "seed": seed, "input_shape": list(input_shape),
        "tensor_column": tensor_column, "max_share_distance": max_share_distance,
        "share_tv_bound": round(sets.tv_bound(metrics["nonempty_source_buckets"], len(chosen)), 6),
    })
    metrics["within_share_distance"] = metrics["share_tv_distance"] <= max_share_distance
    metrics["timings_s"] = timings_s
    return metrics


def contact_sheet(path: Path, chosen: list[sets.Candidate], tensors: list[np.ndarray], count: int) -> None:
    """The first ``count`` images of the set (a seeded random sample), half scale, captioned."""
    k = min(count, len(tensors))
    if k == 0:
        return
    _, h, w = tensors[0].shape
    tw, th, caption, cols = w // 2, h // 2, 14, 3
    rows = -(-k // cols)
    sheet = Image.new("L", (cols * (tw + 4) + 4, rows * (th + caption + 4) + 4), 200)
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default()
    for i in range(k):
        canvas = Image.fromarray(np.round(tensors[i][0] * 255).astype(np.uint8)).resize((tw, th), Image.BOX)
        x, y = 4 + (i % cols) * (tw + 4), 4 + (i // cols) * (th + caption + 4)
        sheet.paste(canvas, (x, y))
        draw.text((x, y + th + 1), f"{chosen[i].source_id[:14]}  {chosen[i].bucket}"[:48], fill=0, font=font)
    sheet.save(path, format="PNG")


def bucket_plot(path: Path, m: dict) -> None:
    import matplotlib.pyplot as plt

    buckets = m["buckets"]
    n_src = sum(b["source"] for b in buckets.values())
    n_set = max(1, sum(b["set"] for b in buckets.values()))
    order = sorted(buckets, key=lambda k: (-buckets[k]["source"], k))
    axes = list(m["marginals"])
    fig, (top, *bottom) = plt.subplots(1 + len(axes), 1, figsize=(10, 3 + 2.2 * len(axes)),
                                       gridspec_kw={"height_ratios": [1.4] + [1] * len(axes)})
    x = np.arange(len(order))
    top.bar(x - 0.2, [buckets[k]["source"] / n_src for k in order], 0.4, label=f"source (n={n_src})", color="#bbbbbb")
    top.bar(x + 0.2, [buckets[k]["set"] / n_set for k in order], 0.4, label=f"set (n={n_set})", color="#4477aa")
    top.set_title(f"Joint buckets, by source share: coverage {m['covered_buckets']}/{m['nonempty_source_buckets']}"
                  f" = {m['coverage']:.1%}, TV distance {m['share_tv_distance']:.3f}")
    top.set_xlabel("bucket (rank by source count)")
    top.set_ylabel("share")
    top.legend(fontsize=8)
    for ax, axis in zip(bottom, axes):
        marg = m["marginals"][axis]
        labels = sorted(marg["source"], key=_bin_order)
        xi = np.arange(len(labels))
        ax.bar(xi - 0.2, [marg["source"][k] / n_src for k in labels], 0.4, color="#bbbbbb")
        ax.bar(xi + 0.2, [marg["set"].get(k, 0) / n_set for k in labels], 0.4, color="#4477aa")
        ax.set_xticks(xi, labels, fontsize=8)
        ax.set_ylabel("share")
        ax.set_title(f"{axis} (TV {marg['tv_distance']:.3f})", fontsize=9)
    savefig(fig, path)


def _bin_order(label: str) -> tuple:
    """Sort 'W64-127' after 'W0-63' (numerically), named bins alphabetically after."""
    digits = "".join(ch if ch.isdigit() or ch == "." else " " for ch in label).split()
    return (0, float(digits[0]), label) if digits else (1, 0.0, label)


def write_report(path: Path, m: dict) -> None:
    summary = markdown_table(["", "value"], [
        ["source", m["source"]], ["items offered", m["source_items"]], ["skipped", m["skipped"]],
        ["duplicates removed", m["duplicates"]], ["usable (unique)", m["usable"]],
        ["set size", m["size"]], ["seed", m["seed"]], ["bucket scheme", m["scheme"]],
        ["non-empty source buckets", m["nonempty_source_buckets"]],
        ["covered by the set", f"{m['covered_buckets']} ({m['coverage']:.1%})"],
        ["bucket share distance (total variation)",
         f"{m['share_tv_distance']:.3f} (stated limit {m['max_share_distance']}, guaranteed <= {m['share_tv_bound']:.3f})"],
        ["largest share difference of one bucket", f"{m['share_max_abs_diff']:.4f}"],
    ])
    marg = markdown_table(["axis", "bins", "TV distance"],
                          [[a, len(v["source"]), f"{v['tv_distance']:.3f}"] for a, v in m["marginals"].items()])
    skipped = "\n".join(f"- `{n}`: {why}" for n, why in list(m["skipped_items"].items())[:50]) or "none"
    path.write_text(
        "# Calibration set\n\n" + summary + "\n\n## Per-axis shares\n\n" + marg +
        "\n\n![bucket shares](buckets.png)\n\n## Sample\n\n![contact sheet](contact_sheet.png)\n\n"
        "## Skipped\n\n" + skipped + "\n")
