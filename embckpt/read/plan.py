"""Restore, first room: which rows files and row groups each block needs, newest first.

:func:`plan_reads` lists, for each block (a ``TableShard``: a rank's local shard, or a whole
table for an export), the rows files of every chain checkpoint whose block overlaps it, and in
each file the row groups whose row range overlaps it (the manifest's index of the Parquet
row-group statistics; files without an index are read whole). Nothing here depends on the
writer's plan: files are addressed by their global row and column block, rows by global id.

:class:`Coverage` then runs newest checkpoint first, during staging: it drops a row group
before it is fetched when newer checkpoints already give every row it could hold (its row
range, from the index), and records per block and column segment which of a staged file's rows
are still the newest version (:class:`Keep`). Files of an additive codec add to older versions
instead of replacing them, so they give no cells.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from embckpt.blocks import TableShard
from embckpt.storage.manifest import FileEntry, Manifest


@dataclass(frozen=True)
class FileRead:
    """One rows file to read for some of this rank's blocks.

    ``groups`` are the row groups to fetch; None when the manifest has no index of this very
    file (``FileEntry.partial_index``): the whole file is fetched and checked.
    """

    position: int  # the checkpoint's place in the chain, base first
    step: int
    from_diff: bool
    entry: FileEntry
    targets: tuple[TableShard, ...]
    groups: tuple[int, ...] | None

    @property
    def planned_bytes(self) -> int:
        index = self.entry.partial_index
        if index is None or self.groups is None:
            return self.entry.bytes
        footer = self.entry.bytes - index.footer_offset
        return footer + sum(index.row_groups[g].length for g in self.groups)

    def columns(self, shard: TableShard) -> tuple[int, int]:
        """The global columns [lo, hi) this file gives ``shard``."""
        entry = self.entry
        return (
            max(shard.col_offset, entry.col_offset),
            min(shard.col_offset + shard.num_cols, entry.col_offset + entry.shard_cols),
        )


def writer_ranks(manifest: Manifest, shards: Sequence[TableShard]) -> set[int]:
    """The ranks whose blocks of ``manifest`` overlap ``shards``: the parts whose rows files a
    restore of ``shards`` may need (format 5). Every table of a plan is split into disjoint
    blocks, so under the writer's own plan a rank needs its own part alone."""
    by_table: dict[str, list[TableShard]] = {}
    for shard in shards:
        by_table.setdefault(shard.table, []).append(shard)
    ranks: set[int] = set()
    for table in manifest.tables:
        wanted = by_table.get(table.name)
        if not wanted or not table.shards:
            continue
        rank, row, col, rows, cols = table.shard_array.T
        for s in wanted:
            hit = (
                (row < s.row_offset + s.num_rows)
                & (s.row_offset < row + rows)
                & (col < s.col_offset + s.num_cols)
                & (s.col_offset < col + cols)
            )
            ranks.update(rank[hit].tolist())
    return ranks


def plan_reads(chain: Sequence[Manifest], shards: Sequence[TableShard]) -> list[FileRead]:
    """The files, and the row groups in them, that ``shards`` need from ``chain`` (before the
    newest-first pruning of :func:`stage`)."""
    by_table: dict[str, list[TableShard]] = {}
    for shard in shards:
        by_table.setdefault(shard.table, []).append(shard)
    reads = []
    for position, manifest in enumerate(chain):
        for entry in manifest.files:
            if entry.role != "rows":
                continue
            targets = tuple(
                s
                for s in by_table.get(entry.table, ())
                if entry.overlaps(
                    s.row_offset,
                    s.row_offset + s.num_rows,
                    s.col_offset,
                    s.col_offset + s.num_cols,
                )
            )
            if not targets:
                continue
            groups = None
            index = entry.partial_index
            if index is not None:
                groups = tuple(
                    i
                    for i, g in enumerate(index.row_groups)
                    if any(
                        g.first_row < s.row_offset + s.num_rows and s.row_offset <= g.last_row
                        for s in targets
                    )
                )
                if not groups:
                    continue  # the file's rows all lie outside this rank's blocks
            reads.append(
                FileRead(position, manifest.step, manifest.kind == "diff", entry, targets, groups)
            )
    return reads


