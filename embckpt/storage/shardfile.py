"""Parquet files of table rows: one block of one table shard, rows sorted by global row id.

Columns: ``row`` (int64 global row id, the only column with statistics, so a reader selects a
row range from row-group statistics alone), the codec's columns (``payload`` and any per-row
parameters), ``state.<name>`` for each row-wise optimizer state (its values; under a lossy state
codec ``state.<name>.<column>``, the state encoded as a batch [rows, 1]) and
``elem.<name>.<column>`` for each element-wise one. The file's key-value metadata ``embckpt``
holds the codec configs, what they need to decode and the block's shape. Encodings: no
dictionary (row payloads never repeat), delta-coded row ids, BYTE_STREAM_SPLIT float lists
(``raw``, ``fp16``, ``bf16`` payloads and element-wise optimizer state), plain for the rest, no
generic compression unless the codec asks for it (pyarrow's defaults measured about 5x slower
to write on such files), but for the row ids: zstd over their delta-coded bytes, 0.95 -> 0.86
bytes per id in a diff of 54k scattered rows of 1M (the gaps' entropy is 0.66), next to
nothing in a full, whose ids are consecutive.

Partial reads: :func:`index_file` records, at write time, the byte range and CRC32C of every
row group and of the footer (the manifest keeps them, see ``FileIndex``), and combines them into
the whole file's CRC32C, so the writer reads each byte once. :func:`fetch_checked`
then fetches only the footer and the row groups a reader needs, checks each against its
checksum before parsing, and lets Parquet read nothing else: a read outside the verified
ranges is an error, never silently unchecked bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embckpt.codecs.base import Codec, EncodedRows
from embckpt.errors import CheckpointCorruptError, ConfigError
from embckpt.storage import checksum as checksums
from embckpt.storage.manifest import FileIndex, RowGroupEntry

if TYPE_CHECKING:
    import torch

ROW_COLUMN = "row"
STATE_PREFIX = "state."
ELEM_STATE_PREFIX = "elem."
_META_KEY = b"embckpt"
_MAGIC = b"PAR1"
BATCH_BYTES = 8 << 20  # bytes of row groups decoded at a time (at least one row group)
_SLACK_BYTES = 1 << 20  # encode_file's buffer beyond its columns: headers, footer, page index
_SLACK_FRACTION = 0.01

Fetch = Callable[[int, int], "pa.Buffer | bytes"]
"""Reads ``length`` bytes of one file at ``offset``."""


@dataclass(frozen=True)
class RowBlock:
    """Rows read back from a file: global ids, the codec's columns, optimizer states, metadata.

    ``row_states`` are as stored (values, or encoded): :func:`row_state_values` decodes them.
    """

    rows: np.ndarray
    encoded: EncodedRows
    row_states: Mapping[str, np.ndarray | EncodedRows]
    elem_states: Mapping[str, EncodedRows]
    metadata: Mapping[str, Any]


def row_state_columns(
    codec: Codec, states: Mapping[str, torch.Tensor]
) -> dict[str, np.ndarray | EncodedRows]:
    """Row-wise states [rows] as :func:`encode_file` stores them under state codec ``codec``.

    A lossless codec keeps the values as they are (the plain ``state.<name>`` column every
    file had before state codecs applied to row-wise states, 4 bytes a row in fp32); any other
    encodes each state as a batch [rows, 1] (``log8``: 1 byte a row).

    Raises:
        ConfigError: ``codec`` is a delta codec: a reader copies row-wise states (or averages
            them across column blocks), it never adds them to older ones.
    """
    if codec.lossless:
        return {name: values.cpu().numpy() for name, values in states.items()}
    if codec.delta and states:
        raise ConfigError(
            f"optimizer_codec {codec.codec_id!r} is a delta codec; row-wise optimizer states "
            f"({', '.join(sorted(states))}) are restored by copying, never added: use a "
            "lossless codec or 'log8'"
        )
    return {name: codec.encode(values.reshape(-1, 1)) for name, values in states.items()}


def row_state_values(block: RowBlock, codec: Codec) -> dict[str, np.ndarray]:
    """A block's row-wise states as values [rows], the encoded ones decoded by ``codec`` (the
    file's state codec)."""
    return {
        name: values
        if isinstance(values, np.ndarray)
        else codec.decode(values, 1).reshape(-1).numpy()
        for name, values in block.row_states.items()
    }


