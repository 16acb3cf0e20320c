"""report.md and tokenizer_comparison.png of the tokenizer stage."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib.pyplot as plt

from pipeline.reports import markdown_table, savefig

PLOT = "tokenizer_comparison.png"
CURVE_PLOT = "tokens_vs_vocab_size.png"


def _token_rows(t: list[dict]) -> list[list[str]]:
    """Token counts, commands split and round trip, one column per tokenizer (``t[0]``: char-level);
    the rows both splits' tables share."""
    def row(label, fn):
        return [label, *(fn(x) for x in t)]
    return [
        row("tokens / formula, mean", lambda x: f"{x['tokens_mean']:.2f}"),
        row("tokens / formula, p95", lambda x: f"{x['tokens_p95']:.1f}"),
        row("fewer tokens than char-level", lambda x: f"{t[0]['tokens_mean'] / x['tokens_mean']:.2f}x"),
        row("LaTeX commands split across tokens",
            lambda x: f"{x['commands_split_share']:.1%} ({x['commands_split']}/{x['commands']})"),
        row("round trip decode(encode(x)) == normalized x", lambda x: f"{x['round_trip_exact']:.1%}"),
    ]


def comparison_rows(m: dict, names: Sequence[str]) -> list[list[str]]:
    """The comparison table: one column per tokenizer, one row per measure."""
    t = [m["tokenizers"][n] for n in names]
    char_steps = t[0]["decode_steps_mean"]
    step_ms = m["decode_step_ms"]

    def row(label, fn):
        return [label, *(fn(x) for x in t)]
    return [
        row("vocabulary size", lambda x: x["vocab_size"]),
        *_token_rows(t),
        row("encode ms / formula, single", lambda x: f"{x['single_ms']:.4f}"),
        row("encode ms / formula, batched", lambda x: f"{x['batched_ms']:.4f}"),
        row("decode steps / formula (tokens + eos)", lambda x: f"{x['decode_steps_mean']:.2f}"),
        row("decode steps saved vs char-level", lambda x: f"{char_steps - x['decode_steps_mean']:.2f}"),
    ] + ([] if step_ms is None else [
        row(f"decoder ms saved / formula at {step_ms:.1f} ms/step",
            lambda x: f"{(char_steps - x['decode_steps_mean']) * step_ms:.0f}"),
    ])


def cache_rows(m: dict) -> list[list[str]]:
    rows = []
    for key in ("normalized", "raw"):
        c = m["cache"][key]
        rows.append([f"{key} formula" + (" (ours)" if key == "normalized" else " string"), c["capacity"],
                     f"{c['hit_rate']:.2%}", f"{c['hits']}/{c['misses']}", c["evictions"],
                     f"{c['ms_per_request']:.4f}", f"{c['ms_per_hit']:.4f}"])
    return rows


def write_report(folder: Path, m: dict, names: Sequence[str], examples: Sequence[tuple[str, list, list]]) -> None:
    _plot(folder / PLOT, m, names)
    if m.get("curve"):
        _curve_plot(folder / CURVE_PLOT, m["curve"], m["vocab_size_configured"])
    r = m["replay"]
    lines = [
        "# Tokenizer: atom-aware BPE vs char-level vs plain BPE",
        "",
        f"Trained on {m['train']['formulas']} formulas ({m['train']['source']}); compared on "
        f"{m['eval']['formulas']} formulas ({m['eval']['source']}). Every tokenizer reads the same "
        "normalized formulas (display-math wrapper stripped, whitespace runs collapsed to one space).",
        "",
        markdown_table(["measure", *names], comparison_rows(m, names)),
        "",
        f"![comparison]({PLOT})",
        "",
        f"Vocabulary of ours: {m['vocab_size']} entries = 4 special tokens + {m['alphabet_atoms']} atoms "
        f"+ {m['command_prefixes']} command prefixes (they only assemble commands) + "
        f"{m['whole_commands']} renderer commands kept whole + {m['learned_merges']} learned merges. "
        f"The plain BPE was trained with the same vocabulary size and minimum pair frequency; it has "
        f"{m['tokenizers'][names[1]]['vocab_size']} entries when no pair is frequent enough to add more. "
        "Decoder step cost: " + ("unknown" if m["decode_step_ms"] is None else f"{m['decode_step_ms']:.1f} ms")
        + f" ({m['decode_step_source']}).",
        "",
    ] + _shift_lines(m, names) + _curve_lines(m) + [
        "## Serving cache",
        "",
        f"Replay: {r['requests']} requests over {r['distinct_formulas']} eval formulas, formula rank k drawn "
        f"with P ~ 1/k^{r['zipf_exponent']} (seed {r['seed']}), each request in one of 4 spellings "
        "(as is, `$..$`, `\\[..\\]`, doubled spaces). Times include the Python call.",
        "",
        markdown_table(["cache key", "capacity", "hit rate", "hits/misses", "evictions", "ms / request",
                        "ms / hit"], cache_rows(m)),
        "",
        "Hit rate by capacity: " + ", ".join(
            f"{c}: {a:.1%} / {b:.1%}" for c, a, b in zip(m["cache_sweep"]["capacities"],
                                                         m["cache_sweep"]["normalized"], m["cache_sweep"]["raw"]))
        + " (normalized key / raw key).",
        "",
        "## Targets",
        "",
        markdown_table(["target", "met"], [[k, "yes" if v else "NO"] for k, v in m["targets"].items()]),
        "",
        "## Examples (eval split)",
        "",
        markdown_table(["formula", "ours", "plain BPE"],
                       [[f"`{t}`", " · ".join(f"`{x}`" for x in a), " · ".join(f"`{x}`" for x in b)]
                        for t, a, b in examples]),
        "",
    ]
    fails = m["tokenizers"][names[-1]]["round_trip_failures"]
    if fails:
        lines += ["## Round-trip failures (ours)", "",
                  markdown_table(["input", "expected", "decoded"],
                                 [[f"`{f['input']}`", f"`{f['expected']}`", f"`{f['decoded']}`"] for f in fails]), ""]
    (folder / "report.md").write_text("\n".join(lines))