def _member(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """``values`` (ascending, unique) in ``sorted_set`` (ascending, unique), elementwise."""
    if not len(sorted_set) or not len(values):
        return np.zeros(len(values), dtype=bool)
    first, last = int(values[0]), int(values[-1])
    if last - first + 1 == len(values):  # a run of rows (a full's): index by offset
        inside = sorted_set[
            np.searchsorted(sorted_set, first) : np.searchsorted(sorted_set, last, "right")
        ]
        member = np.zeros(len(values), dtype=bool)
        member[inside - first] = True
        return member
    if len(sorted_set) < len(values):  # search the smaller array in the larger (``values``
        # ascend too): a base's rows against the few its diffs give
        at = np.searchsorted(values, sorted_set)
        found = at < len(values)
        found[found] = values[at[found]] == sorted_set[found]
        member = np.zeros(len(values), dtype=bool)
        member[at[found]] = True
        return member
    at = np.searchsorted(sorted_set, values).clip(max=len(sorted_set) - 1)
    return sorted_set[at] == values


def _union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The union of two ascending unique arrays, ascending and unique (``np.union1d`` hashes:
    measured 20x slower on sorted input)."""
    if not len(a) or not len(b):
        return b if not len(a) else a
    both = np.concatenate([a, b])
    both.sort(kind="stable")  # two sorted runs: merged in linear time
    fresh = np.empty(len(both), dtype=bool)
    fresh[0] = True
    np.not_equal(both[1:], both[:-1], out=fresh[1:])
    return both[fresh]


def _count_in(sorted_set: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """How many of ``sorted_set`` lie in each closed range [lo, hi]."""
    return np.searchsorted(sorted_set, hi, side="right") - np.searchsorted(sorted_set, lo)


@dataclass(frozen=True)
class Keep:
    """Which staged rows of one file still give one block their newest version.

    ``first:last`` are the file's staged rows inside the block; ``segments`` are the block's
    column segments [lo, hi) the file covers, each with a mask over ``first:last`` (None: all
    of them); ``states`` the same for the row-wise optimizer states.
    """

    first: int
    last: int
    segments: tuple[tuple[int, int, np.ndarray | None], ...]
    states: np.ndarray | None

    def gives(self, rows: slice | None = None) -> bool:
        """Whether ``rows`` (positions in ``first:last``; all of them if None) give anything:
        the weights of a column segment, or the row-wise states."""
        rows = slice(0, self.last - self.first) if rows is None else rows
        if rows.stop <= rows.start:
            return False
        if self.states is None or self.states[rows].any():
            return True
        return any(mask is None or mask[rows].any() for _, _, mask in self.segments)


class Coverage:
    """The rows that newer checkpoints of a chain already give each block.

    Weights and element-wise states are tracked per cell: per block and column segment (the
    column boundaries of every file over the block), only from files that replace rows (an
    additive file adds to older versions). Row-wise states are tracked per row: the newest
    checkpoint holding a row gives its state (see ``apply.py``).
    """

    def __init__(self, reads: Sequence[FileRead]) -> None:
        bounds: dict[int, set[int]] = {}
        for read in reads:
            for shard in read.targets:
                bounds.setdefault(id(shard), set()).update(read.columns(shard))
        self._bounds = {key: sorted(cuts) for key, cuts in bounds.items()}
        self._cells: dict[tuple[int, int], np.ndarray] = {}
        self._states: dict[int, np.ndarray] = {}
        self._empty = np.zeros(0, dtype=np.int64)

    def segments(self, read: FileRead, shard: TableShard) -> list[tuple[int, int]]:
        lo, hi = read.columns(shard)
        cuts = [c for c in self._bounds[id(shard)] if lo <= c <= hi]
        return list(zip(cuts[:-1], cuts[1:], strict=True))

    def prune(self, read: FileRead) -> FileRead | None:
        """``read`` without the row groups whose every possible row newer files already give
        (for each target block, in each column segment and for the row-wise states); None when
        no row group is left."""
        index = read.entry.partial_index
        if read.groups is None or index is None:
            return read
        groups = np.array(read.groups)
        first = np.array([index.row_groups[g].first_row for g in read.groups])
        last = np.array([index.row_groups[g].last_row for g in read.groups])
        needed = np.zeros(len(groups), dtype=bool)
        for shard in read.targets:
            lo = first.clip(min=shard.row_offset)
            hi = last.clip(max=shard.row_offset + shard.num_rows - 1)
            overlap = hi >= lo
            span = hi - lo + 1
            given = [
                self._cells.get((id(shard), seg[0]), self._empty)
                for seg in self.segments(read, shard)
            ]
            if shard.row_states:
                given.append(self._states.get(id(shard), self._empty))
            for rows in given:
                needed |= overlap & (_count_in(rows, lo, hi) < span)
        if needed.all():
            return read
        if not needed.any():
            return None
        return FileRead(
            read.position,
            read.step,
            read.from_diff,
            read.entry,
            read.targets,
            tuple(int(g) for g in groups[needed]),
        )

    def keep(self, read: FileRead, rows: np.ndarray) -> list[Keep]:
        """Per target block, which of a staged file's ``rows`` are still the newest."""
        keeps = []
        for shard in read.targets:
            first, last = np.searchsorted(
                rows, [shard.row_offset, shard.row_offset + shard.num_rows]
            )
            inside = rows[first:last]
            segments = []
            for lo, hi in self.segments(read, shard):
                mask = ~_member(inside, self._cells.get((id(shard), lo), self._empty))
                segments.append((lo, hi, None if mask.all() else mask))
            states = ~_member(inside, self._states.get(id(shard), self._empty))
            keeps.append(
                Keep(int(first), int(last), tuple(segments), None if states.all() else states)
            )
        return keeps

    def give(self, read: FileRead, rows: np.ndarray, additive: bool) -> None:
        """Records a staged file's rows as given (cells only for a file that replaces rows:
        ``additive`` False). Files of
        one checkpoint are recorded after all of them were kept: their row-wise states
        average together."""
        for shard in read.targets:
            first, last = np.searchsorted(
                rows, [shard.row_offset, shard.row_offset + shard.num_rows]
            )
            inside = rows[first:last]
            if not len(inside):
                continue
            if not additive:
                for lo, _ in self.segments(read, shard):
                    key = (id(shard), lo)
                    self._cells[key] = _union(self._cells.get(key, self._empty), inside)
            self._states[id(shard)] = _union(self._states.get(id(shard), self._empty), inside)