def encode_file(
    rows: np.ndarray,
    encoded: EncodedRows,
    row_states: Mapping[str, np.ndarray | EncodedRows],
    elem_states: Mapping[str, EncodedRows],
    metadata: Mapping[str, Any],
    row_group_rows: int,
) -> pa.Buffer:
    """Builds one Parquet file in memory and returns its bytes.

    ``row_states`` holds each row-wise state's values, or its encoded batch
    (:func:`row_state_columns`); the encoded ones' metadata goes to ``state_meta``, which
    files without any lack (their bytes are what they were before).
    """
    columns: dict[str, pa.Array] = {ROW_COLUMN: pa.array(rows, type=pa.int64())}
    columns.update(encoded.columns)
    coded_states: dict[str, EncodedRows] = {}
    for name, values in row_states.items():
        if isinstance(values, EncodedRows):
            coded_states[name] = values
        else:
            columns[STATE_PREFIX + name] = pa.array(values)
    coded = {STATE_PREFIX: coded_states, ELEM_STATE_PREFIX: elem_states}
    for prefix, states in coded.items():
        for name, state in states.items():
            columns.update({f"{prefix}{name}.{col}": v for col, v in state.columns.items()})
    meta = {
        **metadata,
        "codec_meta": dict(encoded.metadata),
        "elem_meta": {name: dict(s.metadata) for name, s in elem_states.items()},
    }
    if coded_states:
        meta["state_meta"] = {name: dict(s.metadata) for name, s in coded_states.items()}
    # Every column is required (no row has nulls): Parquet stores no definition levels then.
    schema = pa.schema(
        [pa.field(name, values.type, nullable=False) for name, values in columns.items()],
        metadata={_META_KEY: json.dumps(meta).encode()},
    )
    table = pa.Table.from_arrays(list(columns.values()), schema=schema)
    compression = {name: "none" for name in columns}
    compression[ROW_COLUMN] = "zstd"
    compression.update(encoded.compression)
    for prefix, states in coded.items():
        for name, state in states.items():
            compression.update({f"{prefix}{name}.{col}": c for col, c in state.compression.items()})
    compression = {_leaf(n, table.schema.field(n).type): c for n, c in compression.items()}
    options: dict[str, Any] = {
        "row_group_size": row_group_rows,
        "compression": compression,
        "use_dictionary": False,
        "write_statistics": [ROW_COLUMN],
        "column_encoding": {_leaf(f.name, f.type): _encoding(f.name, f.type) for f in table.schema},
    }
    # Written into one buffer sized from the columns (a growing stream reallocates and copies
    # the file several times over: about 1.6x slower). The file is rarely larger than its
    # columns (page headers, the footer, codec-compressed payloads that did not shrink).
    size = _SLACK_BYTES + sum(
        buf.size
        for column in table.columns
        for chunk in column.chunks
        for buf in chunk.buffers()
        if buf
    ) * (1 + _SLACK_FRACTION)
    buffer = pa.allocate_buffer(int(size))
    sink = pa.FixedSizeBufferWriter(buffer)
    try:
        pq.write_table(table, sink, **options)
    except OSError:  # "write out of bounds": it did not fit after all
        grown = pa.BufferOutputStream()
        pq.write_table(table, grown, **options)
        return grown.getvalue()
    return buffer.slice(0, sink.tell())


