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
instead of replacing them, so they give no cells. The diffs of the blocks the chain pass
applies in chain order (:func:`chained_blocks`) are neither masked nor recorded: every row of
theirs is written, newer ones later.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from embckpt.blocks import TableShard
from embckpt.storage.manifest import FileEntry, Manifest
from embckpt.storage.rowfile_read import BATCH_BYTES


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

    @functools.cached_property
    def planned_bytes(self) -> int:
        """The bytes to fetch: asked for by every step of a restore that sizes its work
        (several times per file and block), and a sum over row groups each time."""
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


def chained_blocks(reads: Sequence[FileRead]) -> set[int]:
    """The blocks (``id`` of their ``TableShard``) whose diffs the chain pass applies, all
    along the chain in chain order (``chain_pass.py``): every diff read of theirs has them as
    its one target and is at most ``BATCH_BYTES`` (a diff's usual size, decoded whole). Decided
    before pruning, which only shrinks reads, so staging and applying agree on it."""
    blocks: set[int] = set()
    excluded: set[int] = set()
    for read in reads:
        if not read.position:
            continue
        keys = {id(t) for t in read.targets}
        if len(keys) != 1 or read.planned_bytes > BATCH_BYTES:
            excluded |= keys
        blocks |= keys
    return blocks - excluded


class _Rows:
    """A set of one block's rows (global ids), held as a mask over the block's rows: adding
    and testing cost the rows asked about, whatever the set holds. (Sorted arrays, merged
    link by link, cost the whole set at every link: quadratic in a chain's length, 3 ms per
    link on a 10M-row block.) One byte per row of the block, allocated when a diff first
    gives the block rows."""

    def __init__(self, shard: TableShard) -> None:
        self.offset = shard.row_offset
        self.mask = np.zeros(shard.num_rows, dtype=bool)

    def add(self, rows: np.ndarray) -> None:
        """Adds ``rows`` (global ids inside the block)."""
        self.mask[rows - self.offset] = True

    def member(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` (global ids inside the block, ascending, unique) in the set, elementwise;
        for a run of rows (a full's) a view of the set's own mask, not to be written."""
        if not len(rows):
            return np.zeros(0, dtype=bool)
        first, last = int(rows[0]) - self.offset, int(rows[-1]) - self.offset
        if last - first + 1 == len(rows):  # a slice, no gather
            return self.mask[first : last + 1]
        return self.mask[rows - self.offset]

    def count_in(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """How many of the set lie in each closed range [lo, hi] of global ids inside the
        block (0 where ``hi < lo``): one count per range, the row groups of one file."""
        lo, hi = lo - self.offset, hi - self.offset
        return np.array(
            [
                np.count_nonzero(self.mask[a : b + 1]) if b >= a else 0
                for a, b in zip(lo.tolist(), hi.tolist(), strict=True)
            ],
            dtype=np.int64,
        )


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
        self._cells: dict[tuple[int, int], _Rows] = {}
        self._states: dict[int, _Rows] = {}

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
            given = [self._cells.get((id(shard), seg[0])) for seg in self.segments(read, shard)]
            if shard.row_states:
                given.append(self._states.get(id(shard)))
            for rows in given:
                needed |= overlap & (rows is None or rows.count_in(lo, hi) < span)
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
            first, last = _inside(rows, shard)
            inside = rows[first:last]
            segments = []
            for lo, hi in self.segments(read, shard):
                mask = _newest(inside, self._cells.get((id(shard), lo)))
                segments.append((lo, hi, mask))
            states = _newest(inside, self._states.get(id(shard)))
            keeps.append(Keep(first, last, tuple(segments), states))
        return keeps

    def whole(self, read: FileRead, rows: np.ndarray) -> list[Keep]:
        """Per target block, every one of a staged file's ``rows`` inside it, unmasked: for
        files applied in chain order (``chain_pass.py``), where a newer file's write simply
        comes later."""
        keeps = []
        for shard in read.targets:
            first, last = _inside(rows, shard)
            segments = tuple((lo, hi, None) for lo, hi in self.segments(read, shard))
            keeps.append(Keep(first, last, segments, None))
        return keeps

    def give(self, read: FileRead, rows: np.ndarray, keeps: Sequence[Keep], additive: bool) -> None:
        """Records a staged file's rows as given (cells only for a file that replaces rows:
        ``additive`` False); ``keeps`` are :meth:`keep`'s for them (where each block's rows
        lie). Files of one checkpoint are recorded after all of them were kept: their
        row-wise states average together."""
        for shard, keep in zip(read.targets, keeps, strict=True):
            inside = rows[keep.first : keep.last]
            if not len(inside):
                continue
            if not additive:
                for lo, _ in self.segments(read, shard):
                    self._given(self._cells, (id(shard), lo), shard).add(inside)
            self._given(self._states, id(shard), shard).add(inside)

    @staticmethod
    def _given(sets: dict[Any, _Rows], key: Any, shard: TableShard) -> _Rows:
        if key not in sets:
            sets[key] = _Rows(shard)
        return sets[key]


def _inside(rows: np.ndarray, shard: TableShard) -> tuple[int, int]:
    """Where a staged file's ``rows`` (global ids, ascending) inside ``shard`` start and end
    (all of them, the usual case, told by the ends without a search)."""
    end = shard.row_offset + shard.num_rows
    if not len(rows) or (rows[0] >= shard.row_offset and rows[-1] < end):
        return 0, len(rows)
    first, last = np.searchsorted(rows, [shard.row_offset, end])
    return int(first), int(last)


def _newest(rows: np.ndarray, given: _Rows | None) -> np.ndarray | None:
    """Which of ``rows`` no newer file gave (a mask), None when none was given."""
    if given is None:
        return None
    held = given.member(rows)
    return ~held if held.any() else None
