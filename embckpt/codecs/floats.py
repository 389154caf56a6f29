"""``fp16`` and ``bf16``: rows rounded to a 16-bit float, the cheap lossy baselines.

Format (version 1): the ``payload`` column holds each row's 16-bit values (little-endian), through
the selected entropy stage. Rounding is to nearest even: the error per element is at most
``2**-11 * |x|`` for fp16 (plus ``2**-25`` absolute below fp16's normal range, where values
become subnormal or zero) and ``2**-8 * |x|`` for bf16. Values fp16 cannot hold (beyond 65504)
are refused rather than stored as infinity; bf16 holds fp32's whole range.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from embckpt.codecs.base import EncodedRows, register
from embckpt.codecs.common import PAYLOAD, StagedCodec, float_rows, float_tables
from embckpt.errors import CodecError


class _HalfCodec(StagedCodec):
    dtype: ClassVar[torch.dtype]

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
        payload = half.view(torch.int16).cpu().numpy().view(np.uint8)
        column, meta, hint = self._payload_column(payload, float_tables(payload.shape[1], 2))
        return EncodedRows(columns={PAYLOAD: column}, metadata=meta, compression=hint)

    def decode(self, encoded: EncodedRows, num_cols: int) -> torch.Tensor:
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
