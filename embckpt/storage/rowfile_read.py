"""Reading rows files (the format: ``rowfile.py``): checked byte ranges, then decoded batches.

A reader gets a :class:`CheckedFile` from ``CheckpointStore.open_rows``: the footer and the row
groups it asked for, fetched and each checked against the manifest's index before anything is
parsed. Parquet then reads through a file object that serves only those checked ranges, so a
read outside them is an error, never silently unchecked bytes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

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

BATCH_BYTES = 8 << 20  # bytes of row groups decoded at a time (at least one row group)
_PARSE_ERRORS = (pa.ArrowException, OSError, KeyError, TypeError, ValueError)


class RangeSource(Protocol):
    """An open file to fetch byte ranges from (a ``pyarrow`` file or memory map)."""

    def seek(self, position: int) -> int: ...

    def read_buffer(self, nbytes: int) -> pa.Buffer: ...

    def close(self) -> None: ...


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
    except _PARSE_ERRORS as exc:
        raise CheckpointCorruptError(path, f"not a readable embckpt Parquet file: {exc}") from exc
    return _row_batch(table, header)


class CheckedFile:
    """Byte ranges of one rows file, fetched and checked against the manifest, ready to decode.

    Call order: ``CheckpointStore.open_rows`` -> ``row_ids`` (the row column only: cheap) ->
    ``read`` (every column) -> ``close``. Parquet reads only the checked ranges; a read
    outside them raises.

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
    ) -> None:
        self.path = path
        self.groups = list(groups)
        self.bytes_read = bytes_read
        self._size = size
        self._footer = footer  # the Parquet footer, parsed
        self._segments = segments
        self._source = source
        try:
            header = json.loads(footer.schema.to_arrow_schema().metadata[HEADER_KEY])
            if (BLOCKS_KEY in header) != (block is not None):
                raise ValueError(
                    f"the manifest says block {block}, the file is "
                    + ("packed" if BLOCKS_KEY in header else "not packed")
                )
            self.header: Mapping[str, Any] = header if block is None else header[BLOCKS_KEY][block]
        except _PARSE_ERRORS as exc:
            raise CheckpointCorruptError(path, f"not an embckpt Parquet file: {exc}") from exc

    def row_ids(self) -> np.ndarray:
        """The global row ids stored in the checked row groups, ascending.

        Raises:
            CheckpointCorruptError: the checked bytes do not parse.
        """
        try:
            table = self._parquet().read_row_groups(
                self.groups, columns=[ROW_COLUMN], use_threads=False
            )
            return table[ROW_COLUMN].to_numpy()
        except _PARSE_ERRORS as exc:
            raise CheckpointCorruptError(
                self.path, f"not a readable embckpt Parquet file: {exc}"
            ) from exc

    def read(self, row_lo: int, row_hi: int) -> Iterator[RowBatch]:
        """The rows with global id in [row_lo, row_hi), ascending, in batches of a few row
        groups (about ``BATCH_BYTES``) whose columns are single Arrow arrays: decoding works
        through buffers of a bounded size, which the allocators reuse, and copies no more
        than the codec does.

        Raises:
            CheckpointCorruptError: the checked bytes do not parse.
        """
        runs: list[list[int]] = []
        size = BATCH_BYTES
        for g in self.groups:
            group_bytes = self._footer.row_group(g).total_byte_size
            if size + group_bytes > BATCH_BYTES:
                runs.append([])
                size = 0
            runs[-1].append(g)
            size += group_bytes
        parquet = self._parquet()
        try:
            for run in runs:
                table = parquet.read_row_groups(run, use_threads=False)
                for batch in table.to_batches():
                    ids = batch[ROW_COLUMN].to_numpy()
                    lo, hi = np.searchsorted(ids, [row_lo, row_hi])
                    if hi > lo:
                        yield _row_batch(batch.slice(lo, hi - lo), self.header)
        except _PARSE_ERRORS as exc:
            raise CheckpointCorruptError(
                self.path, f"not a readable embckpt Parquet file: {exc}"
            ) from exc

    def read_all(self) -> RowBatch:
        """Every row of the checked row groups in one batch (columns of several chunks).

        Raises:
            CheckpointCorruptError: the checked bytes do not parse.
        """
        try:
            table = self._parquet().read_row_groups(self.groups, use_threads=False)
        except _PARSE_ERRORS as exc:
            raise CheckpointCorruptError(
                self.path, f"not a readable embckpt Parquet file: {exc}"
            ) from exc
        return _row_batch(table, self.header)

    def compression(self) -> dict[str, str]:
        """The Parquet compression each column of the checked row groups was written with
        (``none`` for uncompressed), keyed by column name (a float list by its own name)."""
        if not self.groups:
            return {}
        group = self._footer.row_group(self.groups[0])
        found = {}
        for i in range(group.num_columns):
            codec = group.column(i).compression.lower()
            name = group.column(i).path_in_schema.removesuffix(".list.element")
            found[name] = "none" if codec == "uncompressed" else codec
        return found

    def close(self) -> None:
        self._segments = []
        if self._source is not None:
            self._source.close()
            self._source = None

    def _parquet(self) -> pq.ParquetFile:
        source = pa.PythonFile(_VerifiedRanges(self._size, self._segments, self.path), "r")
        return pq.ParquetFile(source, metadata=self._footer, pre_buffer=False)


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
        verify(
            footer,
            index.footer_checksum,
            path,
            f"footer (bytes {index.footer_offset}+{footer_length})",
        )
        segments: list[tuple[int, pa.Buffer]] = []
        for run in _runs(groups):
            first, last = index.row_groups[run[0]], index.row_groups[run[-1]]
            data = fetched(first.offset, last.offset + last.length - first.offset)
            for g in run:
                group = index.row_groups[g]
                part = data.slice(group.offset - first.offset, group.length)
                verify(
                    part,
                    group.checksum,
                    path,
                    f"row group {g} (bytes {group.offset}+{group.length})",
                )
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
        return CheckedFile(
            path, size, parsed, segments, parquet_groups, fetched.bytes, source, block
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


def _row_batch(table: pa.Table | pa.RecordBatch, header: Mapping[str, Any]) -> RowBatch:
    names = table.schema.names
    codec_cols = {
        n: table[n]
        for n in names
        if n not in BLOCK_COLUMNS and not n.startswith((STATE_PREFIX, ELEM_STATE_PREFIX))
    }
    coded_states = _coded_states(table, STATE_PREFIX, header.get("state_meta", {}))
    coded_columns = {
        f"{STATE_PREFIX}{name}.{col}" for name, s in coded_states.items() for col in s.columns
    }
    row_states: dict[str, np.ndarray | EncodedRows] = {
        n[len(STATE_PREFIX) :]: table[n].to_numpy()
        for n in names
        if n.startswith(STATE_PREFIX) and n not in coded_columns
    }
    row_states.update(coded_states)
    elem_states = _coded_states(table, ELEM_STATE_PREFIX, header.get("elem_meta", {}))
    return RowBatch(
        rows=table[ROW_COLUMN].to_numpy(),
        encoded=EncodedRows(columns=codec_cols, metadata=header.get("codec_meta", {})),
        row_states=row_states,
        elem_states=elem_states,
        header=header,
    )


def _coded_states(
    table: pa.Table | pa.RecordBatch, prefix: str, metas: Mapping[str, Any]
) -> dict[str, EncodedRows]:
    """The encoded states of a batch (``<prefix><name>.<column>``), one per ``metas`` entry."""
    states = {}
    for name, state_meta in metas.items():
        start = f"{prefix}{name}."
        cols = {n[len(start) :]: table[n] for n in table.schema.names if n.startswith(start)}
        states[name] = EncodedRows(columns=cols, metadata=state_meta)
    return states


def _runs(groups: Sequence[int]) -> list[list[int]]:
    """Splits ascending row-group numbers into runs of consecutive ones (one read per run)."""
    runs: list[list[int]] = []
    for g in groups:
        if runs and runs[-1][-1] == g - 1:
            runs[-1].append(g)
        else:
            runs.append([g])
    return runs


class _VerifiedRanges:
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
