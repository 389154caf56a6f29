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

Encoding rounds ``log2(|value|)`` to the nearest grid point, so every value comes back within a
relative error of ``2**(step / 2) - 1`` (fp32 rounding of the logs and of the decoded value
aside: ``max_relative_error``); zeros, the smallest and the largest magnitude come back
exactly. A batch spanning ``R`` octaves gets ``step = R / 254`` (``R / 126`` signed): 2.8% at
20 octaves, 4.2% at 30, 5.9% at 42 (signed: 5.7%, 8.6%, 12.2%). Adagrad divides by
``sqrt(state)``: its step is off by about half that. Measured on the row-wise Adagrad
accumulators of the reference DLRM (``configs/bench_spine.yaml``, 2 ranks, 300 steps; 303,224
non-zero values in 28 blocks): blocks of 10,000 rows or more span 33 to 42 octaves (the 7
small ones 3 to 13), and the error is 5.9% at most, 2.6% on average, 5.5% at the 99th
percentile; a log-uniform sample over 30 octaves measures 4.2% at most, 2.05% on average
(signed: 8.6%, 4.1%). A row-wise state takes 1 byte a row instead of 4.

NaN and infinities are refused (``CodecError``); subnormal magnitudes may lose the bound to
the fp32 rounding of the decoded value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from embckpt.codecs.base import EncodedRows, register
from embckpt.codecs.common import PAYLOAD, StagedCodec, float_rows
from embckpt.errors import CodecError

UNSIGNED_LEVELS = 255
SIGNED_LEVELS = 127
#: The error, in octaves per octave of ``|log2(value)|``, of the fp32 log and subtraction that
#: place a value on the grid (1 ulp each): a value may round to a neighbour that is up to this
#: much more than half a step away (at 2**-100: 2.4e-5 octaves, a 1.7e-5 relative error).
LOG2_ERROR = 2.0**-22


@register
class Log8Codec(StagedCodec):
    """One byte per value on a log2 grid over the batch's non-zero magnitudes (module doc).

    Args:
        entropy: entropy stage over the bytes (default ``none``: a fixed byte per value).
    """

    codec_id = "log8"
    format_version = 1
    rows_independent = True

    def __init__(self, entropy: str = "none") -> None:
        super().__init__(entropy)

    def _options(self) -> dict[str, Any]:
        return {"entropy": self.entropy}

    def encode(self, rows: torch.Tensor) -> EncodedRows:
        x = float_rows(rows, self.codec_id)
        low, high = (float(v) for v in torch.aminmax(x)) if x.numel() else (0.0, 0.0)
        signed = low < 0
        magnitude = x.abs() if signed else x
        levels = SIGNED_LEVELS if signed else UNSIGNED_LEVELS
        log2_min, log2_max = _log2_range(magnitude, low, high)
        step = (log2_max - log2_min) / (levels - 1)
        # fp32 logs (float64 ones measured 6x slower): see LOG2_ERROR.
        position = torch.log2(magnitude).sub_(log2_min)
        if step > 0:
            position.div_(step)
        # Zeros (log2 = -inf) land on 0 here, then get their own code.
        codes = position.round_().clamp_(0, levels - 1).to(torch.uint8).add_(1)
        codes.mul_((magnitude != 0).to(torch.uint8))  # measured faster than masked_fill_
        if signed:
            codes |= (x < 0).to(torch.uint8) << 7
        column, meta, hint = self._payload_column(codes.cpu().numpy())
        meta.update(signed=signed, log2_min=log2_min, log2_max=log2_max)
        return EncodedRows(columns={PAYLOAD: column}, metadata=meta, compression=hint)

    def decode(self, encoded: EncodedRows, num_cols: int) -> torch.Tensor:
        return self.decode_many([encoded], num_cols)[0]

    def decode_many(self, items: Sequence[EncodedRows], num_cols: int) -> list[torch.Tensor]:
        """Decodes several batches (a block's files along a chain), each byte looked up in its
        own batch's table, into one array."""
        if not items:
            return []
        tables = decode_tables([item.metadata for item in items])  # [files, 256]
        codes = [self._payload_bytes(item, num_cols) for item in items]
        counts = [len(c) for c in codes]
        values = np.empty((sum(counts), num_cols), dtype=np.float32)
        at = 0
        for table, batch in zip(tables, codes, strict=True):
            _look_up(table, batch, values[at : at + len(batch)])
            at += len(batch)
        return list(torch.split(torch.from_numpy(values), counts))


