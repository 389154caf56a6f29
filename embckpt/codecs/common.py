"""What the lossy codecs share: option checks, the finiteness guard and the entropy stage.

Contract of the entropy stage: a codec hands over its per-row payload as bytes [n, w] (packed
codes, or the raw bytes of fp16 values) and gets back one Parquet column with one entry per
row, plus the metadata and compression hint that describe it:

- ``none``: a fixed-size binary column of the bytes as they are;
- ``zstd`` / ``lz4``: the same column, compressed by Parquet page by page (row-range reads
  still work; the codec itself stays a pure function of the rows);
- ``huffman``: canonical Huffman over the payload bytes, one byte-aligned bit string per row in
  a variable-size binary column, with one code table per group of byte columns that share a
  distribution (the packed codes; each byte of a row's scale and bias; each byte position of a
  float), the tables in the metadata (see ``huffman.py``).

Coding packed bytes rather than individual codes lets one byte-wide alphabet serve every bit
width and amortises Huffman's per-symbol rounding over the codes a byte holds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from embckpt.codecs import huffman
from embckpt.codecs.base import (
    Codec,
    EncodedRows,
    as_binary,
    fixed_binary_column,
    fixed_binary_values,
    one_array,
)
from embckpt.errors import CodecError, ConfigError

ENTROPY_STAGES = ("none", "huffman", "zstd", "lz4")
#: The stage lossy codecs use unless told otherwise, chosen on trained tables
#: (benchmarks/results/codecs.json): on disk, Huffman and zstd end within 1.5% of each other for
#: quantized rows (Huffman ahead for asymmetric/adaptive/kmeans, zstd for symmetric), Huffman
#: is 6-12% smaller for fp16/bf16; zstd encodes about 2x and decodes about 2.5x faster, and on
#: exponent symbols (mostly zeros) zstd's matches beat Huffman's one-bit-per-byte floor 4-8x.
DEFAULT_ENTROPY = "zstd"
#: The stage of the uniform quantizers (``asymmetric``, ``symmetric``, ``adaptive``) unless told
#: otherwise: none. Their codes are near incompressible: on trained rows zstd saved 3.4%
#: (adaptive, 4 bits), 4.2% (asymmetric) and 11% (symmetric), and 0-4.4% on the fulls of
#: ``benchmarks/family.py``, while a restore decompresses every byte on one core before
#: decoding it: a 4-bit full of the 10.2M-row model took 327 ms with zstd and 216 ms without
#: (``dcp.load``: 458 ms; best of 6, 2 ranks), for 4.3% more bytes. Diffs keep zstd (the
#: delta codec's own stage): their mixed widths and zero changes compress by a fifth.
UNIFORM_ENTROPY = "none"
PAYLOAD = "payload"


def check_bits(codec_id: str, bits: object, allowed: tuple[int, ...]) -> int:
    """Validates a bit width option.

    Raises:
        ConfigError: ``bits`` is not one of ``allowed``.
    """
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in allowed:
        raise ConfigError(f"codec {codec_id!r}: bits must be one of {allowed}, got {bits!r}")
    return bits


def check_entropy(codec_id: str, entropy: object) -> str:
    """Validates an entropy stage option.

    Raises:
        ConfigError: ``entropy`` is not one of ``ENTROPY_STAGES``.
    """
    if entropy not in ENTROPY_STAGES:
        raise ConfigError(
            f"codec {codec_id!r}: entropy must be one of {ENTROPY_STAGES}, got {entropy!r}"
        )
    return str(entropy)


def float_rows(rows: torch.Tensor, codec_id: str, check: bool = True) -> torch.Tensor:
    """``rows`` as a contiguous float32 matrix on its own device, refusing NaN and infinity.

    ``check=False`` skips the finiteness check for callers that prove it more cheaply from
    their own reductions (and call :func:`require_finite` when those say otherwise).

    Raises:
        CodecError: ``rows`` is not 2-D, or holds NaN or an infinity (the message gives the
            first offending row), which a lossy codec cannot represent.
    """
    if rows.dim() != 2:
        raise CodecError(f"codec {codec_id!r}: expected rows [n, cols], got shape {rows.shape}")
    x = rows.detach()
    if x.dtype != torch.float32:
        x = x.float()
    x = x.contiguous()
    # One reduction proves the common case: a finite sum means no NaN and no infinity. Only a
    # suspicious sum (possibly an overflow of huge but finite values) pays for the exact check.
    if check and x.numel() and not bool(torch.isfinite(x.sum())):
        require_finite(x, codec_id)
    return x


def require_finite(x: torch.Tensor, codec_id: str) -> None:
    """Raises CodecError naming the first row of ``x`` that holds NaN or an infinity."""
    bad = ~torch.isfinite(x).all(dim=1)
    if bool(bad.any()):
        row = int(torch.nonzero(bad)[0, 0])
        kind = "NaN" if bool(torch.isnan(x[row]).any()) else "an infinity"
        raise CodecError(
            f"codec {codec_id!r}: row {row} of the batch holds {kind}; a lossy codec cannot "
            "encode it (use codec 'raw' to store such rows bit-exactly)"
        )


def binary_payload(encoded: EncodedRows, below_bytes: int, like: EncodedRows) -> EncodedRows:
    """``encoded`` with a fixed-size payload under ``below_bytes`` made binary
    (:func:`~embckpt.codecs.base.as_binary`; decoders read both) and compressed as ``like``'s
    payload: packed rows files group blocks by column types and compression, and a ``delta``
    diff's payload (``like``) is binary, compressed by its own stage."""
    column = encoded.columns.get(PAYLOAD)
    if not isinstance(column, pa.FixedSizeBinaryArray) or column.nbytes >= below_bytes:
        return encoded
    compression = {k: v for k, v in encoded.compression.items() if k != PAYLOAD}
    if PAYLOAD in like.compression:
        compression[PAYLOAD] = like.compression[PAYLOAD]
    columns = {**encoded.columns, PAYLOAD: as_binary(column)}
    return dataclasses.replace(encoded, columns=columns, compression=compression)


