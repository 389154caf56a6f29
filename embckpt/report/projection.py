"""What checkpointing a real model would write and hold, projected from a measured run.

``embckpt report DIR --project --model-bytes 2TB --interval 30m --days 30`` scales the ratios
measured in DIR to a model whose full fp32 checkpoint takes MODEL_BYTES. The assumptions, which
:func:`format_projection` prints with every projection:

1. One checkpoint every INTERVAL; a share ``full_share`` of them are full, as measured.
2. A full checkpoint writes ``full_write_ratio`` x MODEL_BYTES, the measured mean of
   bytes / full_fp32_bytes over full checkpoints (1.0 when none was measured).
3. A diff checkpoint writes ``touch_rate`` x ``row_write_ratio`` x MODEL_BYTES: the measured
   mean dirty fraction of diffs (or ``--touch-rate``) times the measured bytes per written row
   relative to fp32 (mean diff bytes / full_fp32_bytes, divided by the mean dirty fraction).
   Each INTERVAL is taken to touch rows like one measured checkpoint interval did.
4. Nothing is deleted, so storage held after DAYS is everything written.
5. Restoring the latest checkpoint reads MODEL_BYTES x the latest measured restore chain's
   bytes / full_fp32_bytes.
6. The measured ratios include the dense part and per-file overhead (``dense_share`` of the
   bytes); in a model whose tables are far larger they weigh less, so the projection errs high.

The ``projection`` object of the JSON report; ``?`` marks a value that may be null::

    model_bytes: int
    interval_seconds: float
    days: float
    checkpoints: int                   checkpoints taken in DAYS
    full_share: float
    full_write_ratio: float
    diff_write_ratio: float            touch_rate x row_write_ratio
    touch_rate: float
    touch_rate_source: str             "measured", "given" or "none measured"
    row_write_ratio: float
    full_checkpoint_bytes: int
    diff_checkpoint_bytes: int
    mean_checkpoint_bytes: int
    mean_write_bytes_per_second: float
    peak_write_bytes_per_second: float a full checkpoint written within one interval
    bytes_written: int
    full_fp32_bytes_written: int       a full fp32 checkpoint every interval
    write_reduction: float?            full_fp32_bytes_written / bytes_written
    storage_held_bytes: int
    restore_chain_bytes: int
    measured_checkpoints: int
    dense_share: float                 share of measured bytes outside table rows files
    assumptions: list[str]
"""

from __future__ import annotations

import argparse
import math
import textwrap
from typing import Any

from embckpt import units
from embckpt.report.build import format_bytes


