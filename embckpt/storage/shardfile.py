"""Parquet files of table rows: one block of one table shard, rows sorted by global row id.

Columns: ``row`` (int64 global row id, the only column with statistics, so a reader selects a
row range from row-group statistics alone), the codec's columns (``payload`` and any per-row
parameters), and ``state.<name>`` for each optimizer state. The file's key-value metadata
``embckpt`` holds the codec config and the block's shape. Encodings follow the measurements
in TORCHREC_NOTES.md: no dictionary, delta-coded row ids, plain payload, no generic compression.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embckpt.codecs.base import EncodedRows
from embckpt.errors import CheckpointCorruptError

ROW_COLUMN = "row"
STATE_PREFIX = "state."
ELEM_STATE_PREFIX = "elem."
_META_KEY = b"embckpt"


@dataclass(frozen=True)
class RowBlock:
    """Rows read back from a file: global ids, the codec's columns, optimizer states, metadata."""

    rows: np.ndarray
    encoded: EncodedRows
    row_states: Mapping[str, np.ndarray]
    elem_states: Mapping[str, EncodedRows]
    metadata: Mapping[str, Any]


def encode_file(
    rows: np.ndarray,
    encoded: EncodedRows,
    row_states: Mapping[str, np.ndarray],
    elem_states: Mapping[str, EncodedRows],
    metadata: Mapping[str, Any],
    row_group_rows: int,
) -> pa.Buffer:
    """Builds one Parquet file in memory and returns its bytes."""
    columns: dict[str, pa.Array] = {ROW_COLUMN: pa.array(rows, type=pa.int64())}
    columns.update(encoded.columns)
    for name, values in row_states.items():
        columns[STATE_PREFIX + name] = pa.array(values)
    for name, state in elem_states.items():
        for col, values in state.columns.items():
            columns[f"{ELEM_STATE_PREFIX}{name}.{col}"] = values
    meta = {
        **metadata,
        "codec_meta": dict(encoded.metadata),
        "elem_meta": {name: dict(s.metadata) for name, s in elem_states.items()},
    }
    table = pa.table(columns).replace_schema_metadata({_META_KEY: json.dumps(meta).encode()})
    compression = {name: "none" for name in columns}
    compression.update(encoded.compression)
    sink = pa.BufferOutputStream()
    pq.write_table(
        table,
        sink,
        row_group_size=row_group_rows,
        compression=compression,
        use_dictionary=False,
        write_statistics=[ROW_COLUMN],
        column_encoding={
            name: ("DELTA_BINARY_PACKED" if name == ROW_COLUMN else "PLAIN") for name in columns
        },
    )
    return sink.getvalue()


def decode_file(data: pa.Buffer, path: str, row_lo: int, row_hi: int) -> RowBlock:
    """Reads the rows with global id in [row_lo, row_hi) from a file's bytes.

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
    names = table.column_names
    codec_cols = {
        n: table[n]
        for n in names
        if n != ROW_COLUMN and not n.startswith((STATE_PREFIX, ELEM_STATE_PREFIX))
    }
    row_states = {
        n[len(STATE_PREFIX) :]: table[n].to_numpy() for n in names if n.startswith(STATE_PREFIX)
    }
    elem_states: dict[str, EncodedRows] = {}
    for name, state_meta in meta.get("elem_meta", {}).items():
        prefix = f"{ELEM_STATE_PREFIX}{name}."
        cols = {n[len(prefix) :]: table[n] for n in names if n.startswith(prefix)}
        elem_states[name] = EncodedRows(columns=cols, metadata=state_meta)
    return RowBlock(
        rows=table[ROW_COLUMN].to_numpy(),
        encoded=EncodedRows(columns=codec_cols, metadata=meta.get("codec_meta", {})),
        row_states=row_states,
        elem_states=elem_states,
        metadata=meta,
    )
