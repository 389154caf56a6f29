"""Storage-cost reports: what each checkpoint wrote, beside what full fp32 checkpoints cost.

:func:`build_report` reads every committed manifest of a checkpoint directory (local path or any
``pyarrow.fs`` URI) and lists each step folder once, so the totals are the bytes on disk now.
It never fails on an empty, missing or half-written directory: ``notes`` says what it found.
:func:`format_table` renders the text form; ``embckpt.report.plots``, ``embckpt.report.html`` and
``embckpt.report.projection`` render figures, the HTML page and the projection from the same dict.

Definitions (each a measurement of what is on disk now, not of what was ever written):

- bytes: the bytes of the files a checkpoint's manifest lists (the manifest itself excluded).
- full fp32 (of a checkpoint): what a full fp32 checkpoint of the job would write in its place:
  one uncompressed fp32 copy of every table and its optimizer state (``stats.full_fp32_bytes``)
  plus the checkpoint's dense and per-rank files (``side_bytes``: dense modules, dense optimizer,
  RNG, statefuls), which every checkpoint writes whole. So the baseline counts every file that
  bytes counts. ``ratio_vs_full_fp32`` is full fp32 / bytes, so higher is better. Per table,
  full fp32 is the table and its optimizer state alone (its bytes are its rows files).
- storage held: the listed files of committed checkpoints found on disk now. Nothing is deleted
  yet, so it equals bytes written; once retention deletes checkpoints, held over time (the
  ``cumulative_bytes`` of each checkpoint) is rebuilt from the survivors only and undercounts.
- full every time: what storage would hold had every committed checkpoint been a full one of the
  same codec: their number x the mean bytes of the committed full checkpoints.
- per table: rows files only; a row of a column-wise table counts once, not once per shard.

The JSON form (``embckpt report DIR --json``) is a contract other tools read. Fields are only
ever added, never renamed; ``?`` marks a value that may be null; tests check this list::

    report_version: int
    directory: str
    notes: list[str]                   what a reader should know: empty, missing, leftovers
    checkpoints[]:                     one per committed checkpoint, ascending step
        step: int
        kind: str                      "full" or "diff"
        bytes: int
        rows: int                      rows stored (a column-wise row once per shard)
        parent_step: int?
        base_step: int
        policy: str
        full_fp32_bytes: int           tables and optimizer state in fp32 + side_bytes
        side_bytes: int                the dense and per-rank files (roles dense and rank)
        ratio_vs_full_fp32: float      0.0 when bytes is 0
        dirty_fraction: float?
        save_seconds: float?
        reason: str?                   the policy's decision, in words
        codec: str                     codec id
        created_unix: float?
        files: int
        bytes_on_disk: int             sizes of the listed files found on disk now
        cumulative_bytes: int          bytes_on_disk of this and every earlier checkpoint
        restore_chain_bytes: int       what restoring this checkpoint reads
        tables[]:                      the table rows this checkpoint wrote
            name: str
            rows: int
            bytes: int
            touched_fraction: float    rows / table rows
    tables[]:                          one per table of the latest checkpoint
        name: str
        rows: int
        cols: int
        dtype: str
        sharding_type: str
        full_fp32_bytes: int           one fp32 copy of the table and its optimizer state
        checkpoints: int               checkpoints that hold the table
        rows_written: int
        bytes_written: int
        full_fp32_bytes_written: int   checkpoints x full_fp32_bytes
        ratio_vs_full_fp32: float?     null when nothing was written
        mean_diff_touched_fraction: float?  null without diff checkpoints
    totals:
        checkpoints: int
        full_checkpoints: int
        diff_checkpoints: int
        bytes_written: int
        storage_held_bytes: int
        restore_chain_bytes: int
        restore_chain_steps: list[int]
        restore_chain_complete: bool
        full_fp32_bytes_written: int
        ratio_vs_full_fp32: float?
        full_every_time_bytes: int?    null without a committed full checkpoint
        save_seconds: float
        leftover_bytes: int
    leftovers: list[int]               step folders without a manifest: interrupted saves
    unreadable[]:                      manifests that do not parse
        path: str
        reason: str
    projection: object?                only with --project: see embckpt.report.projection
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import pyarrow.fs as pafs

from embckpt.errors import CheckpointCorruptError
from embckpt.storage.chain import chain_steps, read_manifest
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.manifest import Manifest, TableEntry

REPORT_VERSION = 1
PROGRESS_MIN_STEPS = 200  # show progress without a TTY only for scans this long
TEXT_MAX_TABLES = 30


def build_report(store: CheckpointStore, *, progress: bool | None = None) -> dict[str, Any]:
    """The report of every committed checkpoint in ``store``.

    Args:
        store: the checkpoint directory.
        progress: show a progress line on stderr; None shows it when stderr is a terminal or
            the directory holds at least ``PROGRESS_MIN_STEPS`` step folders.

    Returns:
        The report dict described in this module's docstring.
    """
    committed, leftovers = store.committed_steps(), store.leftover_steps()
    manifests: dict[int, Manifest] = {}
    unreadable: list[dict[str, str]] = []
    on_disk: dict[int, dict[str, int]] = {}
    for step in _progress(committed, len(committed) + len(leftovers), progress):
        try:
            manifests[step] = read_manifest(store, step)
        except CheckpointCorruptError as exc:
            unreadable.append({"path": exc.path, "reason": exc.reason})
            continue
        on_disk[step] = _list_sizes(store, step)
    leftover_bytes = sum(sum(_list_sizes(store, s).values()) for s in leftovers)

    writes = {step: _table_writes(m) for step, m in manifests.items()}
    rows: list[dict[str, Any]] = []
    restore: dict[int, int] = {}
    cumulative = 0
    for step, manifest in sorted(manifests.items()):
        row = _checkpoint_row(manifest, on_disk[step], writes[step])
        cumulative += row["bytes_on_disk"]
        parent = manifest.parent_step
        restore[step] = row["bytes"] + (restore.get(parent, 0) if parent is not None else 0)
        rows.append({**row, "cumulative_bytes": cumulative, "restore_chain_bytes": restore[step]})

    chain = chain_steps(manifests, max(manifests)) if manifests else []
    fulls = [r["bytes"] for r in rows if r["kind"] == "full"]
    written = sum(r["bytes"] for r in rows)
    fp32 = sum(r["full_fp32_bytes"] for r in rows)
    return {
        "report_version": REPORT_VERSION,
        "directory": store.uri,
        "notes": _notes(store, rows, leftovers, leftover_bytes, unreadable, chain, manifests),
        "checkpoints": rows,
        "tables": _table_rows(manifests, writes),
        "totals": {
            "checkpoints": len(rows),
            "full_checkpoints": len(fulls),
            "diff_checkpoints": len(rows) - len(fulls),
            "bytes_written": written,
            "storage_held_bytes": cumulative,
            "restore_chain_bytes": sum(manifests[s].total_bytes for s in chain),
            "restore_chain_steps": chain,
            "restore_chain_complete": bool(chain) and manifests[chain[0]].parent_step is None,
            "full_fp32_bytes_written": fp32,
            "ratio_vs_full_fp32": fp32 / written if written else None,
            "full_every_time_bytes": round(len(rows) * sum(fulls) / len(fulls)) if fulls else None,
            "save_seconds": sum(r["save_seconds"] or 0.0 for r in rows),
            "leftover_bytes": leftover_bytes,
        },
        "leftovers": leftovers,
        "unreadable": unreadable,
    }


def _progress(steps: list[int], folders: int, wanted: bool | None) -> Iterable[int]:
    if wanted is None:
        wanted = folders >= PROGRESS_MIN_STEPS or (folders > 1 and sys.stderr.isatty())
    if not wanted:
        return steps
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    return tqdm(
        steps, desc="reading manifests", unit="ckpt", leave=False, mininterval=0.2 if tty else 10
    )


def _list_sizes(store: CheckpointStore, step: int) -> dict[str, int]:
    """Sizes of the files under a step folder, by path relative to it; one listing call."""
    base = store.step_path(step)
    selector = pafs.FileSelector(base, recursive=True, allow_not_found=True)
    return {
        info.path[len(base) + 1 :]: info.size or 0
        for info in store.fs.get_file_info(selector)
        if info.type == pafs.FileType.File
    }


def _checkpoint_row(
    manifest: Manifest, sizes: dict[str, int], writes: dict[str, tuple[int, int]]
) -> dict[str, Any]:
    side = sum(f.bytes for f in manifest.files if f.role != "rows")
    tables_fp32 = int(manifest.stats.get("full_fp32_bytes", 0))
    full_bytes = tables_fp32 + side if tables_fp32 else 0  # no baseline without the tables'
    tables = {t.name: t for t in manifest.tables}
    return {
        "step": manifest.step,
        "kind": manifest.kind,
        "bytes": manifest.total_bytes,
        "rows": manifest.rows_written,
        "parent_step": manifest.parent_step,
        "base_step": manifest.base_step,
        "policy": manifest.policy,
        "full_fp32_bytes": full_bytes,
        "side_bytes": side,
        "ratio_vs_full_fp32": full_bytes / manifest.total_bytes if manifest.total_bytes else 0.0,
        "dirty_fraction": manifest.stats.get("dirty_fraction"),
        "save_seconds": manifest.stats.get("save_seconds"),
        "reason": manifest.stats.get("reason"),
        "codec": _codec_label(manifest.codec),
        "created_unix": manifest.stats.get("created_unix"),
        "files": manifest.file_count,
        "bytes_on_disk": sum(sizes.get(path, 0) for path in {f.path for f in manifest.files}),
        "tables": [
            {
                "name": name,
                "rows": rows,
                "bytes": size,
                "touched_fraction": rows / tables[name].rows if name in tables else 0.0,
            }
            for name, (rows, size) in sorted(writes.items())
        ],
    }


def _table_writes(manifest: Manifest) -> dict[str, tuple[int, int]]:
    """(rows, bytes) of each table's rows files; a column-wise row counts once, not per shard.

    A block of a packed file counts its own row groups and their share of the file's footer
    (``FileEntry.own_bytes``); a table's figure is rounded to whole bytes."""
    tables = {t.name: t for t in manifest.tables}
    rows: dict[str, float] = {}
    sizes: dict[str, float] = {}
    for f in manifest.files:
        if f.role != "rows":
            continue
        cols = tables[f.table].cols if f.table in tables else 0
        share = f.shard_cols / cols if cols and f.shard_cols else 1.0
        rows[f.table] = rows.get(f.table, 0.0) + f.rows * share
        sizes[f.table] = sizes.get(f.table, 0.0) + f.own_bytes
    return {name: (round(rows[name]), round(sizes[name])) for name in rows}


