"""A manifest's table list as columns, each table's blocks as runs: what keeps a format-5
manifest's size in the tables, not in tables x ranks.

TorchRec places a row-wise table's blocks on consecutive ranks, each the next rows (a
column-wise one: the next columns), so 4,096 blocks of a table are one or two *runs*
``[rank, row_offset, col_offset, rows, cols, count, axis]``: ``count`` blocks, the i-th on
``rank + i`` at ``row_offset + i * rows`` (axis ``"r"``) or ``col_offset + i * cols`` (axis
``"c"``; ``manifest_types.ShardRuns`` holds them unexpanded). Any plan encodes (a block that
starts no run is a run of one) and decodes to the same blocks in the same order. The columns
spell each key once, not once per table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from embckpt.errors import CheckpointCorruptError
from embckpt.storage.manifest_types import Shard, ShardRuns, TableEntry


def to_runs(shards: Sequence[Shard]) -> list[list[Any]]:
    """``shards`` as runs (see the module's docstring), in order."""
    runs: list[list[Any]] = []
    for rank, row, col, rows, cols in shards:
        if runs:
            last = runs[-1]
            r0, ro, co, n_rows, n_cols, count, axis = last
            if (n_rows, n_cols) == (rows, cols) and rank == r0 + count:
                along_rows = row == ro + count * rows and col == co
                along_cols = col == co + count * cols and row == ro
                if along_rows and (count == 1 or axis == "r"):
                    last[5], last[6] = count + 1, "r"
                    continue
                if along_cols and (count == 1 or axis == "c"):
                    last[5], last[6] = count + 1, "c"
                    continue
        runs.append([rank, row, col, rows, cols, 1, "r"])
    return runs


_COLUMNS = ("name", "rows", "cols", "dtype", "sharding_type", "row_states", "elem_states")


def tables_to_columns(tables: Sequence[TableEntry]) -> dict[str, list[Any]]:
    """The table list as columns; ``shard_runs`` holds each table's blocks as runs."""
    columns: dict[str, list[Any]] = {key: [getattr(t, key) for t in tables] for key in _COLUMNS}
    columns["shard_runs"] = [
        t.shards.runs if isinstance(t.shards, ShardRuns) else to_runs(t.shards) for t in tables
    ]
    return columns


def tables_from_columns(columns: Mapping[str, Sequence[Any]], path: str) -> tuple[TableEntry, ...]:
    """Inverse of :func:`tables_to_columns`.

    Raises:
        CheckpointCorruptError: a column is missing, or the columns differ in length.
    """
    try:
        count = len(columns["name"])
        if any(len(columns[key]) != count for key in (*_COLUMNS, "shard_runs")):
            raise ValueError("table columns differ in length")
        return tuple(
            TableEntry(
                name=name,
                rows=rows,
                cols=cols,
                dtype=dtype,
                sharding_type=sharding,
                row_states=tuple(row_states),
                elem_states=tuple(elem_states),
                shards=ShardRuns(runs),
            )
            for name, rows, cols, dtype, sharding, row_states, elem_states, runs in zip(
                *(columns[key] for key in (*_COLUMNS, "shard_runs")), strict=True
            )
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointCorruptError(path, f"manifest tables are not valid: {exc}") from exc
