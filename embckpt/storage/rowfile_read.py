"""Reading rows files (the format: ``rowfile.py``): checked byte ranges, then decoded batches.

A reader gets a :class:`CheckedFile` from ``CheckpointStore.open_rows``: the footer and the row
groups it asked for, fetched and each checked against the manifest's index before anything is
parsed. Parquet then reads through a file object that serves only those checked ranges, so a
read outside them is an error, never silently unchecked bytes.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embckpt.codecs.base import Codec, EncodedRows
from embckpt.errors import CheckpointCorruptError
from embckpt.storage.checksum import verify
from embckpt.storage.manifest import FileIndex
from embckpt.storage.phases import PhaseClock
from embckpt.storage.rowfile import (
    BLOCK_COLUMNS,
    BLOCKS_KEY,
    ELEM_STATE_PREFIX,
    HEADER_KEY,
    MAGIC,
    ROW_COLUMN,
    STATE_PREFIX,
)
from embckpt.storage.rowfile_ranges import PARSE_ERRORS, FetchedFile, RangeSource, index_runs
from embckpt.storage.signing import check_digest

BATCH_BYTES = 8 << 20  # bytes of row groups decoded at a time (at least one row group)


@dataclass(frozen=True)
class RowBatch:
    """Rows read back from a file: global ids, the codec's columns, optimizer states, header.

    ``row_states`` are as stored (values, or encoded): :func:`row_state_values` decodes them.
    """

    rows: np.ndarray
    encoded: EncodedRows
    row_states: Mapping[str, np.ndarray | EncodedRows]
    elem_states: Mapping[str, EncodedRows]
    header: Mapping[str, Any]


def row_state_values(batch: RowBatch, codec: Codec) -> dict[str, np.ndarray]:
    """A batch's row-wise states as values [rows], the encoded ones decoded by ``codec`` (the
    file's state codec)."""
    return {
        name: values
        if isinstance(values, np.ndarray)
        else codec.decode(values, 1).reshape(-1).numpy()
        for name, values in batch.row_states.items()
    }


def decode_file(data: pa.Buffer, path: str, row_lo: int, row_hi: int) -> RowBatch:
    """Reads the rows with global id in [row_lo, row_hi) from a whole file's checked bytes.

    Raises:
        CheckpointCorruptError: the bytes are not a readable embckpt Parquet file.
    """
    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
        header = json.loads(parquet.schema_arrow.metadata[HEADER_KEY])
        if BLOCKS_KEY in header:
            raise ValueError("a packed file: its blocks are read one by one (open_rows)")
        table = pq.read_table(
            pa.BufferReader(data),
            filters=[(ROW_COLUMN, ">=", row_lo), (ROW_COLUMN, "<", row_hi)],
        )
    except PARSE_ERRORS as exc:
        raise CheckpointCorruptError(path, f"not a readable embckpt Parquet file: {exc}") from exc
    return _row_batch(table, header)


