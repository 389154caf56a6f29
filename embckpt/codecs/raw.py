"""``raw``: lossless rows, stored bit-exactly in their own float type (fp32 by default).

Format (version 2): the ``payload`` column is a Parquet list of ``cols`` floats per row, as
``floats.py`` describes (float32 and float64 rows as themselves, fp16 and bf16 rows as the
float32 values they equal), BYTE_STREAM_SPLIT-encoded, through the selected entropy stage:
``none`` by default, ``zstd`` or ``lz4``. ``huffman`` keeps the version-1 layout (each row's
bytes as they are in memory, Huffman-coded per byte position in a binary column). The file's
metadata names the dtype. NaN and infinities are stored bit-exactly. Version-1 files (row bytes
in a fixed-size binary column) still decode.
"""

from __future__ import annotations

from typing import Any

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
            keep pace with ``dcp.save``; ``zstd`` over byte-stream-split fp32 weights of a
            trained model saves 17% of the bytes at about half the write speed; ``raw`` in
            benchmarks/results/codecs.json).
    """

    codec_id = "raw"
    format_version = 2
    lossless = True

    def __init__(self, entropy: str = "none") -> None:
        super().__init__(entropy)

    def _options(self) -> dict[str, Any]:
        return {"entropy": self.entropy}

    def encode(self, rows: torch.Tensor) -> EncodedRows:
        host = rows.detach().contiguous().cpu()
        meta = {"dtype": dtype_name(host.dtype)}
        if self.entropy != "huffman":
            hint = {PAYLOAD: self.entropy} if self.entropy != "none" else {}
            return EncodedRows(
                columns={PAYLOAD: float_list_column(host)},
                metadata={**meta, "entropy": self.entropy},
                compression=hint,
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
        itemsize = torch.empty(0, dtype=dtype).element_size()
        data = self._payload_bytes(encoded, num_cols * itemsize)
        rows = torch.from_numpy(data.copy()).view(dtype)
        return rows.reshape(data.shape[0], num_cols)