def parse_size(text: str) -> int:
    """``2TB`` -> 2e12 bytes, as :func:`embckpt.units.parse_size`; an argparse type.

    Raises:
        argparse.ArgumentTypeError: not a size.
    """
    try:
        return units.parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_duration(text: str) -> float:
    """``30m`` -> 1800.0 seconds, as :func:`embckpt.units.parse_duration`; an argparse type.

    Raises:
        argparse.ArgumentTypeError: not a duration, or zero.
    """
    try:
        return units.parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def project(
    report: dict[str, Any],
    model_bytes: int,
    interval_seconds: float,
    days: float,
    touch_rate: float | None = None,
) -> dict[str, Any] | None:
    """Projects write bandwidth and storage for a model of ``model_bytes`` (full fp32).

    Args:
        report: a report from :func:`embckpt.report.build.build_report`.
        model_bytes: the real model's full fp32 checkpoint (tables and optimizer state).
        interval_seconds: time between two checkpoints.
        days: how long training runs.
        touch_rate: the share of rows a diff writes; None takes the measured one.

    Returns:
        The ``projection`` object of this module's docstring; None when nothing was measured.
    """
    measured = [c for c in report["checkpoints"] if c["full_fp32_bytes"] > 0]
    if not measured:
        return None
    fulls = [c["bytes"] / c["full_fp32_bytes"] for c in measured if c["kind"] == "full"]
    diffs = [c for c in measured if c["kind"] != "full"]
    full_ratio = _mean(fulls) if fulls else 1.0
    diff_ratio = _mean([c["bytes"] / c["full_fp32_bytes"] for c in diffs]) if diffs else 0.0
    touches = [c["dirty_fraction"] for c in diffs if c["dirty_fraction"] is not None]
    measured_touch = _mean(touches) if touches else 0.0
    row_ratio = diff_ratio / measured_touch if measured_touch else full_ratio
    source = "measured" if touches else "none measured"
    if touch_rate is not None:
        source, diff_ratio = "given", touch_rate * row_ratio
    touch = touch_rate if touch_rate is not None else measured_touch
    full_share = len(fulls) / len(measured)
    mean_ratio = full_share * full_ratio + (1 - full_share) * diff_ratio

    count = max(0, math.floor(days * 86400 / interval_seconds))
    mean_bytes = model_bytes * mean_ratio
    written = count * mean_bytes
    latest = measured[-1]
    restore_ratio = latest["restore_chain_bytes"] / latest["full_fp32_bytes"]
    result = {
        "model_bytes": model_bytes,
        "interval_seconds": interval_seconds,
        "days": days,
        "checkpoints": count,
        "full_share": full_share,
        "full_write_ratio": full_ratio,
        "diff_write_ratio": diff_ratio,
        "touch_rate": touch,
        "touch_rate_source": source,
        "row_write_ratio": row_ratio,
        "full_checkpoint_bytes": round(model_bytes * full_ratio),
        "diff_checkpoint_bytes": round(model_bytes * diff_ratio),
        "mean_checkpoint_bytes": round(mean_bytes),
        "mean_write_bytes_per_second": mean_bytes / interval_seconds,
        "peak_write_bytes_per_second": model_bytes * full_ratio / interval_seconds,
        "bytes_written": round(written),
        "full_fp32_bytes_written": count * model_bytes,
        "write_reduction": count * model_bytes / written if written else None,
        "storage_held_bytes": round(written),
        "restore_chain_bytes": round(model_bytes * restore_ratio),
        "measured_checkpoints": len(measured),
        "dense_share": 1
        - sum(t["bytes"] for c in measured for t in c["tables"])
        / max(1, sum(c["bytes"] for c in measured)),
    }
    result["assumptions"] = _assumptions(result, len(fulls), len(diffs), restore_ratio)
    return result


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def format_days(days: float) -> str:
    """``1.0`` -> ``1 day``, ``30.0`` -> ``30 days``."""
    return f"{days:g} day" + ("" if days == 1 else "s")


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _assumptions(p: dict[str, Any], fulls: int, diffs: int, restore: float) -> list[str]:
    interval = _duration(p["interval_seconds"])
    touch = {
        "measured": f"{p['touch_rate']:.1%}, the mean dirty fraction of {diffs} measured diffs",
        "given": f"{p['touch_rate']:.1%}, as given",
        "none measured": "0%: no diff checkpoint was measured",
    }[p["touch_rate_source"]]
    return [
        f"the model's full fp32 checkpoint (tables and optimizer state) is "
        f"{format_bytes(p['model_bytes'])}",
        f"one checkpoint every {interval}, {p['checkpoints']:,} in {format_days(p['days'])}; "
        f"{p['full_share']:.0%} of them full, as in the {p['measured_checkpoints']} measured "
        f"({fulls} full, {diffs} diff)",
        f"a full checkpoint writes {p['full_write_ratio']:.3f}x the fp32 size"
        + (" (measured)" if fulls else " (assumed: no full checkpoint measured)"),
        f"a diff writes the rows one {interval} interval touches: {touch}, at "
        f"{p['row_write_ratio']:.3f}x their fp32 size (measured)",
        "every interval touches rows like one measured checkpoint interval did",
        "nothing is deleted: storage held is everything written",
        f"restoring reads {restore:.3f}x the fp32 size, as the latest measured checkpoint did",
        f"{p['dense_share']:.1%} of the measured bytes are dense parameters and per-rank state, "
        "which do not grow with the tables: for a larger model the projection errs high by up "
        "to that share",
    ]


def format_projection(p: dict[str, Any]) -> str:
    """The text form of :func:`project`'s result: assumptions first, then the figures."""
    reduction = p["write_reduction"]
    lines = [
        f"projection for a {format_bytes(p['model_bytes'])} model over {format_days(p['days'])}, "
        "assuming:",
        *(
            textwrap.fill(line, 100, initial_indent="  - ", subsequent_indent="    ")
            for line in p["assumptions"]
        ),
        f"  per checkpoint    full {format_bytes(p['full_checkpoint_bytes'])}, "
        f"diff {format_bytes(p['diff_checkpoint_bytes'])}, "
        f"mean {format_bytes(p['mean_checkpoint_bytes'])}",
        f"  write bandwidth   {format_bytes(p['mean_write_bytes_per_second'])}/s mean, "
        f"{format_bytes(p['peak_write_bytes_per_second'])}/s to write a full within its interval",
        f"  written           {format_bytes(p['bytes_written'])} vs "
        f"{format_bytes(p['full_fp32_bytes_written'])} for a full fp32 checkpoint every interval"
        + (f" ({reduction:.2f}x less)" if reduction else ""),
        f"  storage held      {format_bytes(p['storage_held_bytes'])} at the end (nothing deleted)",
        f"  restore reads     {format_bytes(p['restore_chain_bytes'])}",
    ]
    return "\n".join(lines)