class StagedCodec(Codec):
    """A codec whose payload bytes pass through a selectable entropy stage.

    Subclasses call :meth:`_payload_column` when encoding and :meth:`_payload_bytes` when
    decoding. The Huffman table cache lives on the instance: a checkpointer keeps one codec for
    its whole run, so consecutive checkpoints share tables while they stay nearly optimal.
    """

    def __init__(self, entropy: str = DEFAULT_ENTROPY) -> None:
        self.entropy = check_entropy(self.codec_id, entropy)
        self._tables = huffman.TableCache()

    def _payload_column(
        self, payload: np.ndarray, column_tables: np.ndarray | None = None
    ) -> tuple[pa.Array, dict[str, Any], dict[str, str]]:
        """The payload column, its metadata and compression hint for bytes [n, w].

        ``column_tables`` gives each byte column's Huffman table (bytes that share a
        distribution share a table); by default one table serves every column.
        """
        if self.entropy == "huffman":
            if column_tables is None:
                column_tables = np.zeros(payload.shape[1], dtype=np.int64)
            tables = self._tables.tables_for(payload, column_tables)
            offsets, buffer = huffman.encode_rows(payload, tables, column_tables)
            coded: dict[str, Any] = {
                "entropy": "huffman",
                "huffman": tables,
                "huffman_columns": huffman.column_runs(column_tables),
            }
            return binary_column(offsets, buffer), coded, {}
        meta: dict[str, Any] = {"entropy": self.entropy}
        hint = {PAYLOAD: self.entropy} if self.entropy in ("zstd", "lz4") else {}
        return fixed_binary_column(payload), meta, hint

    @staticmethod
    def _payload_bytes(encoded: EncodedRows, width: int) -> np.ndarray:
        """The payload bytes [n, width] back from an encoded batch, whatever its stage.

        Raises:
            CodecError: the column does not match the metadata.
        """
        column = encoded.columns[PAYLOAD]
        column = one_array(column)
        meta = encoded.metadata
        if meta.get("entropy") == "huffman":
            if not pa.types.is_binary(column.type) and not pa.types.is_large_binary(column.type):
                raise CodecError("Huffman payload is not a binary column")
            tables = meta.get("huffman")
            if not isinstance(tables, list) or not tables:
                raise CodecError("Huffman payload without its code tables")
            columns = huffman.columns_from_runs(meta.get("huffman_columns"), len(tables))
            if len(columns) != width:
                raise CodecError(f"Huffman tables cover {len(columns)} bytes, expected {width}")
            offsets, buffer = binary_buffers(column)
            return huffman.decode_rows(buffer, offsets, [str(t) for t in tables], columns)
        data = fixed_binary_values(column)
        if data.shape[1] != width:
            raise CodecError(f"payload rows are {data.shape[1]} bytes, expected {width}")
        return data


def param_tables(code_bytes: int, param_bytes: int) -> np.ndarray:
    """Huffman table of each payload byte for rows of packed codes then per-row parameters:
    one table for the codes, one per parameter byte (a scale's exponent byte and its mantissa
    byte have nothing in common)."""
    return np.concatenate(
        [np.zeros(code_bytes, dtype=np.int64), 1 + np.arange(param_bytes, dtype=np.int64)]
    )


def float_tables(width: int, itemsize: int) -> np.ndarray:
    """Huffman table of each payload byte for rows of floats: one per byte position."""
    return np.arange(width, dtype=np.int64) % itemsize


def binary_column(offsets: np.ndarray, buffer: np.ndarray) -> pa.Array:
    """A variable-size binary column of rows ``buffer[offsets[i]:offsets[i + 1]]``, zero-copy
    (large binary beyond 2 GiB)."""
    n = len(offsets) - 1
    if offsets[-1] < 2**31:
        return pa.BinaryArray.from_buffers(
            pa.binary(), n, [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(buffer)]
        )
    return pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(buffer)]
    )


def binary_buffers(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Offsets [n + 1] (int64) and the data buffer of a (large) binary array, zero-copy."""
    if column.null_count:
        raise CodecError("payload column has nulls")
    offset_type = np.int64 if pa.types.is_large_binary(column.type) else np.int32
    _, offsets_buf, data_buf = column.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=offset_type)
    offsets = offsets[column.offset : column.offset + len(column) + 1].astype(np.int64)
    data = (
        np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    )
    return offsets, data
