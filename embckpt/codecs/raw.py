"""``raw``: lossless rows, stored as their native bytes (fp32 by default).

Format (version 1): the ``payload`` column holds each row's bytes as they are in memory, through
the selected entropy stage (``none`` by default; ``zstd``, ``lz4`` and ``huffman`` are lossless
too). The file's metadata names the dtype. NaN and infinities are stored bit-exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from embckpt.codecs.base import EncodedRows, register
from embckpt.codecs.common import PAYLOAD, StagedCodec, float_tables
from embckpt.dtypes import dtype_from_name, dtype_name


@register
class RawCodec(StagedCodec):
    """Stores every row bit-exactly; the only codec a bit-identical resume can use.

    Args:
        entropy: entropy stage over the row bytes (default ``none``: generic compression
            saves little on fp32 weights, see ``raw`` in benchmarks/results/codecs.json).
    """

    codec_id = "raw"
    format_version = 1
    lossless = True

    def __init__(self, entropy: str = "none") -> None:
        super().__init__(entropy)

    def _options(self) -> dict[str, Any]:
        # The default stays out of the config, so files from before the option read the same.
        return {} if self.entropy == "none" else {"entropy": self.entropy}

    def encode(self, rows: torch.Tensor) -> EncodedRows:
        host = rows.detach().contiguous().cpu()
        payload = host.view(torch.uint8).numpy().reshape(host.shape[0], -1)
        tables = float_tables(payload.shape[1], host.element_size())
        column, meta, hint = self._payload_column(payload, tables)
        if self.entropy == "none":
            meta = {}  # as written before entropy stages existed
        return EncodedRows(
            columns={PAYLOAD: column},
            metadata={**meta, "dtype": dtype_name(host.dtype)},
            compression=hint,
        )

    def decode(self, encoded: EncodedRows, num_cols: int) -> torch.Tensor:
        dtype = dtype_from_name(str(encoded.metadata.get("dtype", "float32")))
        itemsize = torch.empty(0, dtype=dtype).element_size()
        data = self._payload_bytes(encoded, num_cols * itemsize)
        rows = torch.from_numpy(data.copy()).view(dtype)
        return rows.reshape(data.shape[0], num_cols)
