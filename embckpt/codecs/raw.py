"""``raw``: lossless rows, stored as their native bytes (fp32 by default)."""

from __future__ import annotations

import torch

from embckpt.codecs.base import (
    Codec,
    EncodedRows,
    dtype_from_name,
    dtype_name,
    fixed_binary_column,
    fixed_binary_values,
    register,
)


@register
class RawCodec(Codec):
    """Stores every row bit-exactly; the only codec a bit-identical resume can use."""

    codec_id = "raw"
    format_version = 1
    lossless = True

    def encode(self, rows: torch.Tensor) -> EncodedRows:
        host = rows.detach().contiguous().cpu()
        payload = host.view(torch.uint8).numpy().reshape(host.shape[0], -1)
        return EncodedRows(
            columns={"payload": fixed_binary_column(payload)},
            metadata={"dtype": dtype_name(host.dtype)},
        )

    def decode(self, encoded: EncodedRows, num_cols: int) -> torch.Tensor:
        dtype = dtype_from_name(str(encoded.metadata.get("dtype", "float32")))
        data = fixed_binary_values(encoded.columns["payload"])
        rows = torch.from_numpy(data.copy()).view(dtype)
        return rows.reshape(data.shape[0], num_cols)
