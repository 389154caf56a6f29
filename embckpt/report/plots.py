"""Figures of a storage-cost report, after Check-N-Run's Figures 15 and 16.

One PNG, three panels, each readable without the paper: bytes written per checkpoint interval
(full and diff checkpoints apart, beside a full fp32 checkpoint of the same files: tables,
optimizer state, dense and per-rank files), storage held over time beside
writing a full checkpoint every time, and the compression of each table. Axes switch to a log
scale when the values span more than ``LOG_SPAN`` (x). matplotlib is imported only here, with
the Agg backend, when a figure is drawn.
"""

from __future__ import annotations

import io
import math
from typing import Any

from embckpt.errors import import_extra
from embckpt.report.build import format_bytes

LOG_SPAN = 30.0
MAX_TABLES = 40  # the per-table panel shows the tables that wrote the most bytes
MAX_ANNOTATED = 40  # label bars with their dirty fraction up to this many checkpoints
COLORS = {"full": "#1f5fa8", "diff": "#f28e2b", "fp32": "#555555", "every": "#b0413e"}


def render_png(report: dict[str, Any], dpi: int = 110) -> bytes:
    """The report's figure as PNG bytes; a figure that says so when there is no checkpoint."""
    fig = _figure(report)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    fig.clear()
    return buffer.getvalue()


def _figure(report: dict[str, Any]) -> Any:
    """The matplotlib figure of :func:`render_png`, apart so that tests can read what it drew."""
    matplotlib = import_extra("matplotlib", "plots")
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    rows = report["checkpoints"]
    tables = sorted(report["tables"], key=lambda t: -t["bytes_written"])[:MAX_TABLES]
    if not rows:
        fig = plt.figure(figsize=(8, 2))
        message = "\n".join([f"No committed checkpoint in {report['directory']}", *report["notes"]])
        fig.text(0.5, 0.5, message, ha="center", va="center", wrap=True)
    else:
        table_height = max(2.5, 0.24 * len(tables) + 1.2)
        fig, axes = plt.subplots(
            3,
            1,
            figsize=(11, 9 + table_height),
            gridspec_kw={"height_ratios": [4, 4, table_height]},
            layout="constrained",
        )
        _written_panel(axes[0], rows)
        _held_panel(axes[1], rows, report["totals"])
        _tables_panel(axes[2], tables, len(report["tables"]))
        totals = report["totals"]
        ratio = totals["ratio_vs_full_fp32"] or 0.0
        fig.suptitle(
            f"Checkpoint storage cost of {report['directory']}\n{totals['checkpoints']} "
            f"checkpoints wrote {format_bytes(totals['bytes_written'])}; full fp32 checkpoints "
            f"would have written {format_bytes(totals['full_fp32_bytes_written'])} "
            f"({ratio:.2f}x more)",
            fontsize=12,
        )
    plt.close(fig)  # pyplot forgets it; the caller holds the only reference
    return fig


