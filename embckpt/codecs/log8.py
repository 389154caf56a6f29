"""``log8``: one byte per value on a logarithmic grid, for optimizer state.

Optimizer state is what Adagrad and Adam divide by or step along: its values span many octaves
(accumulators of rarely and often seen rows differ by orders of magnitude) and what matters is
each value's *relative* error (Adagrad's step scales with ``1/sqrt(state)``), which a uniform
grid over [min, max] cannot bound for the small values. A grid uniform in ``log2(value)``
bounds it for every value alike.

Format (version 1): the ``payload`` column holds one byte per value (fixed-size binary, through
the selected entropy stage, ``none`` by default); the file's metadata holds ``signed`` and
``log2_min`` / ``log2_max`` (float64: the log2 of the batch's smallest and largest non-zero
magnitude). With ``levels`` = 255 (non-negative batches: Adagrad's accumulators, Adam's
``exp_avg_sq``) or 127 (a batch with a negative value: Adam's ``exp_avg``), and
``step = (log2_max - log2_min) / (levels - 1)``:

* non-negative: byte 0 is exact zero, byte ``c`` in 1..255 is ``2**(log2_min + (c - 1) * step)``;
* signed: bit 7 is the sign, bits 0-6 the magnitude's code as above (0 is zero).

Encoding rounds ``log2(|value|)`` to the nearest grid point (in float64), so every value comes
back within a relative error of ``2**(step / 2) - 1``: zeros, the smallest and the largest
magnitude exactly, fp32 rounding of the decoded values aside. A batch spanning ``R`` octaves
gets ``step = R / 254`` (``R / 126`` signed): 2.8% at 20 octaves, 4.2% at 30, 5.9% at 42
(signed: 5.7%, 8.6%, 12.2%). Adagrad divides by ``sqrt(state)``: its step is off by about half
that. Measured on the row-wise Adagrad accumulators of the reference DLRM
(``configs/bench_spine.yaml``, 2 ranks, 300 steps; 303,224 non-zero values in 28 blocks):
blocks span 33 to 42 octaves, and the error is 5.9% at most, 2.6% on average, 5.5% at the
99th percentile; a log-uniform sample over 30 octaves measures 4.2% at most, 2.05% on average
(signed: 8.6%, 4.1%). A row-wise state takes 1 byte a row instead of 4.

NaN and infinities are refused (``CodecError``); subnormal magnitudes may lose the bound to
the fp32 rounding of the decoded value.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from embckpt.codecs.base import EncodedRows, register
from embckpt.codecs.common import PAYLOAD, StagedCodec, float_rows
from embckpt.errors import CodecError

UNSIGNED_LEVELS = 255
SIGNED_LEVELS = 127
_SIGN = 0x80


@register
class Log8Codec(StagedCodec):
    """One byte per value on a log2 grid over the batch's non-zero magnitudes (module doc).

    Args:
        entropy: entropy stage over the bytes (default ``none``: a fixed byte per value).
    """

    codec_id = "log8"
    format_version = 1

    def __init__(self, entropy: str = "none") -> None:
        super().__init__(entropy)

    def _options(self) -> dict[str, Any]:
        return {"entropy": self.entropy}

    def encode(self, rows: torch.Tensor) -> EncodedRows:
        x = float_rows(rows, self.codec_id)
        signed = bool((x < 0).any())
        magnitude = x.abs() if signed else x
        levels = SIGNED_LEVELS if signed else UNSIGNED_LEVELS
        log2_min, log2_max = _log2_range(magnitude)
        step = (log2_max - log2_min) / (levels - 1)
        # float64 logs: the rounding to the grid is exact to float64's precision, whatever the
        # magnitude (fp32 logs of values near 2**-100 are off by ~1e-5 octaves).
        position = magnitude.double().log2_().sub_(log2_min)
        if step > 0:
            position.div_(step)
        codes = position.round_().clamp_(0, levels - 1).add_(1).to(torch.uint8)
        codes.masked_fill_(magnitude == 0, 0)
        if signed:
            codes |= (x < 0).to(torch.uint8) << 7
        column, meta, hint = self._payload_column(codes.cpu().numpy())
        meta.update(signed=signed, log2_min=log2_min, log2_max=log2_max)
        return EncodedRows(columns={PAYLOAD: column}, metadata=meta, compression=hint)

    def decode(self, encoded: EncodedRows, num_cols: int) -> torch.Tensor:
        table = decode_table(encoded.metadata)
        codes = self._payload_bytes(encoded, num_cols)
        return torch.from_numpy(np.take(table, codes))


def decode_table(meta: Any) -> np.ndarray:
    """The float32 value of each of the 256 byte codes of a batch, from its metadata.

    Raises:
        CodecError: the metadata lacks a finite ``log2_min`` <= ``log2_max`` or ``signed``.
    """
    signed, lo, hi = meta.get("signed"), meta.get("log2_min"), meta.get("log2_max")
    if not isinstance(signed, bool) or not all(
        isinstance(v, int | float) and math.isfinite(v) for v in (lo, hi)
    ):
        raise CodecError(f"log8 metadata has no valid signed/log2_min/log2_max: {dict(meta)}")
    if lo > hi:
        raise CodecError(f"log8 metadata: log2_min {lo} > log2_max {hi}")
    levels = SIGNED_LEVELS if signed else UNSIGNED_LEVELS
    grid = np.exp2(np.linspace(lo, hi, levels, dtype=np.float64))
    magnitudes = np.concatenate([[0.0], grid])
    if signed:
        magnitudes = np.concatenate([magnitudes, -magnitudes])
    return magnitudes.astype(np.float32)


def max_relative_error(meta: Any) -> float:
    """The largest relative error of any non-zero value of a batch: ``2**(step / 2) - 1``."""
    levels = SIGNED_LEVELS if meta["signed"] else UNSIGNED_LEVELS
    return float(2.0 ** ((meta["log2_max"] - meta["log2_min"]) / (levels - 1) / 2) - 1)


def _log2_range(magnitude: torch.Tensor) -> tuple[float, float]:
    """log2 of the smallest and largest non-zero magnitude (0.0, 0.0 when there is none)."""
    largest = float(magnitude.max()) if magnitude.numel() else 0.0
    if largest == 0.0:
        return 0.0, 0.0
    smallest = float(torch.where(magnitude > 0, magnitude, largest).min())
    return math.log2(smallest), math.log2(largest)