def _plot(path: Path, m: dict, names: Sequence[str]) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    t = [m["tokenizers"][n] for n in names]
    x = range(len(names))
    short = [n.split(" (")[0].split(":")[0] for n in names]
    ax1.bar([i - 0.2 for i in x], [v["tokens_mean"] for v in t], width=0.4, label="mean", color="#4477aa")
    ax1.bar([i + 0.2 for i in x], [v["tokens_p95"] for v in t], width=0.4, label="p95", color="#aa7744")
    ax1.set_xticks(list(x), short)
    ax1.set_ylabel("tokens per formula")
    ax1.set_title("Sequence length on the eval formulas")
    ax1.legend()
    caps = m["cache_sweep"]["capacities"]
    ax2.plot(caps, m["cache_sweep"]["normalized"], marker="o", label="key: normalized formula")
    ax2.plot(caps, m["cache_sweep"]["raw"], marker="s", label="key: raw string")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("cache capacity (formulas)")
    ax2.set_ylabel("hit rate")
    ax2.set_ylim(0, 1.02)
    ax2.set_title(f"Zipf replay (s={m['replay']['zipf_exponent']})")
    ax2.legend(loc="lower right")
    savefig(fig, path)


def _shift_lines(m: dict, names: Sequence[str]) -> list[str]:
    sh = m.get("shift")
    if not sh:
        return []
    t = [sh["tokenizers"][n] for n in names]
    return [
        "## On formulas training never saw (shift split)",
        "",
        f"{sh['formulas']} formulas ({sh['source']}): packages the corpus never read, none of their formulas "
        "in the corpus. Never used to train or to choose a default.",
        "",
        markdown_table(["measure", *names], _token_rows(t)),
        "",
    ]


def _curve_lines(m: dict) -> list[str]:
    cv = m.get("curve")
    if not cv:
        return []
    sets = list(cv["char_tokens"])
    header = ["vocab size", "entries", *(f"tokens / formula: {s}" for s in sets),
              *(f"fewer than char-level: {s}" for s in sets)]
    rows = [[r["size"] if r["size"] != cv["chosen_size"] else f"**{r['size']}** (chosen)", r["entries"],
             *(f"{r['tokens'][s]:.2f}" for s in sets), *(f"{r['reduction_vs_char'][s]:.2f}x" for s in sets)]
            for r in cv["rows"]]
    rows.append(["char-level (model today)", "", *(f"{cv['char_tokens'][s]:.2f}" for s in sets), *("1.00x" for _ in sets)])
    skipped = f" Sizes below the atom alphabet, skipped: {cv['skipped_sizes']}." if cv["skipped_sizes"] else ""
    return [
        "## Tokens per formula against vocabulary size",
        "",
        f"The size is chosen on training data alone: fitted on {cv['fit_formulas']} train formulas, counted on "
        f"the {cv['held_out_formulas']} held out; chosen = the smallest size within {cv['tolerance']:.0%} of the "
        f"fewest held-out tokens per formula: **{cv['chosen_size']}** (configured: {m['vocab_size_configured']}). "
        "The other columns check that choice with the tokenizer trained on the whole train split; "
        "'entries' is less than the size where no pair was frequent enough to merge." + skipped,
        "",
        markdown_table(header, rows),
        "",
        f"![tokens per formula against vocabulary size]({CURVE_PLOT})",
        "",
    ]


def _curve_plot(path: Path, cv: dict, configured: int) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = ["#888888", "#4477aa", "#ee6677", "#228833"]
    for i, name in enumerate(cv["char_tokens"]):
        c = colors[i % len(colors)]
        ax.plot([r["size"] for r in cv["rows"]], [r["tokens"][name] for r in cv["rows"]], marker="o", color=c,
                label=name)
        ax.axhline(cv["char_tokens"][name] / 2.5, color=c, linestyle=":", linewidth=1)
    ax.axvline(cv["chosen_size"], color="black", linestyle="--", linewidth=1, label=f"chosen {cv['chosen_size']}")
    if configured != cv["chosen_size"]:
        ax.axvline(configured, color="#aa3377", linestyle="-.", linewidth=1, label=f"configured {configured}")
    ax.set_xlabel("vocabulary size")
    ax.set_ylabel("tokens per formula (mean)")
    ax.set_title("Tokens per formula against vocabulary size (dotted: char-level / 2.5)")
    ax.legend(fontsize=8)
    savefig(fig, path)