def table_fp32_bytes(table: TableEntry) -> int:
    """One fp32 copy of a table and its optimizer state, as the manifest describes them."""
    per_row = len(table.row_states)
    total = sum(
        rows * (cols * (1 + len(table.elem_states)) + per_row)
        for _, _, _, rows, cols in table.shards
    )
    return 4 * (total or table.rows * (table.cols * (1 + len(table.elem_states)) + per_row))


def _table_rows(
    manifests: dict[int, Manifest], writes: dict[int, dict[str, tuple[int, int]]]
) -> list[dict[str, Any]]:
    if not manifests:
        return []
    latest = manifests[max(manifests)]
    names = {step: {t.name for t in m.tables} for step, m in manifests.items()}
    out = []
    for table in sorted(latest.tables, key=lambda t: t.name):
        held = [step for step in manifests if table.name in names[step]]
        per_step = [(manifests[s].kind, writes[s].get(table.name, (0, 0))) for s in held]
        diff_touch = [rows / table.rows for kind, (rows, _) in per_step if kind == "diff"]
        written = sum(size for _, (_, size) in per_step)
        fp32 = table_fp32_bytes(table)
        out.append(
            {
                "name": table.name,
                "rows": table.rows,
                "cols": table.cols,
                "dtype": table.dtype,
                "sharding_type": table.sharding_type,
                "full_fp32_bytes": fp32,
                "checkpoints": len(held),
                "rows_written": sum(rows for _, (rows, _) in per_step),
                "bytes_written": written,
                "full_fp32_bytes_written": fp32 * len(held),
                "ratio_vs_full_fp32": fp32 * len(held) / written if written else None,
                "mean_diff_touched_fraction": (
                    sum(diff_touch) / len(diff_touch) if diff_touch else None
                ),
            }
        )
    return out