_LOOKUP_ROWS = 1 << 16


def _look_up(table: np.ndarray, codes: np.ndarray, out: np.ndarray) -> None:
    """``out = table[codes]``, ``_LOOKUP_ROWS`` rows at a time: numpy's ``take`` first turns
    the byte codes into a 64-bit index, which for a whole large batch is a new buffer eight
    times the codes' size (5M codes: 8-124 ms, the most where its pages were new, as after
    a restore's heap trim; 4.6-6.5 ms a slice at a time, on the 2-core machine of
    ``benchmarks/results/``). ``clip`` never applies (a byte indexes all 256 entries): it
    only spares ``out`` numpy's buffering."""
    for start in range(0, len(codes), _LOOKUP_ROWS):
        stop = start + _LOOKUP_ROWS
        np.take(table, codes[start:stop], out=out[start:stop], mode="clip")


def decode_table(meta: Any) -> np.ndarray:
    """The float32 value of each of the 256 byte codes of a batch, from its metadata.

    Raises:
        CodecError: the metadata lacks a finite ``log2_min`` <= ``log2_max`` or ``signed``.
    """
    return decode_tables([meta])[0]


def decode_tables(metas: Sequence[Any]) -> np.ndarray:
    """:func:`decode_table` of each of ``metas``, float32 [len(metas), 256], in one pass per
    sign: a chain's row-wise states are a table per file and block, for which building them
    one by one cost as much as the lookups. Each grid is ``np.linspace``'s, value for value
    (``log2_min + i * step`` in float64, the last point ``log2_max``).

    Raises:
        CodecError: a metadata lacks a finite ``log2_min`` <= ``log2_max`` or ``signed``.
    """
    out = np.empty((len(metas), 256), dtype=np.float32)
    bounds = np.empty((len(metas), 2), dtype=np.float64)
    signs = np.empty(len(metas), dtype=bool)
    for i, meta in enumerate(metas):
        signed, lo, hi = meta.get("signed"), meta.get("log2_min"), meta.get("log2_max")
        if not isinstance(signed, bool) or not all(
            isinstance(v, int | float) and math.isfinite(v) for v in (lo, hi)
        ):
            raise CodecError(f"log8 metadata has no valid signed/log2_min/log2_max: {dict(meta)}")
        if lo > hi:
            raise CodecError(f"log8 metadata: log2_min {lo} > log2_max {hi}")
        bounds[i] = lo, hi
        signs[i] = signed
    for signed, levels in ((False, UNSIGNED_LEVELS), (True, SIGNED_LEVELS)):
        which = np.flatnonzero(signs == signed)
        if not len(which):
            continue
        lo, hi = bounds[which, :1], bounds[which, 1:]
        grid = np.arange(levels, dtype=np.float64) * ((hi - lo) / (levels - 1)) + lo
        grid[:, -1:] = hi
        magnitudes = np.concatenate([np.zeros((len(which), 1)), np.exp2(grid)], axis=1)
        if signed:
            magnitudes = np.concatenate([magnitudes, -magnitudes], axis=1)
        out[which] = magnitudes
    return out


def max_relative_error(meta: Any) -> float:
    """The largest relative error of any non-zero value of a batch: ``2**(step / 2) - 1``, the
    fp32 error of the logs (``LOG2_ERROR``) and of the decoded value included."""
    levels = SIGNED_LEVELS if meta["signed"] else UNSIGNED_LEVELS
    lo, hi = meta["log2_min"], meta["log2_max"]
    slack = LOG2_ERROR * max(abs(lo), abs(hi), 1.0)
    return float(2.0 ** ((hi - lo) / (levels - 1) / 2 + slack) * (1 + 2.0**-24) - 1)


def _log2_range(magnitude: torch.Tensor, low: float, high: float) -> tuple[float, float]:
    """log2 of the smallest and largest non-zero magnitude (0.0, 0.0 when there is none), from
    the batch's magnitudes and its smallest and largest value."""
    largest = max(-low, high)
    if largest == 0.0:
        return 0.0, 0.0
    # Without zeros (or negatives) the smallest value is the smallest magnitude: no extra pass.
    smallest = low if low > 0 else float(torch.where(magnitude > 0, magnitude, largest).min())
    return math.log2(smallest), math.log2(largest)
