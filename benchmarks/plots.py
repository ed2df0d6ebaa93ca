"""PNG charts for docs/perf/ (matplotlib, the ``bench`` extra): TTFT per engine, growth curves.

Each function draws from one run's rows and returns the file names it wrote ([] when matplotlib
is missing or the run has no rows for it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.answer import MODELS, ttft_series
from benchmarks.common import Row
from benchmarks.growth import PREFILL_SPEEDS
from benchmarks.ttft import KINDS

STYLE = {  # kind: (colour, line style, marker)
    "uncached": ("0.45", "--", "x"),
    "cold": ("tab:red", "-", "o"),
    "warm": ("tab:green", "-", "o"),
    "worker": ("tab:blue", "-", "s"),
    "restart": ("tab:purple", "-", "^"),
}


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    return plt


def ttft(rows: list[Row], folder: Path) -> list[str]:
    """ttft.png: time to first token vs prompt length, one panel per engine and model."""
    plt = _pyplot()
    series = ttft_series(rows)
    if plt is None or not series:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(series), figsize=(4.2 * len(series), 3.8), squeeze=False)
    for ax, ((engine, family), by_length) in zip(axes[0], series.items(), strict=True):
        for kind, label in KINDS.items():
            pts = sorted((n, t[kind] * 1e3) for n, t in by_length.items() if kind in t)
            if pts:
                colour, style, marker = STYLE[kind]
                ax.plot(*zip(*pts, strict=True), style, color=colour, marker=marker, label=label)
        ax.set(
            xscale="log", yscale="log", xlabel="prompt tokens", ylabel="time to first token (ms)"
        )
        ax.set_title(f"{engine}\n({MODELS.get(family, family)}, file://)", fontsize=9)
        ax.set_xticks(sorted(by_length), [f"{n:,}" for n in sorted(by_length)])
        ax.set_xticks([], minor=True)  # only the measured lengths on the log axis
        ax.grid(True, alpha=0.3, which="both")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "ttft.png", dpi=110)
    plt.close(fig)
    return ["ttft.png"]


def growth(rows: list[Row], folder: Path) -> list[str]:
    """lookup_growth.png (lookup vs blocks) and restore_growth.png (restore vs tokens, with the
    time to recompute the prefix at each published prefill speed it is compared with)."""
    plt = _pyplot()
    g = [r for r in rows if r.section == "growth"]
    if plt is None or not g:
        return []
    folder.mkdir(parents=True, exist_ok=True)
    made = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r.name for r in g if "lookup" in r.name):
        pts = sorted((r.extra["blocks"], r.stats.median * 1e3) for r in g if r.name == name)
        ax.plot(*zip(*pts, strict=True), marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="blocks stored", ylabel="lookup (ms)")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(folder / "lookup_growth.png", dpi=110)
    plt.close(fig)
    made.append("lookup_growth.png")
    restores = [r for r in g if r.name.startswith("restore") and r.stats is not None]
    if not restores:
        return made
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for name in dict.fromkeys(r.name for r in restores):
        pts = sorted((r.tokens, r.stats.median * 1e3) for r in restores if r.name == name)
        ax.plot(*zip(*pts, strict=True), marker="o", label=name.replace("restore ", ""))
    lengths = sorted({r.tokens or 0 for r in restores})
    for (label, (speed, _)), grey in zip(
        PREFILL_SPEEDS.items(), ("0.1", "0.35", "0.6"), strict=False
    ):
        ys = [n / speed * 1e3 for n in lengths]
        ax.plot(
            lengths, ys, "--", color=grey, lw=2, label=f"recompute: {label} ({speed:,.0f} tok/s)"
        )
    ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="restore or recompute (ms)")
    ax.legend(fontsize=6, ncol=2)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(folder / "restore_growth.png", dpi=110)
    plt.close(fig)
    made.append("restore_growth.png")
    return made
