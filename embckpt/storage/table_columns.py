"""A manifest's table list as columns, each table's blocks as runs: what keeps a format-5
manifest's size in the tables, not in tables x ranks.

TorchRec places a row-wise table's blocks on consecutive ranks, each the next rows (a
column-wise one: the next columns), so 4,096 blocks of a table are one or two *runs*
``[rank, row_offset, col_offset, rows, cols, count, axis]``: ``count`` blocks, the i-th on
``rank + i`` at ``row_offset + i * rows`` (axis ``"r"``) or ``col_offset + i * cols`` (axis
``"c"``). Any plan encodes (a block that starts no run is a run of one) and decodes to the same
blocks in the same order. The columns spell each key once, not once per table.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, overload

import numpy as np

from embckpt.errors import CheckpointCorruptError
from embckpt.storage.manifest_types import TableEntry

Shard = tuple[int, int, int, int, int]  # (rank, row_offset, col_offset, rows, cols)


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


class ShardRuns(Sequence[Shard]):
    """A table's blocks kept as their runs, expanded into tuples only when listed: a reader
    of a 4,096-rank manifest needs the blocks of the few tables it holds, as arrays."""

    def __init__(self, runs: Sequence[Sequence[Any]]) -> None:
        self.runs = [list(r) for r in runs]
        self._shards: tuple[Shard, ...] | None = None

    def _expanded(self) -> tuple[Shard, ...]:
        if self._shards is None:
            self._shards = from_runs(self.runs)
        return self._shards

    def __len__(self) -> int:
        return sum(int(r[5]) for r in self.runs)

    @overload
    def __getitem__(self, index: int) -> Shard: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Shard]: ...

    def __getitem__(self, index: int | slice) -> Shard | Sequence[Shard]:
        return self._expanded()[index]

    def __iter__(self) -> Iterator[Shard]:
        return iter(self._expanded())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ShardRuns):
            return self.runs == other.runs
        if isinstance(other, Sequence):
            return self._expanded() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._expanded())

    def __repr__(self) -> str:
        return f"ShardRuns({self.runs!r})"

    def array(self) -> np.ndarray:
        """The blocks as an int64 array (blocks x 5), built from the runs without tuples."""
        if not self.runs:
            return np.zeros((0, 5), dtype=np.int64)
        runs = np.asarray([r[:6] for r in self.runs], dtype=np.int64)
        along_cols = np.asarray([r[6] == "c" for r in self.runs])
        counts = runs[:, 5]
        run = np.repeat(np.arange(len(runs)), counts)
        i = np.arange(len(run)) - np.repeat(np.cumsum(counts) - counts, counts)
        out = runs[run, :5].copy()
        out[:, 0] += i
        step_rows = np.where(along_cols, 0, runs[:, 3])[run]
        step_cols = np.where(along_cols, runs[:, 4], 0)[run]
        out[:, 1] += i * step_rows
        out[:, 2] += i * step_cols
        return out


def from_runs(runs: Sequence[Sequence[Any]]) -> tuple[Shard, ...]:
    """The blocks ``runs`` stand for, in order (inverse of :func:`to_runs`)."""
    shards: list[Shard] = []
    for rank, row, col, rows, cols, count, axis in runs:
        if axis == "r":
            shards.extend((rank + i, row + i * rows, col, rows, cols) for i in range(count))
        else:
            shards.extend((rank + i, row, col + i * cols, rows, cols) for i in range(count))
    return tuple(shards)


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