def _encoding(name: str, type_: pa.DataType) -> str:
    """Parquet encoding of a column: delta-coded row ids; for rows of floats (``raw``, ``fp16``,
    ``bf16``) BYTE_STREAM_SPLIT, byte k of every value together, so the entropy stage sees
    the exponent bytes apart from the noisy low mantissa bytes (17% smaller with zstd on trained
    fp32 rows, 1% without the split); for variable-length codec columns (Huffman-coded rows)
    delta-coded lengths, about a byte per row instead of PLAIN's four; PLAIN for the rest."""
    if name == ROW_COLUMN:
        return "DELTA_BINARY_PACKED"
    if pa.types.is_fixed_size_list(type_) and pa.types.is_floating(type_.value_type):
        return "BYTE_STREAM_SPLIT"
    if pa.types.is_binary(type_) or pa.types.is_large_binary(type_):
        return "DELTA_LENGTH_BYTE_ARRAY"
    return "PLAIN"


def _leaf(name: str, type_: pa.DataType) -> str:
    """The Parquet column path that per-column write options name: a list column's values."""
    return f"{name}.list.element" if pa.types.is_fixed_size_list(type_) else name


def decode_file(data: pa.Buffer, path: str, row_lo: int, row_hi: int) -> RowBlock:
    """Reads the rows with global id in [row_lo, row_hi) from a whole file's bytes.

    Raises:
        CheckpointCorruptError: the bytes are not a readable embckpt Parquet file.
    """
    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
        meta = json.loads(parquet.schema_arrow.metadata[_META_KEY])
        table = pq.read_table(
            pa.BufferReader(data),
            filters=[(ROW_COLUMN, ">=", row_lo), (ROW_COLUMN, "<", row_hi)],
        )
    except (pa.ArrowException, KeyError, TypeError, ValueError) as exc:
        raise CheckpointCorruptError(path, f"not a readable embckpt Parquet file: {exc}") from exc
    return _row_block(table, meta)


def index_file(data: pa.Buffer) -> FileIndex:
    """The byte ranges and CRC32C of a file's row groups and footer, and the whole file's
    CRC32C combined from them and the leading magic (see module doc): pass it to
    ``CheckpointStore.write_file`` as the file's checksum.
    """
    view = memoryview(data)
    metadata = pq.read_metadata(pa.BufferReader(data))
    footer_offset = len(view) - 8 - int.from_bytes(view[-8:-4], "little")
    groups = []
    start = len(_MAGIC)
    file_crc = checksums.crc32c(data.slice(0, start))
    for i in range(metadata.num_row_groups):
        group = metadata.row_group(i)
        end = max(_chunk_end(group.column(j)) for j in range(group.num_columns))
        stats = group.column(_column_index(metadata, ROW_COLUMN)).statistics
        crc = checksums.crc32c(data.slice(start, end - start))
        file_crc = checksums.combine(file_crc, crc, end - start)
        groups.append(
            RowGroupEntry(
                first_row=int(stats.min),
                last_row=int(stats.max),
                rows=group.num_rows,
                offset=start,
                length=end - start,
                checksum=checksums.tag(crc),
            )
        )
        start = end
    if start != footer_offset:
        raise ValueError(f"row groups end at byte {start}, the footer starts at {footer_offset}")
    footer_crc = checksums.crc32c(data.slice(footer_offset))
    return FileIndex(
        file_checksum=checksums.tag(
            checksums.combine(file_crc, footer_crc, len(view) - footer_offset)
        ),
        footer_offset=footer_offset,
        footer_checksum=checksums.tag(footer_crc),
        row_groups=tuple(groups),
    )


