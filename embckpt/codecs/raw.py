"""``raw``: lossless rows, stored bit-exactly in their own float type (fp32 by default).

Format (version 2), by entropy stage:

* ``none`` (the default): each row's bytes as they are in memory, in a fixed-size binary
  ``payload`` column (the version-1 layout). Parquet writes it at about 3 GB/s per core; a list
  of floats, which Arrow writes with repetition levels for every value, at about 0.33 GB/s,
  which alone made a lossless full save twice as slow as ``dcp.save`` (measured with
  benchmarks/spine.py).
* ``zstd`` and ``lz4``: a Parquet list of ``cols`` floats per row, as ``floats.py`` describes
  (float32 and float64 rows as themselves, fp16 and bf16 rows as the float32 values they equal),
  BYTE_STREAM_SPLIT-encoded, so DuckDB, pandas and Spark read rows as arrays of numbers, and the
  compressor sees exponent bytes apart from mantissa bytes (17% smaller with zstd on trained
  fp32 rows).
* ``huffman``: the row bytes Huffman-coded per byte position in a binary column.

The file's metadata names the dtype. NaN and infinities are stored bit-exactly. Every layout
decodes whatever the entropy stage in force: the reader goes by the column's type.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from embckpt.codecs.base import EncodedRows, register
from embckpt.codecs.common import PAYLOAD, StagedCodec, float_tables
from embckpt.codecs.floats import float_list_column, float_list_rows, is_float_list
from embckpt.dtypes import dtype_from_name, dtype_name


@register
class RawCodec(StagedCodec):
    """Stores every row bit-exactly; the only codec a bit-identical resume can use.

    Args:
        entropy: entropy stage over the rows (default ``none``: the lossless full save must
            keep pace with ``dcp.save``; ``zstd`` stores float arrays that query engines read,
            17% smaller on trained weights, at a tenth of the write speed; ``raw`` in
            benchmarks/results/codecs.json).
    """

    codec_id = "raw"
    format_version = 2
    lossless = True
    rows_independent = True

    def __init__(self, entropy: str = "none") -> None:
        super().__init__(entropy)

    def _options(self) -> dict[str, Any]:
        return {"entropy": self.entropy}

    def encode(self, rows: torch.Tensor) -> EncodedRows:
        host = rows.detach().contiguous().cpu()
        meta = {"dtype": dtype_name(host.dtype)}
        if self.entropy in ("zstd", "lz4"):
            return EncodedRows(
                columns={PAYLOAD: float_list_column(host)},
                metadata={**meta, "entropy": self.entropy},
                compression={PAYLOAD: self.entropy},
            )
        payload = host.view(torch.uint8).numpy().reshape(host.shape[0], -1)
        tables = float_tables(payload.shape[1], host.element_size())
        column, coded, hint = self._payload_column(payload, tables)
        return EncodedRows(columns={PAYLOAD: column}, metadata={**coded, **meta}, compression=hint)

    def decode(self, encoded: EncodedRows, num_cols: int) -> torch.Tensor:
        dtype = dtype_from_name(str(encoded.metadata.get("dtype", "float32")))
        column = encoded.columns[PAYLOAD]
        if is_float_list(column):
            return float_list_rows(column, num_cols).to(dtype)
        view = self.decode_view(encoded, num_cols)
        if view is not None:
            return torch.from_numpy(view.copy())
        itemsize = torch.empty(0, dtype=dtype).element_size()
        data = self._payload_bytes(encoded, num_cols * itemsize)
        rows = torch.from_numpy(data.copy()).view(dtype)
        return rows.reshape(data.shape[0], num_cols)

    def decode_view(self, encoded: EncodedRows, num_cols: int) -> np.ndarray | None:
        """The rows [n, num_cols] as a read-only view of the batch's own bytes, no copy: for a
        reader that copies them into place anyway (a restore's apply), which a copy here would
        double. None where they need decoding (float lists, Huffman) or numpy lacks their
        dtype (bfloat16)."""
        dtype = dtype_from_name(str(encoded.metadata.get("dtype", "float32")))
        if (
            dtype == torch.bfloat16
            or encoded.metadata.get("entropy") == "huffman"
            or is_float_list(encoded.columns[PAYLOAD])
        ):
            return None
        itemsize = torch.empty(0, dtype=dtype).element_size()
        data = self._payload_bytes(encoded, num_cols * itemsize)
        view = data.view(torch.empty(0, dtype=dtype).numpy().dtype)
        view.flags.writeable = False  # the batch's bytes: never written through
        return view
