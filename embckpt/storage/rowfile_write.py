"""Writing rows files (the format: ``rowfile.py``): encode a block's rows into one Parquet
file, or several small blocks into one packed file, and index its row groups for partial reads.
A save streams each file into its destination (:class:`RowsFile`), indexing it on the way;
:func:`encode_file` builds one in memory (merges, tests, benchmarks)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embckpt.codecs.base import Codec, EncodedRows
from embckpt.storage import checksum as checksums
from embckpt.storage.manifest import FileIndex, RowGroupEntry
from embckpt.storage.rowfile import (
    BLOCKS_KEY,
    COL_COLUMN,
    ELEM_STATE_PREFIX,
    HEADER_KEY,
    MAGIC,
    ROW_COLUMN,
    STATE_PREFIX,
    TABLE_COLUMN,
)
from embckpt.storage.sink import ChecksumSink, StreamedFile

if TYPE_CHECKING:
    import torch

_SLACK_BYTES = 1 << 20  # encode_file's buffer beyond its columns: headers, footer, page index
_SLACK_FRACTION = 0.01


def row_state_columns(
    codec: Codec, states: Mapping[str, torch.Tensor]
) -> dict[str, np.ndarray | EncodedRows]:
    """Row-wise states [rows] as :func:`encode_file` stores them under state codec ``codec``.

    A lossless codec keeps the values as they are (a plain ``state.<name>`` column, 4 bytes a
    row in fp32); any other encodes each state as a batch [rows, 1] (``log8``: 1 byte a row).

    An additive codec never reaches here: ``CheckpointConfig`` refuses one as
    ``optimizer_codec`` (states are restored as written, never added to).
    """
    if codec.lossless:
        return {name: values.cpu().numpy() for name, values in states.items()}
    return {name: codec.encode(values.reshape(-1, 1)) for name, values in states.items()}


@dataclass(frozen=True)
class BlockColumns:
    """One block's rows as the columns of a rows file, not written yet (:func:`block_columns`).

    Blocks whose ``schema_key`` is equal can share a packed file (:func:`encode_packed`).
    """

    table: pa.Table  # the columns, without the header
    compression: dict[str, str]  # Parquet compression by column name
    header: dict[str, Any]  # the block's header (see rowfile.py)

    @property
    def schema_key(self) -> tuple[Any, ...]:
        """What blocks packed together must share: column names, types and compression."""
        fields = tuple((f.name, str(f.type)) for f in self.table.schema)
        return fields, tuple(sorted(self.compression.items()))

    @property
    def nbytes(self) -> int:
        """The bytes of the block's columns in memory (about its size in the file; the
        dictionary-coded ``table`` and ``col`` are next to nothing there)."""
        return sum(
            buf.size
            for name, column in zip(self.table.column_names, self.table.columns, strict=True)
            if name not in (TABLE_COLUMN, COL_COLUMN)
            for chunk in column.chunks
            for buf in chunk.buffers()
            if buf
        )


def _constant(value: Any, type_: pa.DataType, count: int) -> pa.Array:
    """``count`` times ``value``, as a dictionary array (one value, ``count`` indices)."""
    indices = pa.array(np.zeros(count, dtype=np.int32))
    return pa.DictionaryArray.from_arrays(indices, pa.array([value], type=type_))


def block_columns(
    rows: np.ndarray,
    encoded: EncodedRows,
    row_states: Mapping[str, np.ndarray | EncodedRows],
    elem_states: Mapping[str, EncodedRows],
    metadata: Mapping[str, Any],
) -> BlockColumns:
    """A block's columns and header: its row ids, table and first column, the codec's
    columns, its row-wise states (values, or encoded: :func:`row_state_columns`) and its
    element-wise states. The encoded states' metadata goes to the header's ``state_meta``,
    absent when no state is encoded. ``metadata`` holds ``table`` and ``col_offset``."""
    count = len(rows)
    columns: dict[str, pa.Array] = {
        ROW_COLUMN: pa.array(rows, type=pa.int64()),
        TABLE_COLUMN: _constant(str(metadata.get("table", "")), pa.string(), count),
        COL_COLUMN: _constant(int(metadata.get("col_offset", 0)), pa.int32(), count),
    }
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
        [pa.field(name, values.type, nullable=False) for name, values in columns.items()]
    )
    table = pa.Table.from_arrays(list(columns.values()), schema=schema)
    compression = {name: "none" for name in columns}
    compression.update(encoded.compression)
    for prefix, states in coded.items():
        for name, state in states.items():
            compression.update({f"{prefix}{name}.{col}": c for col, c in state.compression.items()})
    return BlockColumns(table, compression, meta)


def encode_file(
    rows: np.ndarray,
    encoded: EncodedRows,
    row_states: Mapping[str, np.ndarray | EncodedRows],
    elem_states: Mapping[str, EncodedRows],
    metadata: Mapping[str, Any],
    row_group_rows: int,
) -> pa.Buffer:
    """Builds the rows file of one block in memory and returns its bytes (the columns:
    :func:`block_columns`)."""
    block = block_columns(rows, encoded, row_states, elem_states, metadata)
    return encode_block(block, row_group_rows)


def encode_block(block: BlockColumns, row_group_rows: int) -> pa.Buffer:
    """The rows file of one block alone."""
    return _write([block], block.header, row_group_rows)


def encode_packed(blocks: Sequence[BlockColumns], row_group_rows: int) -> pa.Buffer:
    """Builds one packed rows file of ``blocks`` (equal ``schema_key``), each block in row
    groups of its own, in order; the header lists each block's header (``blocks``)."""
    if not blocks or len({b.schema_key for b in blocks}) != 1:
        raise ValueError("a packed file needs blocks of one schema")
    return _write(blocks, {BLOCKS_KEY: [b.header for b in blocks]}, row_group_rows)