def _notes(
    store: CheckpointStore,
    rows: list[dict[str, Any]],
    leftovers: list[int],
    leftover_bytes: int,
    unreadable: list[dict[str, str]],
    chain: list[int],
    manifests: dict[int, Manifest],
) -> list[str]:
    notes = []
    if store.fs.get_file_info(store.root).type == pafs.FileType.NotFound:
        notes.append(f"{store.uri} does not exist: no checkpoint was ever saved there")
    elif not rows:
        notes.append(f"{store.uri} holds no committed checkpoint")
    if leftovers:
        notes.append(
            f"{len(leftovers)} step folder(s) without a manifest {leftovers}, "
            f"{format_bytes(leftover_bytes)}: interrupted saves, not checkpoints, not counted"
        )
    if unreadable:
        notes.append(f"{len(unreadable)} manifest(s) do not parse and are not counted")
    missing = [r["step"] for r in rows if r["bytes_on_disk"] != r["bytes"]]
    if missing:
        notes.append(f"steps {missing}: files on disk differ from the manifest (embckpt verify)")
    if chain and manifests[chain[0]].parent_step is not None:
        notes.append(
            f"the latest checkpoint's chain is broken: step {manifests[chain[0]].parent_step} "
            "is missing, so it cannot be restored"
        )
    return notes