class CheckedFile:
    """Byte ranges of one rows file, fetched and checked against the manifest, ready to decode.

    Call order: ``CheckpointStore.open_rows`` -> ``row_ids`` (the row column only: cheap) ->
    ``read`` (every column) -> ``close``. Parquet reads only the checked ranges; a read
    outside them raises. :meth:`blocks` gives other blocks of the same packed file from the
    same fetch.

    Attributes:
        header: the file's own metadata (codec configs, the block's place and shape); in a
            packed file, the header of block ``block``.
        groups: the row groups checked and read (Parquet's numbers).
        bytes_read: bytes fetched.
    """

    def __init__(
        self,
        path: str,
        size: int,
        footer: pq.FileMetaData,
        segments: list[tuple[int, pa.Buffer]],
        groups: Sequence[int],
        bytes_read: int,
        source: RangeSource | None = None,
        block: int | None = None,
        first_rows: Mapping[int, int | None] | None = None,
    ) -> None:
        fetched = FetchedFile(path, size, footer, segments, groups, source, first_rows)
        self._init(fetched, groups, bytes_read, block)

    def _init(
        self, fetched: FetchedFile, groups: Sequence[int], bytes_read: int, block: int | None
    ) -> None:
        self.path = fetched.path
        self.groups = list(groups)
        self.bytes_read = bytes_read
        self._fetched = fetched
        self._closed = False
        self._all: RowBatch | None = None  # a small file's rows, read once (read_all)
        self._known: np.ndarray | None = None  # row_ids() where the index or footer told them
        fetched.use()
        header = fetched.header
        try:
            if (BLOCKS_KEY in header) != (block is not None):
                raise ValueError(
                    f"the manifest says block {block}, the file is "
                    + ("packed" if BLOCKS_KEY in header else "not packed")
                )
            self.header: Mapping[str, Any] = header if block is None else header[BLOCKS_KEY][block]
        except PARSE_ERRORS as exc:
            fetched.release()
            raise CheckpointCorruptError(
                fetched.path, f"not an embckpt Parquet file: {exc}"
            ) from exc

    def blocks(self, wanted: Sequence[tuple[int | None, Sequence[int]]]) -> list[CheckedFile]:
        """Blocks ``(block, Parquet row groups)`` of this packed file, each read from this
        file's checked ranges (the groups must be among ``groups``); this file's own header
        and groups are those of the first block fetched, which the caller closes like them."""
        checked, views = set(self.groups), []
        try:
            for block, groups in wanted:
                if not checked.issuperset(groups):
                    raise ValueError(f"{self.path}: row groups {list(groups)} were not fetched")
                views.append(CheckedFile.__new__(CheckedFile))
                views[-1]._init(self._fetched, groups, 0, block)
        except BaseException:
            for view in views[:-1]:  # the last one failed to open: released already
                view.close()
            raise
        return views

    def _read(self, groups: Sequence[int], columns: list[str] | None = None) -> pa.Table:
        """Row groups ``groups`` (the ``columns`` of them), raising CheckpointCorruptError
        where the checked bytes do not parse."""
        fetched = self._fetched
        try:
            if not fetched.small():
                with fetched.parquet() as parquet:
                    wanted = fetched.columns if columns is None else columns
                    return parquet.read_row_groups(groups, columns=wanted, use_threads=False)
            table = fetched.rows_of(groups)
            return table if columns is None else table.select(columns)
        except PARSE_ERRORS as exc:
            raise CheckpointCorruptError(
                self.path, f"not a readable embckpt Parquet file: {exc}"
            ) from exc

    def row_ids(self) -> np.ndarray:
        """The global row ids stored in the checked row groups, ascending (told by the index
        where each group is one run: ``FetchedFile.contiguous_rows``); of a small file, those
        of :meth:`read_all`'s one batch, which is kept for its next call (a chain's
        diffs are staged, then applied whole: each block of them was read and wrapped
        twice).

        Raises:
            CheckpointCorruptError: the checked bytes do not parse.
        """
        if self.small:
            return self.read_all().rows
        self._known = self._fetched.contiguous_rows(self.groups)
        if self._known is not None:
            return self._known
        return self._read(self.groups, [ROW_COLUMN])[ROW_COLUMN].to_numpy()

    def _ids_of(self, run: Sequence[int]) -> np.ndarray | None:
        """The row ids of ``run`` (consecutive checked groups) where the index or footer tells
        them: a slice of :meth:`row_ids`' when it gave them (a 10M-row full's ids are 80 MB of
        fresh pages, 15 ms to fill), else made here; None where they must be decoded."""
        if self._known is None or not run:
            return self._fetched.contiguous_rows(run)
        footer, at = self._fetched.footer, 0
        for g in self.groups:
            if g == run[0]:
                break
            at += footer.row_group(g).num_rows
        count = sum(footer.row_group(g).num_rows for g in run)
        return self._known[at : at + count]

    def runs(self) -> list[list[int]]:
        """The checked row groups in runs of about ``BATCH_BYTES`` (all of them for a small
        file): what :meth:`read` decodes at a time, and what threads may read in parallel."""
        if self._fetched.small():
            return [self.groups]
        runs: list[list[int]] = []
        size = BATCH_BYTES
        footer = self._fetched.footer
        for g in self.groups:
            group_bytes = footer.row_group(g).total_byte_size
            if size + group_bytes > BATCH_BYTES:
                runs.append([])
                size = 0
            runs[-1].append(g)
            size += group_bytes
        return runs

    def read(
        self, row_lo: int, row_hi: int, runs: Sequence[Sequence[int]] | None = None
    ) -> Iterator[RowBatch]:
        """The rows with global id in [row_lo, row_hi), ascending, in batches of a few row
        groups (``runs``: all of :meth:`runs` if None) whose columns are single Arrow
        arrays: decoding works through buffers of a bounded size, which the allocators reuse,
        and copies no more than the codec does.

        Raises:
            CheckpointCorruptError: the checked bytes do not parse.
        """
        try:
            for run in self.runs() if runs is None else runs:
                known = self._ids_of(run)
                table = self._read(run, None if known is None else self._fetched.value_columns)
                start = 0
                for batch in table.to_batches():
                    if known is None:
                        ids = batch[ROW_COLUMN].to_numpy()
                    else:
                        ids = known[start : start + batch.num_rows]
                    start += batch.num_rows
                    lo, hi = np.searchsorted(ids, [row_lo, row_hi])
                    if hi > lo:
                        yield _row_batch(batch.slice(lo, hi - lo), self.header, ids[lo:hi])
        except PARSE_ERRORS as exc:
            raise CheckpointCorruptError(
                self.path, f"not a readable embckpt Parquet file: {exc}"
            ) from exc

    @property
    def small(self) -> bool:
        """Whether the checked row groups were read once, whole (``rowfile_ranges.SMALL_BYTES``):
        :meth:`read_all` then copies nothing more."""
        return self._fetched.small()

    def read_all(self) -> RowBatch:
        """Every row of the checked row groups in one batch; of a small file, the same batch
        each time, until :meth:`close`.

        Raises:
            CheckpointCorruptError: the checked bytes do not parse.
        """
        if self._all is not None:
            return self._all
        known = self._ids_of(self.groups)
        table = self._read(self.groups, None if known is None else self._fetched.value_columns)
        batch = _row_batch(table, self.header, known)
        if self.small:
            self._all = batch
        return batch

    def compression(self) -> dict[str, str]:
        """The Parquet compression each column of the checked row groups was written with
        (``none`` for uncompressed), keyed by column name (a float list by its own name)."""
        if not self.groups:
            return {}
        group = self._fetched.footer.row_group(self.groups[0])
        found = {}
        for i in range(group.num_columns):
            codec = group.column(i).compression.lower()
            name = group.column(i).path_in_schema.removesuffix(".list.element")
            found[name] = "none" if codec == "uncompressed" else codec
        return found

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._all = self._known = None
            self._fetched.release()


