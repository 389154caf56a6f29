"""The shared round trip every codec test (and any test of a new codec) goes through.

``round_trip`` encodes rows, writes them into a real Parquet row file with
``storage.rowfile_write.encode_file``, reads back a row range with ``decode_file``, rebuilds the
codec from the file's metadata alone (as a restore does) and decodes. It checks what must hold
for every codec: one Parquet row per embedding row, the decoded shape, float32 output for lossy
codecs and the input dtype for lossless ones.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from embckpt.codecs.base import Codec, EncodedRows, codec_from_config
from embckpt.storage.rowfile_read import decode_file
from embckpt.storage.rowfile_write import encode_file


def round_trip(
    codec: Codec,
    rows: torch.Tensor,
    *,
    row_range: tuple[int, int] | None = None,
    row_group_rows: int = 64,
) -> torch.Tensor:
    """Encodes ``rows``, stores them in a Parquet row file, reads ``row_range`` back, decodes.

    Args:
        codec: the codec under test.
        rows: [n, cols] rows; their global row ids are 0..n-1.
        row_range: [lo, hi) of rows to read back (default: all).
        row_group_rows: Parquet row-group size (small, so range reads cross groups).

    Returns:
        The decoded rows of ``row_range``, a CPU tensor.
    """
    n, cols = rows.shape
    lo, hi = row_range if row_range is not None else (0, n)
    encoded = codec.encode(rows)
    check_encoded(encoded, n)
    data = encode_file(
        rows=np.arange(n, dtype=np.int64),
        encoded=encoded,
        row_states={},
        elem_states={},
        metadata={"codec": codec.get_config()},
        row_group_rows=row_group_rows,
    )
    batch = decode_file(data, "round_trip.parquet", lo, hi)
    assert list(batch.rows) == list(range(lo, min(hi, n)))
    reader = codec_from_config(batch.header["codec"])
    decoded = reader.decode(batch.encoded, cols)
    assert decoded.device.type == "cpu"
    assert tuple(decoded.shape) == (len(batch.rows), cols)
    assert decoded.dtype == (rows.dtype if codec.lossless else torch.float32)
    return decoded


def check_encoded(encoded: EncodedRows, n: int) -> None:
    """Asserts the contract of ``EncodedRows``: one entry per row, JSON-able metadata."""
    import json

    for name, column in encoded.columns.items():
        assert len(column) == n, f"column {name!r} has {len(column)} entries for {n} rows"
    json.dumps(dict(encoded.metadata))
    assert set(encoded.compression) <= set(encoded.columns)


def encoded_bytes_per_row(encoded: EncodedRows) -> float:
    """Bytes per row the codec's columns hold, before Parquet (payload and per-row params;
    for variable-size columns, the bytes themselves without Arrow's offsets)."""
    total = 0
    n = 0
    for column in encoded.columns.values():
        n = len(column)
        buffers: Any = column.buffers()
        total += buffers[-1].size if len(buffers) == 3 else column.nbytes
    return total / max(n, 1)
