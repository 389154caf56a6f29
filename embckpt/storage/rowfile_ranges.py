"""The checked byte ranges of one rows file, as the blocks read from it share them.

``rowfile_read.CheckedFile`` reads a block through a :class:`FetchedFile`: the footer and row
groups fetched once and checked against the manifest, served to Parquet by
:class:`VerifiedRanges`, which refuses any read outside them.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embckpt.errors import CheckpointCorruptError
from embckpt.storage.manifest import FileIndex
from embckpt.storage.rowfile import COL_COLUMN, HEADER_KEY, ROW_COLUMN, TABLE_COLUMN

SMALL_BYTES = 1 << 20  # row groups of a file read once, every decoded column, for all its blocks
PARSE_ERRORS = (pa.ArrowException, OSError, KeyError, TypeError, ValueError)


class RangeSource(Protocol):
    """An open file to fetch byte ranges from (a ``pyarrow`` file or memory map)."""

    def seek(self, position: int) -> int: ...

    def read_buffer(self, nbytes: int) -> pa.Buffer: ...

    def close(self) -> None: ...


class FetchedFile:
    """The checked ranges of one file, its parsed footer and header, shared by the
    ``rowfile_read.CheckedFile`` of each block a reader takes from it (one fetch and one
    footer parse per file, whatever the blocks); the source closes with the last of them.

    A file whose checked row groups are small (``SMALL_BYTES``: a diff's) is decoded by one
    Parquet read, of every column, kept for all its blocks: reading the row ids, then the rows,
    block by block, cost a footer walk and a read each.
    """

    def __init__(
        self,
        path: str,
        size: int,
        footer: pq.FileMetaData,
        segments: list[tuple[int, pa.Buffer]],
        groups: Sequence[int],
        source: RangeSource | None,
        first_rows: Mapping[int, int | None] | None = None,
    ) -> None:
        self.path, self.size, self.footer = path, size, footer
        self.segments, self.source = segments, source
        self.groups = list(groups)  # every checked row group, ascending (Parquet's numbers)
        self.users = 0
        self._lock = threading.Lock()
        self._table: pa.Table | None = None
        self._readers: list[pq.ParquetFile] = []
        self._spans: dict[int, tuple[int, int]] = {}
        self._small: bool | None = None
        try:
            schema = footer.schema.to_arrow_schema()
            self.header = json.loads(schema.metadata[HEADER_KEY])
        except PARSE_ERRORS as exc:
            raise CheckpointCorruptError(path, f"not an embckpt Parquet file: {exc}") from exc
        # What a reader decodes: a block's table and first column are in the header (the
        # columns serve queries over the files); skipping them saved 7-14% of a diff's read.
        self.columns = [n for n in schema.names if n not in (TABLE_COLUMN, COL_COLUMN)]
        self.value_columns = [n for n in self.columns if n != ROW_COLUMN]
        # Per row group, its first row id where it holds one run (None where not): from the
        # manifest's index when given (no footer walk), else from the footer on first use.
        self._first_rows: dict[int, int | None] = dict(first_rows or {})

    @contextlib.contextmanager
    def parquet(self) -> Iterator[pq.ParquetFile]:
        """A Parquet reader over the checked ranges, used by one thread at a time and kept for
        the file's next read: building one cost about as much as reading a block's rows (twice
        as much as reading its row ids), and a packed diff is read block by block."""
        with self._lock:
            reader = self._readers.pop() if self._readers else None
        if reader is None:
            reader = self._new_reader()
        yield reader
        with self._lock:
            if self.users > 0:  # not released meanwhile: its ranges are still held
                self._readers.append(reader)

    def _new_reader(self) -> pq.ParquetFile:
        source = pa.PythonFile(VerifiedRanges(self.size, self.segments, self.path), "r")
        return pq.ParquetFile(source, metadata=self.footer, pre_buffer=False)

    def small(self) -> bool:
        if self._small is None:
            size = sum(self.footer.row_group(g).total_byte_size for g in self.groups)
            self._small = size <= SMALL_BYTES
        return self._small

    def contiguous_rows(self, groups: Sequence[int]) -> np.ndarray | None:
        """The row ids of row groups ``groups`` where each group holds one run of consecutive
        ids, told by the manifest's index (:func:`index_runs`) or else the footer's statistics
        (None where a group does not, or neither tells): a writer stores a block's ids
        ascending and unique, so a group whose largest id is its smallest plus its rows less one
        holds exactly that run. A full's groups do, and decoding their row column (delta-packed
        int64) took about as long as decoding the codes (1.2 ms for 486k rows of 16 columns at
        4 bits), twice: at staging, then with the rows."""
        starts = self._runs(groups)
        if starts is None:
            return None
        if len(starts) == 1:
            return np.arange(starts[0][0], sum(starts[0]), dtype=np.int64)
        return np.concatenate(
            [np.arange(first, first + n, dtype=np.int64) for first, n in starts]
            or [np.zeros(0, dtype=np.int64)]
        )

    def _runs(self, groups: Sequence[int]) -> list[tuple[int, int]] | None:
        """Each group's (first row id, rows) where every one holds a run, else None."""
        starts = []
        for g in groups:
            if g not in self._first_rows:
                self._first_rows[g] = self._run_start(g)
            first = self._first_rows[g]
            if first is None:
                return None
            starts.append((first, self.footer.row_group(g).num_rows))
        return starts

    def _run_start(self, group: int) -> int | None:
        meta = self.footer.row_group(group)
        for i in range(meta.num_columns):
            column = meta.column(i)
            if column.path_in_schema == ROW_COLUMN:
                stats = column.statistics
                if stats is None or not stats.has_min_max or meta.num_rows == 0:
                    return None
                first, last = int(stats.min), int(stats.max)
                return first if last - first + 1 == meta.num_rows else None
        return None

    def rows_of(self, groups: Sequence[int]) -> pa.Table:
        """The ``columns`` of row groups ``groups`` (checked ones) of a small file (without the
        row ids where :meth:`contiguous_rows` gives those of every checked group), one chunk
        each: a slice of the one read of all of them, which Parquet gives as one chunk per
        column (joining its chunks again copied every byte of the file for nothing), or, for
        groups apart, their slices joined."""
        with self._lock:  # blocks of one file may be applied on several threads
            if self._table is None:
                known = self._runs(self.groups) is not None  # the ids are told, not read
                self._table = self._new_reader().read_row_groups(
                    self.groups,
                    columns=self.value_columns if known else self.columns,
                    use_threads=False,
                )
                counts = [self.footer.row_group(g).num_rows for g in self.groups]
                starts = np.cumsum([0, *counts]).tolist()
                self._spans = {g: (starts[i], starts[i + 1]) for i, g in enumerate(self.groups)}
            table, spans = self._table, [self._spans[g] for g in groups]
        if all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False)):
            return table.slice(spans[0][0], spans[-1][1] - spans[0][0]) if spans else table[:0]
        return pa.concat_tables([table.slice(lo, hi - lo) for lo, hi in spans]).combine_chunks()

    def use(self) -> None:
        with self._lock:
            self.users += 1

    def release(self) -> None:
        """One user fewer; the last one closes the source (blocks apply on several threads)."""
        with self._lock:
            self.users -= 1
            if self.users > 0:
                return
            source, self.source = self.source, None
            self.segments, self._table, self._readers = [], None, []
        if source is not None:
            source.close()


