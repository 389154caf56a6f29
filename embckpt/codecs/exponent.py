"""``exponent``: LC-Checkpoint's exponent-based quantization with priority promotion, for deltas.

An additive codec (``additive = True``): the checkpointer encodes ``rows - reference``, where
``reference`` is what a reader will have reconstructed for those rows so far, and a reader adds
the decoded values to that reference. Feeding the quantization error of one checkpoint into the
next delta (LC-Checkpoint's error feedback) keeps the reconstruction error bounded however many
checkpoints are taken; encoding ``rows - rows_at_last_checkpoint`` instead would let it grow.

Each value falls into a bucket by its sign and binary exponent (``frexp``). Priority promotion
keeps the ``2**bits - 1`` buckets of largest magnitude found in the batch, each represented by
the mean of its values; every other value (smaller magnitudes, exact zeros) becomes 0. A value
in a kept bucket is off by less than half its magnitude; a dropped value by less than the
smallest kept bucket's lower bound, ``2**(e_min - 1)``.

Format (version 1): the ``payload`` column holds each row's symbols (``bits`` bits each, packed
like FBGEMM's codes; symbol 0 is zero, symbol ``s`` is ``values[s - 1]``), through the selected
entropy stage; the file's metadata holds ``values`` (the kept buckets' means, fp32). The symbols
are very skewed towards 0, which is where the entropy stage earns its keep.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from embckpt.codecs.base import EncodedRows, register
from embckpt.codecs.common import DEFAULT_ENTROPY, PAYLOAD, StagedCodec, check_bits, float_rows
from embckpt.codecs.packing import lookup_codes, pack_codes, packed_width
from embckpt.errors import CodecError

EXPONENT_BITS = (2, 3, 4, 8)
_BUCKETS = 512  # sign (1 bit) and fp32 biased exponent (8 bits)


@register
class ExponentCodec(StagedCodec):
    """Sign-and-exponent buckets of deltas, the largest ``2**bits - 1`` kept.

    Args:
        bits: symbol width: 2, 3, 4 or 8 (LC-Checkpoint studies 2 and 3).
        entropy: entropy stage over the packed symbols (see ``common.py``).
    """

    codec_id = "exponent"
    format_version = 1
    additive = True

    def __init__(self, bits: int = 3, entropy: str = DEFAULT_ENTROPY) -> None:
        super().__init__(entropy)
        self.bits = check_bits(self.codec_id, bits, EXPONENT_BITS)

    def _options(self) -> dict[str, Any]:
        return {"bits": self.bits, "entropy": self.entropy}

    def encode(self, rows: torch.Tensor) -> EncodedRows:
        x = float_rows(rows, self.codec_id)
        # The sign bit and the 8 exponent bits of every fp32 value, read straight from its bits.
        bucket = (x.view(torch.int32) >> 23) & 0x1FF
        values, symbol_of = _promote(x, bucket, (1 << self.bits) - 1)
        if x.device.type == "cpu":
            symbols = torch.from_numpy(np.take(symbol_of.numpy(), bucket.numpy()))
        else:
            symbols = symbol_of.to(x.device)[bucket]
        payload = pack_codes(symbols, self.bits).cpu().numpy()
        column, meta, hint = self._payload_column(payload)
        meta["values"] = values
        return EncodedRows(columns={PAYLOAD: column}, metadata=meta, compression=hint)

    def decode(self, encoded: EncodedRows, num_cols: int) -> torch.Tensor:
        values = encoded.metadata.get("values")
        if not isinstance(values, list) or len(values) > (1 << self.bits) - 1:
            raise CodecError(f"exponent codec metadata has no valid 'values': {values!r}")
        table = np.array([0.0, *values], dtype=np.float32)
        data = self._payload_bytes(encoded, packed_width(num_cols, self.bits))
        return torch.from_numpy(lookup_codes(data, table, self.bits, num_cols))


def _promote(x: torch.Tensor, bucket: torch.Tensor, keep: int) -> tuple[list[float], torch.Tensor]:
    """The kept buckets' mean values (largest magnitude first) and a bucket -> symbol table
    (uint8 [512])."""
    flat = bucket.view(-1)
    counts = torch.bincount(flat, minlength=_BUCKETS).cpu()
    sums = torch.bincount(flat, weights=x.view(-1), minlength=_BUCKETS).double().cpu()
    if not bool(torch.isfinite(sums).all()):
        # Values near fp32's maximum overflow a float32 sum: add them up in float64 instead.
        sums = torch.bincount(flat, weights=x.view(-1).double(), minlength=_BUCKETS).cpu()
    exponent = torch.arange(_BUCKETS) & 0xFF
    # Exponent 0 holds zeros and subnormals (|v| < 2**-126): never worth a symbol.
    candidates = torch.nonzero((counts > 0) & (exponent > 0)).view(-1).tolist()
    # Largest exponent first; between the two signs of one exponent, the more frequent.
    order = sorted(candidates, key=lambda b: (-int(exponent[b]), -int(counts[b]), b))[:keep]
    symbol_of = torch.zeros(_BUCKETS, dtype=torch.uint8)
    values: list[float] = []
    for symbol, b in enumerate(order, start=1):
        symbol_of[b] = symbol
        values.append(float(np.float32(sums[b] / counts[b])))
    return values, symbol_of
