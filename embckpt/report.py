"""Storage-cost reports: what each checkpoint wrote, beside what full fp32 checkpoints cost.

The JSON form (``embckpt report DIR --json``) is a contract other tools read::

    {"checkpoints": [{"step", "kind", "bytes", "rows", "parent_step", "base_step", "policy",
                      "full_fp32_bytes", "ratio_vs_full_fp32", "dirty_fraction",
                      "save_seconds"}, ...],
     "totals": {"bytes_written", "storage_held_bytes", "restore_chain_bytes",
                "full_fp32_bytes_written"},
     "leftovers": [step, ...]}

Fields are only ever added, never renamed.
"""

from __future__ import annotations

from typing import Any

from embckpt.storage.fs import CheckpointStore
from embckpt.storage.manifest import Manifest
from embckpt.storage.verify import load_manifests


def build_report(store: CheckpointStore) -> dict[str, Any]:
    """The report of every committed checkpoint in ``store``."""
    manifests, problems = load_manifests(store)
    rows = [_checkpoint_row(m) for _, m in sorted(manifests.items())]
    latest = max(manifests) if manifests else None
    chain_bytes = 0
    current = latest
    while current is not None and current in manifests:
        chain_bytes += manifests[current].total_bytes
        current = manifests[current].parent_step
    return {
        "directory": store.uri,
        "checkpoints": rows,
        "totals": {
            "bytes_written": sum(r["bytes"] for r in rows),
            "storage_held_bytes": sum(r["bytes"] for r in rows),
            "restore_chain_bytes": chain_bytes,
            "full_fp32_bytes_written": sum(r["full_fp32_bytes"] for r in rows),
        },
        "leftovers": store.leftover_steps(),
        "unreadable": [{"path": p, "reason": r} for p, r in problems],
    }


def _checkpoint_row(manifest: Manifest) -> dict[str, Any]:
    full_bytes = int(manifest.stats.get("full_fp32_bytes", 0))
    return {
        "step": manifest.step,
        "kind": manifest.kind,
        "bytes": manifest.total_bytes,
        "rows": manifest.rows_written,
        "parent_step": manifest.parent_step,
        "base_step": manifest.base_step,
        "policy": manifest.policy,
        "full_fp32_bytes": full_bytes,
        "ratio_vs_full_fp32": full_bytes / manifest.total_bytes if manifest.total_bytes else 0.0,
        "dirty_fraction": manifest.stats.get("dirty_fraction"),
        "save_seconds": manifest.stats.get("save_seconds"),
    }


def format_table(report: dict[str, Any]) -> str:
    """A fixed-width text table of :func:`build_report`'s output."""
    lines = [
        f"{'step':>8} {'kind':>5} {'parent':>6} {'rows':>10} {'bytes':>12} "
        f"{'full fp32':>12} {'ratio':>7} {'dirty':>6} {'save s':>7}"
    ]
    for row in report["checkpoints"]:
        parent = "-" if row["parent_step"] is None else str(row["parent_step"])
        dirty = row["dirty_fraction"]
        lines.append(
            f"{row['step']:>8} {row['kind']:>5} {parent:>6} {row['rows']:>10} {row['bytes']:>12,} "
            f"{row['full_fp32_bytes']:>12,} {row['ratio_vs_full_fp32']:>6.2f}x "
            f"{(dirty or 0) * 100:>5.1f}% {row['save_seconds'] or 0:>7.3f}"
        )
    totals = report["totals"]
    saved = totals["full_fp32_bytes_written"] / max(totals["bytes_written"], 1)
    lines.append(
        f"total written {totals['bytes_written']:,} bytes vs {totals['full_fp32_bytes_written']:,} "
        f"for full fp32 checkpoints ({saved:.2f}x less); held {totals['storage_held_bytes']:,}; "
        f"restoring the latest reads {totals['restore_chain_bytes']:,}"
    )
    if report["leftovers"]:
        lines.append(
            f"leftover folders (interrupted saves, not checkpoints): {report['leftovers']}"
        )
    return "\n".join(lines)