def _header_schema(blocks: Sequence[BlockColumns], header: Mapping[str, Any]) -> pa.Schema:
    return blocks[0].table.schema.with_metadata({HEADER_KEY: json.dumps(header).encode()})


def _options(block: BlockColumns, schema: pa.Schema) -> dict[str, Any]:
    """The ParquetWriter settings of a rows file (its compression and encodings by column)."""
    compression = {_leaf(n, schema.field(n).type): c for n, c in block.compression.items()}
    dictionary = [TABLE_COLUMN, COL_COLUMN]
    return {
        "compression": compression,
        "use_dictionary": dictionary,
        "write_statistics": [ROW_COLUMN, TABLE_COLUMN],
        "column_encoding": {
            _leaf(f.name, f.type): _encoding(f.name, f.type)
            for f in schema
            if f.name not in dictionary
        },
    }


def _write(
    blocks: Sequence[BlockColumns], header: Mapping[str, Any], row_group_rows: int
) -> pa.Buffer:
    schema = _header_schema(blocks, header)
    options = _options(blocks[0], schema)

    def write(sink: Any) -> None:
        with pq.ParquetWriter(sink, schema, **options) as out:
            for block in blocks:
                out.write_table(block.table, row_group_size=row_group_rows)

    # Written into one buffer sized from the columns (a growing stream reallocates and copies
    # the file several times over: about 1.6x slower). The file is rarely larger than its
    # columns (page headers, the footer, codec-compressed payloads that did not shrink).
    size = _SLACK_BYTES + sum(b.nbytes for b in blocks) * (1 + _SLACK_FRACTION)
    buffer = pa.allocate_buffer(int(size))
    sink = pa.FixedSizeBufferWriter(buffer)
    try:
        write(sink)
    except OSError:  # "write out of bounds": it did not fit after all
        grown = pa.BufferOutputStream()
        write(grown)
        return grown.getvalue()
    return buffer.slice(0, sink.tell())