def open_ranges(
    source: RangeSource,
    path: str,
    size: int,
    index: FileIndex,
    groups: Sequence[int],
    clock: PhaseClock | None = None,
    block: int | None = None,
) -> CheckedFile:
    """Fetches a file's footer and row groups ``groups`` from ``source`` and checks each
    against the index; the returned file closes ``source``.

    Args:
        size: the file's size, from the manifest (the caller checked the file has it).
        index: the file's index, from the manifest (a packed file's block: its own row
            groups, from Parquet's ``index.first_group`` on).
        groups: ascending positions in ``index.row_groups`` to fetch.
        block: the block's number in a packed file (None: a file of one block).
        clock: gets the fetching time as ``fetch``, the rest (checksums, parsing the footer)
            as ``verify``.

    Raises:
        CheckpointCorruptError: a range is short, does not match its checksum, or the footer
            does not parse; the message names the file and the range.
    """
    fetched = _Fetcher(source, path)
    started = time.perf_counter()
    try:
        footer_length = size - index.footer_offset
        if footer_length <= 0:
            raise CheckpointCorruptError(path, f"footer: empty range at byte {index.footer_offset}")
        footer = fetched(index.footer_offset, footer_length)
        what = f"footer (bytes {index.footer_offset}+{footer_length})"
        verify(footer, index.footer_checksum, path, what)
        if index.footer_digest:  # a signed checkpoint
            check_digest(footer, index.footer_digest, path, what)
        segments: list[tuple[int, pa.Buffer]] = []
        for run in _runs(groups):
            first, last = index.row_groups[run[0]], index.row_groups[run[-1]]
            data = fetched(first.offset, last.offset + last.length - first.offset)
            for g in run:
                group = index.row_groups[g]
                part = data.slice(group.offset - first.offset, group.length)
                what = f"row group {g} (bytes {group.offset}+{group.length})"
                verify(part, group.checksum, path, what)
                if group.digest:
                    check_digest(part, group.digest, path, what)
            segments.append((first.offset, data))
        try:
            parsed = pq.read_metadata(pa.BufferReader(pa.py_buffer(MAGIC + footer.to_pybytes())))
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise CheckpointCorruptError(path, f"footer does not parse: {exc}") from exc
        listed = index.first_group + len(index.row_groups)
        if (parsed.num_row_groups != listed) if block is None else (parsed.num_row_groups < listed):
            raise CheckpointCorruptError(
                path,
                f"footer lists {parsed.num_row_groups} row groups, the manifest {listed}",
            )
        parquet_groups = [index.first_group + g for g in groups]
        runs = index_runs(index, groups)
        return CheckedFile(
            path, size, parsed, segments, parquet_groups, fetched.bytes, source, block, runs
        )
    except BaseException:
        source.close()
        raise
    finally:
        if clock is not None:
            clock.add("fetch", fetched.seconds)
            clock.add("verify", time.perf_counter() - started - fetched.seconds)


