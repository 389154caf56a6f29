"""A test codec that stores rows as they are but declares itself a delta: a reader must add its
rows to what the chain restored so far (registered as ``test_delta`` on import)."""

from __future__ import annotations

import torch

from embckpt.codecs.base import (
    Codec,
    EncodedRows,
    fixed_binary_column,
    fixed_binary_values,
    register,
)


@register
class AddedRaw(Codec):
    """Stores rows as they are, but declares itself an additive codec: a reader must add them."""

    codec_id = "test_delta"
    additive = True

    def encode(self, rows: torch.Tensor) -> EncodedRows:
        data = rows.float().contiguous().view(torch.uint8).numpy()
        return EncodedRows(columns={"payload": fixed_binary_column(data)})

    def decode(self, encoded: EncodedRows, num_cols: int) -> torch.Tensor:
        data = fixed_binary_values(encoded.columns["payload"]).copy()
        return torch.from_numpy(data).view(torch.float32).reshape(-1, num_cols)
