"""``fp16`` and ``bf16``: rows rounded to a 16-bit float, the cheap lossy baselines; and the
float-list payload layout they share with ``raw``.

Format (version 2): the ``payload`` column is a Parquet list of ``cols`` floats per row (an
Arrow fixed-size list), so DuckDB, pandas and Spark read a row as an array of numbers. fp16 and
bf16 values are stored as the float32 values they equal exactly: Parquet has no bf16 type, and
its FLOAT16 (a 2-byte FIXED_LEN_BYTE_ARRAY) takes BYTE_STREAM_SPLIT in pyarrow 26 but DuckDB
2.0 refuses to read it so encoded. ``storage/rowfile_write.py`` writes float lists with
BYTE_STREAM_SPLIT encoding (byte k of every value together), so the ``zstd`` stage (the
default) finds the exponent bytes' redundancy and drops the low bytes a widened 16-bit value
leaves zero (``none`` stores 4 bytes per value; ``lz4`` removes less than zstd).
``huffman`` keeps the version-1 layout: each row's 16-bit values (little-endian) coded per byte
position in a binary column. Version-1 files (payload bytes in a fixed-size binary column) still
decode: the reader goes by the column's type.

Rounding is to nearest even: the error per element is at most ``2**-11 * |x|`` for fp16 (plus
``2**-25`` absolute below fp16's normal range, where values become subnormal or zero) and
``2**-8 * |x|`` for bf16. Values fp16 cannot hold (beyond 65504) are refused rather than stored
as infinity; bf16 holds fp32's whole range.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import torch

from embckpt.codecs.base import EncodedRows, one_array, register
from embckpt.codecs.common import PAYLOAD, StagedCodec, float_rows, float_tables
from embckpt.errors import CodecError

# The Parquet float type each row dtype is stored as (16-bit floats widened exactly).
_STORED: dict[torch.dtype, tuple[torch.dtype, pa.DataType]] = {
    torch.float32: (torch.float32, pa.float32()),
    torch.float64: (torch.float64, pa.float64()),
    torch.float16: (torch.float32, pa.float32()),
    torch.bfloat16: (torch.float32, pa.float32()),
}


def float_list_column(rows: torch.Tensor) -> pa.FixedSizeListArray:
    """Rows [n, cols] of a float dtype as a fixed-size list column of Parquet floats; zero-copy
    for float32 and float64, 16-bit floats are widened to float32."""
    stored, arrow_type = _STORED[rows.dtype]
    host = rows.detach().to(device="cpu", dtype=stored).contiguous()
    n, cols = host.shape
    values = pa.Array.from_buffers(
        arrow_type, n * cols, [None, pa.py_buffer(host.view(torch.uint8).numpy())]
    )
    # Required (non-null) values: Parquet then stores no definition levels for them, and
    # pyarrow reads the column back about 8x faster than a nullable one (measured).
    element = pa.field("element", arrow_type, nullable=False)
    return pa.FixedSizeListArray.from_arrays(values, type=pa.list_(element, cols))


def is_float_list(column: pa.Array | pa.ChunkedArray) -> bool:
    """True for a version-2 float-list payload column."""
    return pa.types.is_fixed_size_list(column.type) and pa.types.is_floating(column.type.value_type)


def float_list_rows(column: pa.Array | pa.ChunkedArray, num_cols: int) -> torch.Tensor:
    """The rows [n, num_cols] of a float-list column, in the float type it stores (one copy).

    Raises:
        CodecError: the rows are not ``num_cols`` wide, or hold nulls.
    """
    column = one_array(column)
    if column.type.list_size != num_cols:
        raise CodecError(f"payload rows hold {column.type.list_size} values, expected {num_cols}")
    values = column.flatten()
    if column.null_count or values.null_count:
        raise CodecError("float payload column has nulls")
    flat = values.to_numpy(zero_copy_only=True).copy()  # Arrow's buffers are read-only
    return torch.from_numpy(flat).reshape(len(column), num_cols)


class _HalfCodec(StagedCodec):
    dtype: ClassVar[torch.dtype]
    format_version = 2
    rows_independent = True

    def _options(self) -> dict[str, Any]:
        return {"entropy": self.entropy}

    def encode(self, rows: torch.Tensor) -> EncodedRows:
        x = float_rows(rows, self.codec_id)
        half = x.to(self.dtype)
        # One reduction clears the common case; only a non-finite sum (an overflow, or a real
        # overflow of the cast) pays for the per-row check.
        bad = (
            ~torch.isfinite(half).all(dim=1)
            if x.numel() and not bool(torch.isfinite(half.float().sum()))
            else None
        )
        if bad is not None and bool(bad.any()):
            row = int(torch.nonzero(bad)[0, 0])
            raise CodecError(
                f"codec {self.codec_id!r}: row {row} of the batch holds a value beyond "
                f"{self.dtype}'s range ({float(x[row].abs().max()):.4g}); use 'bf16' or 'raw'"
            )
        if self.entropy != "huffman":
            hint = {PAYLOAD: self.entropy} if self.entropy != "none" else {}
            return EncodedRows(
                columns={PAYLOAD: float_list_column(half)},
                metadata={"entropy": self.entropy},
                compression=hint,
            )
        payload = half.view(torch.int16).cpu().numpy().view(np.uint8)
        column, meta, hint = self._payload_column(payload, float_tables(payload.shape[1], 2))
        return EncodedRows(columns={PAYLOAD: column}, metadata=meta, compression=hint)

    def decode(self, encoded: EncodedRows, num_cols: int) -> torch.Tensor:
        column = encoded.columns[PAYLOAD]
        if is_float_list(column):
            return float_list_rows(column, num_cols).to(self.dtype).float()
        data = self._payload_bytes(encoded, 2 * num_cols)
        values = torch.from_numpy(np.ascontiguousarray(data).view(np.int16).copy())
        return values.view(self.dtype).float()


@register
class Fp16Codec(_HalfCodec):
    """Rows as IEEE fp16: 2 bytes per value, about 3 significant digits."""

    codec_id = "fp16"
    dtype = torch.float16


@register
class Bf16Codec(_HalfCodec):
    """Rows as bfloat16: 2 bytes per value, fp32's range, about 2 significant digits."""

    codec_id = "bf16"
    dtype = torch.bfloat16