def whole_file(data: pa.Buffer, path: str) -> CheckedFile:
    """A whole file whose bytes were already checked against its file-level checksum."""
    try:
        footer = pq.read_metadata(pa.BufferReader(data))
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise CheckpointCorruptError(path, f"not a readable Parquet file: {exc}") from exc
    groups = range(footer.num_row_groups)
    return CheckedFile(path, data.size, footer, [(0, data)], groups, data.size)


class _Fetcher:
    """Reads byte ranges of one source, counting their bytes and the seconds spent."""

    def __init__(self, source: RangeSource, path: str) -> None:
        self._source, self._path = source, path
        self.bytes = 0
        self.seconds = 0.0

    def __call__(self, offset: int, length: int) -> pa.Buffer:
        started = time.perf_counter()
        try:
            self._source.seek(offset)
            data = pa.py_buffer(self._source.read_buffer(length))
        except (OSError, pa.ArrowException) as exc:
            raise CheckpointCorruptError(
                self._path, f"cannot read bytes {offset}+{length}: {exc}"
            ) from exc
        finally:
            self.seconds += time.perf_counter() - started
        if data.size != length:
            raise CheckpointCorruptError(
                self._path, f"bytes {offset}+{length}: read {data.size} (file truncated?)"
            )
        self.bytes += data.size
        return data


def _row_batch(
    table: pa.Table | pa.RecordBatch, header: Mapping[str, Any], rows: np.ndarray | None = None
) -> RowBatch:
    """A batch of ``table``'s rows; ``rows``: their ids, known without its row column."""
    state_meta, elem_meta = header.get("state_meta", {}), header.get("elem_meta", {})
    layout = _layout(tuple(table.schema.names), tuple(state_meta), tuple(elem_meta))
    row_states: dict[str, np.ndarray | EncodedRows] = {
        name: table[column].to_numpy() for name, column in layout.plain_states
    }
    row_states.update(_coded(table, layout.coded_states, state_meta))
    return RowBatch(
        rows=table[ROW_COLUMN].to_numpy() if rows is None else rows,
        encoded=EncodedRows(
            columns={n: table[n] for n in layout.codec}, metadata=header.get("codec_meta", {})
        ),
        row_states=row_states,
        elem_states=_coded(table, layout.elem_states, elem_meta),
        header=header,
    )


_Coded = tuple[tuple[str, tuple[tuple[str, str], ...]], ...]
"""Encoded states: per state name, (its codec's column name, the batch's column name)."""


@dataclass(frozen=True)
class _Layout:
    """Which columns of a batch are the codec's, plain row-wise states (name, column) and
    encoded states, for one schema and state names."""

    codec: tuple[str, ...]
    plain_states: tuple[tuple[str, str], ...]
    coded_states: _Coded
    elem_states: _Coded


@functools.lru_cache(maxsize=256)
def _layout(
    names: tuple[str, ...], coded_states: tuple[str, ...], elem_states: tuple[str, ...]
) -> _Layout:
    """A batch's :class:`_Layout`, sorted out once per schema: a packed file's blocks and a
    chain's files share a few schemas, and each of their batches sorted its columns by
    prefix again."""

    def coded(prefix: str, states: tuple[str, ...]) -> _Coded:
        starts = [(name, f"{prefix}{name}.") for name in states]
        return tuple(
            (name, tuple((n[len(start) :], n) for n in names if n.startswith(start)))
            for name, start in starts
        )

    row_coded = coded(STATE_PREFIX, coded_states)
    taken = {column for _, columns in row_coded for _, column in columns}
    return _Layout(
        codec=tuple(
            n
            for n in names
            if n not in BLOCK_COLUMNS and not n.startswith((STATE_PREFIX, ELEM_STATE_PREFIX))
        ),
        plain_states=tuple(
            (n[len(STATE_PREFIX) :], n)
            for n in names
            if n.startswith(STATE_PREFIX) and n not in taken
        ),
        coded_states=row_coded,
        elem_states=coded(ELEM_STATE_PREFIX, elem_states),
    )


def _coded(
    table: pa.Table | pa.RecordBatch, states: _Coded, metas: Mapping[str, Any]
) -> dict[str, EncodedRows]:
    """The encoded states of a batch, one per ``metas`` entry (``_Layout``'s columns)."""
    return {
        name: EncodedRows(columns={short: table[n] for short, n in columns}, metadata=metas[name])
        for name, columns in states
    }


def _runs(groups: Sequence[int]) -> list[list[int]]:
    """Splits ascending row-group numbers into runs of consecutive ones (one read per run)."""
    runs: list[list[int]] = []
    for g in groups:
        if runs and runs[-1][-1] == g - 1:
            runs[-1].append(g)
        else:
            runs.append([g])
    return runs