def _bytes_yaxis(ax: Any, values: list[float]) -> None:
    """Byte units on the y axis; a log scale when the values span orders of magnitude."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) > LOG_SPAN:
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_bytes(v)))
    if ax.get_yscale() == "log":
        ax.set_ylabel(f"{ax.get_ylabel()} (log scale)")


def _written_panel(ax: Any, rows: list[dict[str, Any]]) -> None:
    positions = range(len(rows))
    for kind in ("full", "diff"):
        picked = [(i, r) for i, r in zip(positions, rows, strict=True) if r["kind"] == kind]
        if picked:
            ax.bar(
                [i for i, _ in picked],
                [r["bytes"] for _, r in picked],
                color=COLORS[kind],
                label=f"{kind} checkpoint",
                width=0.8,
            )
    fp32 = [r["full_fp32_bytes"] for r in rows]
    if any(fp32):
        ax.step(
            [-0.5, *positions],
            [fp32[0], *fp32],
            where="post",
            color=COLORS["fp32"],
            linestyle="--",
            label="a full fp32 checkpoint of the same files (the baseline)",
        )
    if len(rows) <= MAX_ANNOTATED:
        for i, row in enumerate(rows):
            if row["kind"] == "diff" and row["dirty_fraction"] is not None:
                ax.annotate(
                    f"{row['dirty_fraction']:.0%}",
                    (i, row["bytes"]),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    xytext=(0, 2),
                    textcoords="offset points",
                )
    ticks = list(positions)[:: math.ceil(len(rows) / 14)]
    ax.set_xticks(ticks, [str(rows[i]["step"]) for i in ticks])
    ax.set_xlim(-0.6, len(rows) - 0.4)
    ax.set_ylabel("bytes written")
    _bytes_yaxis(ax, [r["bytes"] for r in rows] + fp32)
    top = max(fp32 + [r["bytes"] for r in rows])
    ax.set_ylim(top=top * (1.35 if ax.get_yscale() == "linear" else 4))
    ax.set_title(
        "Bytes written per checkpoint interval (above a diff: the share of embedding rows "
        "it wrote)",
        fontsize=11,
    )
    ax.set_xlabel("checkpoint, by training step")
    ax.legend(loc="upper center", ncol=3, fontsize=8, framealpha=0.9)
    ax.grid(axis="y", alpha=0.3)


def _held_panel(ax: Any, rows: list[dict[str, Any]], totals: dict[str, Any]) -> None:
    steps = [r["step"] for r in rows]
    held = [r["cumulative_bytes"] for r in rows]
    fp32, running = [], 0
    for row in rows:
        running += row["full_fp32_bytes"]
        fp32.append(running)
    lines = [("held by this run", held, COLORS["full"], "-")]
    if totals["full_every_time_bytes"] is not None:
        per_full = totals["full_every_time_bytes"] / len(rows)
        every = [per_full * (i + 1) for i in range(len(rows))]
        lines.append(("a full checkpoint every time (same codec)", every, COLORS["every"], ":"))
    if running:
        lines.append(("a full fp32 checkpoint every time", fp32, COLORS["fp32"], "--"))
    # Hold the last level for one more interval, so the latest checkpoint shows as a level.
    gap = steps[-1] - steps[-2] if len(steps) > 1 else 1
    xs = [*steps, steps[-1] + gap]
    for label, values, color, style in lines:
        ax.step(
            xs,
            [*values, values[-1]],
            where="post",
            label=f"{label}: {format_bytes(values[-1])} now",
            color=color,
            linestyle=style,
            lw=2,
        )
    # Log only when the curves end orders of magnitude apart: the comparison is between them,
    # and every cumulative curve spans its checkpoint count anyway.
    ax.set_ylabel("bytes held on storage")
    _bytes_yaxis(ax, [values[-1] for _, values, _, _ in lines])
    if ax.get_yscale() == "linear":
        ax.set_ylim(0, max(values[-1] for _, values, _, _ in lines) * 1.05)
    ax.set_xlim(steps[0], xs[-1])
    ax.set_title(
        "Storage held over time (nothing is deleted yet, so it grows with every checkpoint)",
        fontsize=11,
    )
    ax.set_xlabel("training step")
    ax.legend(loc="upper left", fontsize=8, framealpha=0.9)
    ax.grid(alpha=0.3)


def _tables_panel(ax: Any, tables: list[dict[str, Any]], total: int) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    tables = [t for t in tables if t["ratio_vs_full_fp32"] is not None][::-1]
    ratios = [t["ratio_vs_full_fp32"] for t in tables]
    log_note = ""
    bars = ax.barh(
        [f"{t['name']} ({t['rows']:,} x {t['cols']})" for t in tables],
        ratios,
        color=[COLORS["full"] if r >= 1 else COLORS["every"] for r in ratios],
    )
    ax.bar_label(
        bars, [f"{r:.2f}x" if r < 10 else f"{r:.0f}x" for r in ratios], padding=3, fontsize=7
    )
    ax.axvline(1.0, color="black", lw=1)
    ax.text(1.0, 0.0, " 1x: no saving", transform=ax.get_xaxis_transform(), fontsize=8, va="bottom")
    if ratios and max(ratios) / max(min(ratios), 1e-9) > 10:
        ax.set_xscale("log")
        log_note = " (log scale)"
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlim(min(ratios) / 1.5, max(ratios) * 1.6)
    else:
        ax.set_xlim(0, max([*ratios, 1.0]) * 1.12)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    shown = f"the {len(tables)} that wrote the most, of {total}" if len(tables) < total else "all"
    ax.set_title(
        "Compression per table over all checkpoints: full fp32 bytes / bytes written\n"
        f"(higher is better; tables that wrote the most on top; {shown} tables shown)",
        fontsize=11,
    )
    ax.set_xlabel(
        f"compression vs full fp32 copies of the table and its optimizer state{log_note}\n"
        "(red: below 1x, where row ids and per-file overhead outweigh what diffs save)"
    )
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(axis="x", alpha=0.3)