# -- text -----------------------------------------------------------------------------------------
def format_bytes(value: float) -> str:
    """``1234567`` -> ``1.23 MB`` (decimal units, as disks and object stores bill)."""
    units = ("B", "kB", "MB", "GB", "TB", "PB")
    power = 0
    while abs(value) >= 999.5 and power < len(units) - 1:
        value /= 1000
        power += 1
    if power == 0:
        return f"{value:.0f} B"
    digits = 2 if abs(value) < 9.995 else 1 if abs(value) < 99.95 else 0
    return f"{value:.{digits}f} {units[power]}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def format_table(report: dict[str, Any]) -> str:
    """The text form of :func:`build_report`'s output: checkpoints, tables, totals, notes."""
    return "\n".join(_text_lines(report))


def _text_lines(report: dict[str, Any]) -> Iterator[str]:
    rows, totals = report["checkpoints"], report["totals"]
    yield (
        f"embckpt report {report['directory']}: {totals['checkpoints']} checkpoints "
        f"({totals['full_checkpoints']} full, {totals['diff_checkpoints']} diff)"
    )
    for note in report["notes"]:
        yield f"note: {note}"
    if not rows:
        return
    yield ""
    yield (
        f"{'step':>8} {'kind':>4} {'parent':>6} {'rows':>9} {'bytes':>9} {'vs fp32':>7} "
        f"{'dirty':>6} {'save s':>7} {'codec':<8} decision"
    )
    for row in rows:
        parent = "-" if row["parent_step"] is None else str(row["parent_step"])
        yield (
            f"{row['step']:>8} {row['kind']:>4} {parent:>6} {row['rows']:>9,} "
            f"{format_bytes(row['bytes']):>9} {_ratio(row['ratio_vs_full_fp32']):>7} "
            f"{_pct(row['dirty_fraction']):>6} {row['save_seconds'] or 0:>7.3f} "
            f"{row['codec']:<8} {row['reason'] or '-'}"
        )
    tables = sorted(report["tables"], key=lambda t: -t["bytes_written"])
    yield ""
    yield (
        f"per table, over all checkpoints{' (largest first)' if len(tables) > 1 else ''}:"
        f"\n{'table':<16} {'rows x cols':>12} {'sharding':<15} {'rows written':>12} {'bytes':>9} "
        f"{'vs fp32':>7} {'diff touch':>10}"
    )
    for table in tables[:TEXT_MAX_TABLES]:
        yield (
            f"{table['name']:<16} {str(table['rows']) + ' x ' + str(table['cols']):>12} "
            f"{table['sharding_type']:<15} {table['rows_written']:>12,} "
            f"{format_bytes(table['bytes_written']):>9} {_ratio(table['ratio_vs_full_fp32']):>7} "
            f"{_pct(table['mean_diff_touched_fraction']):>10}"
        )
    if len(tables) > TEXT_MAX_TABLES:
        yield f"... {len(tables) - TEXT_MAX_TABLES} smaller tables (see --json)"
    yield ""
    yield from _total_lines(totals)


def _total_lines(totals: dict[str, Any]) -> Iterator[str]:
    written, fp32 = totals["bytes_written"], totals["full_fp32_bytes_written"]
    yield (
        f"written    {format_bytes(written)} ({written:,} bytes) in {totals['checkpoints']} "
        f"checkpoints, {totals['save_seconds']:.2f} s spent saving"
    )
    yield (
        f"           vs {format_bytes(fp32)} for a full fp32 checkpoint every time: "
        f"{_ratio(totals['ratio_vs_full_fp32'])} less"
    )
    held = totals["storage_held_bytes"]
    why = "nothing deleted: held = written" if held == written else "some files deleted or missing"
    yield f"held now   {format_bytes(held)} in committed checkpoints ({why})"
    every = totals["full_every_time_bytes"]
    if every is not None:
        yield f"           vs {format_bytes(every)} for a full checkpoint (same codec) every time"
    steps = " -> ".join(map(str, totals["restore_chain_steps"]))
    complete = "" if totals["restore_chain_complete"] else " (INCOMPLETE: cannot restore)"
    yield (
        f"restore    the latest checkpoint reads {format_bytes(totals['restore_chain_bytes'])}: "
        f"steps {steps}{complete}"
    )


def _codec_label(codec: Mapping[str, Any]) -> str:
    """The job's codec id; a ``delta`` job's names its whole-row codec too (``adaptive+delta``:
    fulls in the inner codec, diffs as its deltas)."""
    inner = codec.get("inner")
    if isinstance(inner, Mapping):
        return f"{inner.get('id', '?')}+delta"
    return str(codec.get("id", "?"))