class RowsFile(StreamedFile):
    """The rows file of one block (``packed`` False) or a packed file of several (equal
    ``schema_key``, each in row groups of its own), written straight into its destination.

    The bytes are those :func:`encode_block` and :func:`encode_packed` build in memory; the
    index (``index``, set by a complete write) is the one :func:`index_file` reads back from
    them, computed as the file streams: the sink cuts a segment after the magic, after each
    row group (one ``write_table`` call each, which the writer flushes whole) and at the end,
    and each cut is checked against the row-group ranges the footer records.
    """

    def __init__(
        self, blocks: Sequence[BlockColumns], row_group_rows: int, packed: bool = False
    ) -> None:
        if not blocks or (packed and len({b.schema_key for b in blocks}) != 1):
            raise ValueError("a packed file needs blocks of one schema")
        if not packed and len(blocks) != 1:
            raise ValueError("an unpacked rows file holds one block")
        self.blocks = list(blocks)
        self.row_group_rows = row_group_rows
        self.header = {BLOCKS_KEY: [b.header for b in blocks]} if packed else blocks[0].header
        self.index: FileIndex | None = None

    def produce(self, sink: ChecksumSink) -> None:
        self.index = None
        schema = _header_schema(self.blocks, self.header)
        writer = pq.ParquetWriter(sink, schema, **_options(self.blocks[0], schema))
        cuts = []
        try:
            _, magic, _, _ = sink.cut()
            if magic != len(MAGIC):
                raise ValueError(f"the Parquet writer began with {magic} bytes, not its magic")
            step = self.row_group_rows
            for block in self.blocks:
                for start in range(0, max(block.table.num_rows, 1), step):
                    writer.write_table(block.table.slice(start, step), row_group_size=step)
                    cuts.append(sink.cut())
        finally:
            writer.close()
        footer_offset, _, footer_crc, footer_digest = sink.cut()
        metadata = writer.writer.metadata
        self.index = FileIndex(
            file_checksum=sink.checksum,
            footer_offset=footer_offset,
            footer_checksum=checksums.tag(footer_crc),
            row_groups=_streamed_groups(metadata, [c for c in cuts if c[1]]),
            footer_digest=footer_digest,
        )


def _streamed_groups(
    metadata: pq.FileMetaData, cuts: Sequence[tuple[int, int, int, str]]
) -> tuple[RowGroupEntry, ...]:
    """The index entries of a streamed file's row groups: their ranges and CRCs as cut while
    streaming, checked against the ranges and taken with the row-id bounds the footer
    records."""
    if metadata.num_row_groups != len(cuts):
        raise ValueError(f"{metadata.num_row_groups} row groups, {len(cuts)} streamed")
    groups = []
    start = len(MAGIC)
    for i, (offset, length, crc, sha) in enumerate(cuts):
        group = metadata.row_group(i)
        end = max(_chunk_end(group.column(j)) for j in range(group.num_columns))
        if (offset, offset + length) != (start, end):
            raise ValueError(f"row group {i} streamed as bytes {offset}+{length}, not {start}+")
        stats = group.column(_column_index(metadata, ROW_COLUMN)).statistics
        groups.append(
            RowGroupEntry(
                first_row=int(stats.min),
                last_row=int(stats.max),
                rows=group.num_rows,
                offset=start,
                length=length,
                checksum=checksums.tag(crc),
                digest=sha,
            )
        )
        start = end
    return tuple(groups)


def block_indexes(index: FileIndex, rows: Sequence[int]) -> list[FileIndex]:
    """A packed file's index cut per block: block i (``rows[i]`` rows, in file order) gets
    its own row groups, numbered from ``first_group``."""
    cut = []
    group = 0
    for count in rows:
        first, held = group, 0
        while held < count:
            held += index.row_groups[group].rows
            group += 1
        if held != count:
            raise ValueError(f"row groups of {held} rows where the block has {count}")
        cut.append(replace(index, row_groups=index.row_groups[first:group], first_group=first))
    if group != len(index.row_groups):
        raise ValueError(f"{len(index.row_groups) - group} row groups beyond the blocks")
    return cut


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


def index_file(data: pa.Buffer) -> FileIndex:
    """The byte ranges and CRC32C of a file's row groups and footer, and the whole file's
    CRC32C combined from them and the leading magic (see module doc): pass it to
    ``CheckpointStore.write_file`` as the file's checksum.
    """
    view = memoryview(data)
    metadata = pq.read_metadata(pa.BufferReader(data))
    footer_offset = len(view) - 8 - int.from_bytes(view[-8:-4], "little")
    groups = []
    start = len(MAGIC)
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


def _chunk_end(column: Any) -> int:
    start = column.data_page_offset
    if column.has_dictionary_page and column.dictionary_page_offset:
        start = min(start, column.dictionary_page_offset)
    return int(start + column.total_compressed_size)


def _column_index(metadata: pq.FileMetaData, name: str) -> int:
    return metadata.schema.names.index(name)
