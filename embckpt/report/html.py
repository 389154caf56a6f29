"""A storage-cost report as one self-contained HTML page.

The page holds the totals, the figure of :mod:`embckpt.report.plots` (a PNG inlined as a base64 data
URI), the checkpoint and table lists and, when the report has one, the projection. Its CSS is
inline and it links to nothing, so it can be mailed or attached to a ticket as it is. It reads on
a phone: each table scrolls sideways inside its own box, so the page itself never does
(``tests/test_report.py`` renders it in headless Chromium at 400 and 1280 px).
"""

from __future__ import annotations

import base64
import html
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from embckpt.report.build import format_bytes
from embckpt.report.projection import format_days

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; padding: 0 .8em; max-width: 1200px;
  color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.8em; }
h1, p { overflow-wrap: anywhere; }
.scroll { overflow-x: auto; margin: .5em 0; }
table { border-collapse: collapse; }
th, td { padding: .2em .7em; border-bottom: 1px solid #ddd; text-align: right;
  white-space: nowrap; }
th { background: #f3f3f3; } .l { text-align: left; } .w { white-space: normal; min-width: 9em; }
tr.full td { background: #eef4fb; }
.note { background: #fff4d6; border-left: 4px solid #e0a800; padding: .4em .8em; margin: .3em 0; }
img { max-width: 100%; height: auto; box-sizing: border-box; border: 1px solid #ddd; }
"""


def render_html(report: dict[str, Any], png: bytes | None) -> str:
    """The page for ``report`` (with its ``projection`` if present) and its figure."""
    totals = report["totals"]
    title = f"Checkpoint storage cost: {report['directory']}"
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>{_e(title)}</title>",
        f"<style>{_CSS}</style></head><body><h1>{_e(title)}</h1>",
        *(f"<p class='note'>{_e(note)}</p>" for note in report["notes"]),
    ]
    if report["checkpoints"]:
        parts.append("<h2>Totals</h2>")
        parts.append(_table(["", "bytes", ""], _total_rows(totals), left=(0, 2), wrap=(0, 2)))
    if png:
        data = base64.b64encode(png).decode()
        parts.append(
            f"<h2>Figures</h2><img alt='storage cost figures' src='data:image/png;base64,{data}'>"
        )
    if report["checkpoints"]:
        parts.append("<h2>Checkpoints</h2>")
        parts.append(_checkpoint_table(report["checkpoints"]))
        parts.append("<h2>Tables, over all checkpoints</h2>")
        parts.append(_tables_table(report["tables"]))
    if report.get("projection"):
        parts.append(_projection(report["projection"]))
    parts.append(
        "<p><small>Written by <code>embckpt report</code>; the JSON form is "
        "<code>embckpt report DIR --json</code>.</small></p></body></html>"
    )
    return "\n".join(parts)


def write_html(report: dict[str, Any], png: bytes | None, path: str | Path) -> int:
    """Writes :func:`render_html` to ``path``; returns the bytes written."""
    data = render_html(report, png).encode()
    Path(path).write_bytes(data)
    return len(data)


def _e(value: object) -> str:
    return html.escape(str(value))


def _table(
    header: Sequence[str],
    rows: Iterable[Sequence[object]],
    left: Sequence[int] = (0,),
    row_class: Sequence[str] | None = None,
    wrap: Sequence[int] = (),
) -> str:
    """A table in its own sideways-scrolling box; cells stay on one line, but ``wrap``'s."""

    def cell(tag: str, i: int, value: object) -> str:
        css = " ".join(name for name, on in (("l", i in left), ("w", i in wrap)) if on)
        return f"<{tag} class='{css}'>{_e(value)}</{tag}>" if css else f"<{tag}>{_e(value)}</{tag}>"

    out = [
        "<div class='scroll'><table><tr>"
        + "".join(cell("th", i, h) for i, h in enumerate(header))
        + "</tr>"
    ]
    for n, row in enumerate(rows):
        css = f" class='{row_class[n]}'" if row_class else ""
        out.append(f"<tr{css}>" + "".join(cell("td", i, v) for i, v in enumerate(row)) + "</tr>")
    out.append("</table></div>")
    return "".join(out)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _total_rows(totals: dict[str, Any]) -> list[list[object]]:
    every = totals["full_every_time_bytes"]
    steps = " → ".join(map(str, totals["restore_chain_steps"]))
    return [
        [
            "written",
            format_bytes(totals["bytes_written"]),
            f"{totals['bytes_written']:,} bytes in {totals['checkpoints']} checkpoints "
            f"({totals['full_checkpoints']} full, {totals['diff_checkpoints']} diff)",
        ],
        [
            "a full fp32 checkpoint every time",
            format_bytes(totals["full_fp32_bytes_written"]),
            f"{_ratio(totals['ratio_vs_full_fp32'])} more than was written",
        ],
        [
            "held now",
            format_bytes(totals["storage_held_bytes"]),
            "committed checkpoints' files on disk (nothing is deleted yet)",
        ],
        [
            "a full checkpoint (same codec) every time",
            "-" if every is None else format_bytes(every),
            "committed checkpoints x the mean full checkpoint",
        ],
        [
            "restoring the latest reads",
            format_bytes(totals["restore_chain_bytes"]),
            f"steps {steps}" + ("" if totals["restore_chain_complete"] else " (INCOMPLETE)"),
        ],
        ["leftovers of interrupted saves", format_bytes(totals["leftover_bytes"]), "not counted"],
    ]


def _checkpoint_table(rows: list[dict[str, Any]]) -> str:
    header = [
        "step",
        "kind",
        "parent",
        "rows",
        "bytes",
        "vs full fp32",
        "dirty",
        "save s",
        "codec",
        "decision",
    ]
    body = [
        [
            r["step"],
            r["kind"],
            "-" if r["parent_step"] is None else r["parent_step"],
            f"{r['rows']:,}",
            format_bytes(r["bytes"]),
            _ratio(r["ratio_vs_full_fp32"]),
            "-" if r["dirty_fraction"] is None else f"{r['dirty_fraction']:.1%}",
            f"{r['save_seconds'] or 0:.3f}",
            r["codec"],
            r["reason"] or "-",
        ]
        for r in rows
    ]
    return _table(header, body, left=(1, 8, 9), row_class=[r["kind"] for r in rows])


def _tables_table(tables: list[dict[str, Any]]) -> str:
    header = [
        "table",
        "rows x cols",
        "sharding",
        "rows written",
        "bytes",
        "vs full fp32",
        "mean diff touch",
    ]
    body = [
        [
            t["name"],
            f"{t['rows']:,} x {t['cols']}",
            t["sharding_type"],
            f"{t['rows_written']:,}",
            format_bytes(t["bytes_written"]),
            _ratio(t["ratio_vs_full_fp32"]),
            "-"
            if t["mean_diff_touched_fraction"] is None
            else f"{t['mean_diff_touched_fraction']:.1%}",
        ]
        for t in sorted(tables, key=lambda t: -t["bytes_written"])
    ]
    return _table(header, body, left=(0, 2))


def _projection(p: dict[str, Any]) -> str:
    assumptions = "".join(f"<li>{_e(a)}</li>" for a in p["assumptions"])
    rows = [
        ["full checkpoint", format_bytes(p["full_checkpoint_bytes"])],
        ["diff checkpoint", format_bytes(p["diff_checkpoint_bytes"])],
        ["mean write bandwidth", format_bytes(p["mean_write_bytes_per_second"]) + "/s"],
        [
            "peak write bandwidth (a full within one interval)",
            format_bytes(p["peak_write_bytes_per_second"]) + "/s",
        ],
        ["written", format_bytes(p["bytes_written"])],
        ["a full fp32 checkpoint every interval", format_bytes(p["full_fp32_bytes_written"])],
        ["storage held at the end", format_bytes(p["storage_held_bytes"])],
        ["restoring the latest reads", format_bytes(p["restore_chain_bytes"])],
    ]
    return (
        f"<h2>Projection: a {_e(format_bytes(p['model_bytes']))} model over "
        f"{format_days(p['days'])}</h2>"
        f"<p>Assumptions:</p><ul>{assumptions}</ul>{_table(['', 'projected'], rows, wrap=(0,))}"
    )