def index_runs(index: FileIndex, groups: Sequence[int]) -> dict[int, int | None]:
    """Per row group ``groups`` of a file's ``index`` (by Parquet's number), its first row id
    where it holds one run of ids, else None: the row column's statistics, as the manifest's
    index keeps them (a writer's ids are ascending and unique)."""
    runs: dict[int, int | None] = {}
    for g in groups:
        entry = index.row_groups[g]
        one_run = entry.rows > 0 and entry.last_row - entry.first_row + 1 == entry.rows
        runs[index.first_group + g] = entry.first_row if one_run else None
    return runs


class VerifiedRanges:
    """A read-only file object over the verified byte ranges of one file.

    Parquet reads through it; a read that leaves the verified ranges raises instead of
    reaching unchecked bytes.
    """

    def __init__(self, size: int, segments: list[tuple[int, pa.Buffer]], path: str) -> None:
        self._size = size
        self._segments = segments
        self._path = path
        self._pos = 0
        self.closed = False

    def seek(self, pos: int, whence: int = 0) -> int:
        base = (0, self._pos, self._size)[whence]
        self._pos = base + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> memoryview:
        if n is None or n < 0:
            n = self._size - self._pos
        for offset, data in self._segments:
            if offset <= self._pos and self._pos + n <= offset + data.size:
                start = self._pos - offset
                self._pos += n
                return memoryview(data)[start : start + n]
        raise OSError(f"{self._path}: read of bytes {self._pos}+{n} outside the verified ranges")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True