class CheckedFile:
    """Byte ranges of one rows file, fetched and checked against the manifest, ready to decode.

    Call order: :func:`fetch_checked` or :func:`checked_whole` -> ``row_ids`` (the row column
    only: cheap) -> ``read`` (every column) -> ``close``. Parquet reads only the checked
    ranges; a read outside them raises.
    """

    def __init__(
        self,
        path: str,
        size: int,
        metadata: pq.FileMetaData,
        segments: list[tuple[int, pa.Buffer]],
        groups: Sequence[int],
        bytes_read: int,
        source: Any = None,
    ) -> None:
        self.path = path
        self.groups = list(groups)
        self.bytes_read = bytes_read
        self._size = size
        self._metadata = metadata
        self._segments = segments
        self._source = source
        try:
            self.meta: Mapping[str, Any] = json.loads(
                metadata.schema.to_arrow_schema().metadata[_META_KEY]
            )
        except (pa.ArrowException, KeyError, TypeError, ValueError) as exc:
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
        except (pa.ArrowException, OSError, KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptError(
                self.path, f"not a readable embckpt Parquet file: {exc}"
            ) from exc

    def read(self, row_lo: int, row_hi: int) -> Iterator[RowBlock]:
        """The rows with global id in [row_lo, row_hi), ascending, in blocks of a few row
        groups (about ``BATCH_BYTES``) whose columns are single Arrow arrays: decoding works
        through buffers of a bounded size, which the allocators reuse, and copies no more
        than the codec does.

        Raises:
            CheckpointCorruptError: the checked bytes do not parse.
        """
        runs: list[list[int]] = []
        size = BATCH_BYTES
        for g in self.groups:
            group_bytes = self._metadata.row_group(g).total_byte_size
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
                        yield _row_block(batch.slice(lo, hi - lo), self.meta)
        except (pa.ArrowException, OSError, KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptError(
                self.path, f"not a readable embckpt Parquet file: {exc}"
            ) from exc

    def close(self) -> None:
        self._segments = []
        if self._source is not None:
            self._source.close()
            self._source = None

    def _parquet(self) -> pq.ParquetFile:
        source = pa.PythonFile(_VerifiedRanges(self._size, self._segments, self.path), "r")
        return pq.ParquetFile(source, metadata=self._metadata, pre_buffer=False)


def fetch_checked(
    fetch: Fetch,
    size: int,
    index: FileIndex,
    groups: Sequence[int],
    path: str,
    source: Any = None,
) -> CheckedFile:
    """Fetches a file's footer and row groups ``groups`` and checks each against the index.

    Args:
        fetch: reads a byte range of the file.
        size: the file's size, from the manifest.
        index: the file's index, from the manifest.
        groups: ascending row-group numbers to fetch.
        path: the file's path, for messages.
        source: closed by :meth:`CheckedFile.close` (the open file the fetched bytes live in).

    Raises:
        CheckpointCorruptError: a range is short, does not match its checksum, or the footer
            does not parse; the message names the file and the range.
    """
    footer = _checked(
        fetch,
        path,
        index.footer_offset,
        size - index.footer_offset,
        index.footer_checksum,
        "footer",
    )
    segments: list[tuple[int, pa.Buffer]] = []
    bytes_read = footer.size
    for run in _runs(groups):
        first, last = index.row_groups[run[0]], index.row_groups[run[-1]]
        data = _fetch(fetch, path, first.offset, last.offset + last.length - first.offset)
        bytes_read += data.size
        for g in run:
            entry = index.row_groups[g]
            piece = data.slice(entry.offset - first.offset, entry.length)
            _check(
                piece, entry.checksum, path, f"row group {g} (bytes {entry.offset}+{entry.length})"
            )
        segments.append((first.offset, data))
    try:
        metadata = pq.read_metadata(pa.BufferReader(pa.py_buffer(_MAGIC + footer.to_pybytes())))
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise CheckpointCorruptError(path, f"footer does not parse: {exc}") from exc
    if metadata.num_row_groups != len(index.row_groups):
        raise CheckpointCorruptError(
            path,
            f"footer lists {metadata.num_row_groups} row groups, the manifest "
            f"{len(index.row_groups)}",
        )
    return CheckedFile(path, size, metadata, segments, groups, bytes_read, source)


def checked_whole(data: pa.Buffer, path: str) -> CheckedFile:
    """A whole file whose bytes were already checked (by its file-level checksum)."""
    try:
        metadata = pq.read_metadata(pa.BufferReader(data))
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise CheckpointCorruptError(path, f"not a readable Parquet file: {exc}") from exc
    groups = range(metadata.num_row_groups)
    return CheckedFile(path, data.size, metadata, [(0, data)], groups, data.size)


def _row_block(table: pa.Table | pa.RecordBatch, meta: Mapping[str, Any]) -> RowBlock:
    names = table.schema.names
    codec_cols = {
        n: table[n]
        for n in names
        if n != ROW_COLUMN and not n.startswith((STATE_PREFIX, ELEM_STATE_PREFIX))
    }
    coded_states = _coded_states(table, STATE_PREFIX, meta.get("state_meta", {}))
    coded_columns = {
        f"{STATE_PREFIX}{name}.{col}" for name, s in coded_states.items() for col in s.columns
    }
    row_states: dict[str, np.ndarray | EncodedRows] = {
        n[len(STATE_PREFIX) :]: table[n].to_numpy()
        for n in names
        if n.startswith(STATE_PREFIX) and n not in coded_columns
    }
    row_states.update(coded_states)
    elem_states = _coded_states(table, ELEM_STATE_PREFIX, meta.get("elem_meta", {}))
    return RowBlock(
        rows=table[ROW_COLUMN].to_numpy(),
        encoded=EncodedRows(columns=codec_cols, metadata=meta.get("codec_meta", {})),
        row_states=row_states,
        elem_states=elem_states,
        metadata=meta,
    )


def _coded_states(
    table: pa.Table | pa.RecordBatch, prefix: str, metas: Mapping[str, Any]
) -> dict[str, EncodedRows]:
    """The encoded states of a block (``<prefix><name>.<column>``), one per ``metas`` entry."""
    states = {}
    for name, state_meta in metas.items():
        start = f"{prefix}{name}."
        cols = {n[len(start) :]: table[n] for n in table.schema.names if n.startswith(start)}
        states[name] = EncodedRows(columns=cols, metadata=state_meta)
    return states


def _chunk_end(column: Any) -> int:
    start = column.data_page_offset
    if column.has_dictionary_page and column.dictionary_page_offset:
        start = min(start, column.dictionary_page_offset)
    return int(start + column.total_compressed_size)


def _column_index(metadata: pq.FileMetaData, name: str) -> int:
    return metadata.schema.names.index(name)


def _runs(groups: Sequence[int]) -> list[list[int]]:
    """Splits ascending row-group numbers into runs of consecutive ones (one read per run)."""
    runs: list[list[int]] = []
    for g in groups:
        if runs and runs[-1][-1] == g - 1:
            runs[-1].append(g)
        else:
            runs.append([g])
    return runs


def _fetch(fetch: Fetch, path: str, offset: int, length: int) -> pa.Buffer:
    try:
        data = pa.py_buffer(fetch(offset, length))
    except (OSError, pa.ArrowException) as exc:
        raise CheckpointCorruptError(path, f"cannot read bytes {offset}+{length}: {exc}") from exc
    if data.size != length:
        raise CheckpointCorruptError(
            path, f"bytes {offset}+{length}: read {data.size} (file truncated?)"
        )
    return data


def _checked(
    fetch: Fetch, path: str, offset: int, length: int, checksum: str, what: str
) -> pa.Buffer:
    if length <= 0:
        raise CheckpointCorruptError(path, f"{what}: empty range at byte {offset}")
    data = _fetch(fetch, path, offset, length)
    _check(data, checksum, path, f"{what} (bytes {offset}+{length})")
    return data


def _check(data: pa.Buffer, checksum: str, path: str, what: str) -> None:
    try:
        good = checksums.matches(data, checksum)
    except ValueError as exc:
        raise CheckpointCorruptError(path, f"{what}: manifest entry: {exc}") from exc
    if not good:
        algorithm = checksums.algorithm_of(checksum)
        raise CheckpointCorruptError(path, f"{what}: {algorithm} does not match the manifest")


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
