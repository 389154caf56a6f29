"""Storage-cost reports of a checkpoint directory: what each checkpoint cost and saved.

``build_report`` reads the manifests (no torch needed) into a JSON-able dict; ``format_table``
prints it, ``render_png`` plots it, ``write_html`` makes a self-contained page of both, and
``project`` extrapolates the costs to a longer run.
"""

from embckpt.report.build import build_report, format_bytes, format_table
from embckpt.report.html import write_html
from embckpt.report.plots import render_png
from embckpt.report.projection import format_projection, project

__all__ = [
    "build_report",
    "format_bytes",
    "format_table",
    "format_projection",
    "project",
    "render_png",
    "write_html",
]
