"""Bit packing of small integer codes, vectorised over whole batches of rows.

Contract: ``pack_codes(codes, bits)`` turns a uint8 tensor [n, k] of codes below ``2**bits`` into
a uint8 tensor [n, ceil(k * bits / 8)] in FBGEMM's row layout: codes in order, the first code in
the lowest bits of the first byte, a code straddling a byte boundary continuing in the next byte
(little-endian). ``unpack_codes`` inverts it. Both run on whatever device the tensor is on and
loop only over the (at most 8) codes of one packing group, never over rows.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from embckpt.errors import CodecError


def packed_width(num_codes: int, bits: int) -> int:
    """Bytes one row of ``num_codes`` codes of ``bits`` bits takes when packed."""
    return math.ceil(num_codes * bits / 8)


def _group(bits: int) -> tuple[int, int]:
    """Codes per group and bytes per group: the smallest run of codes that ends on a byte."""
    codes = 8 // math.gcd(8, bits)
    return codes, codes * bits // 8


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Packs codes [n, k] (uint8, each < 2**bits) into bytes [n, ceil(k * bits / 8)].

    Raises:
        CodecError: ``bits`` is not in 1..8.
    """
    if not 1 <= bits <= 8:
        raise CodecError(f"cannot pack {bits}-bit codes")
    n, k = codes.shape
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    per, nbytes = _group(bits)
    groups = -(-k // per)
    lanes = _pad_columns(codes.to(torch.uint8), per).view(n, groups, per)
    if nbytes == 1:
        # 1, 2 or 4 bits: whole codes per byte, shifted and OR-ed in uint8.
        packed = lanes[..., 0].clone()
        for i in range(1, per):
            packed |= lanes[..., i] << (i * bits)
        return packed
    # 3, 5, 6 or 7 bits: 8 codes make `bits` bytes; build them in one integer lane.
    wide = torch.int32 if per * bits <= 31 else torch.int64
    word = lanes[..., 0].to(wide)
    for i in range(1, per):
        word |= lanes[..., i].to(wide) << (i * bits)
    packed = torch.stack([((word >> (8 * b)) & 0xFF).to(torch.uint8) for b in range(nbytes)], -1)
    return packed.view(n, groups * nbytes)[:, : packed_width(k, bits)].contiguous()


def unpack_codes(packed: torch.Tensor, bits: int, num_codes: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: bytes [n, w] to codes [n, num_codes] (uint8).

    Raises:
        CodecError: the rows are narrower than ``num_codes`` codes need.
    """
    n, width = packed.shape
    if width < packed_width(num_codes, bits):
        raise CodecError(
            f"packed rows of {width} bytes cannot hold {num_codes} codes of {bits} bits"
        )
    if bits == 8:
        return packed[:, :num_codes].contiguous()
    per, nbytes = _group(bits)
    mask = (1 << bits) - 1
    groups = -(-num_codes // per)
    data = packed[:, : groups * nbytes]
    if data.shape[1] < groups * nbytes:
        data = torch.nn.functional.pad(data, (0, groups * nbytes - data.shape[1]))
    data = data.reshape(n, groups, nbytes)
    if nbytes == 1:
        codes = torch.stack([(data[..., 0] >> (i * bits)) & mask for i in range(per)], -1)
    else:
        wide = torch.int32 if per * bits <= 31 else torch.int64
        word = data[..., 0].to(wide)
        for b in range(1, nbytes):
            word |= data[..., b].to(wide) << (8 * b)
        codes = torch.stack([((word >> (i * bits)) & mask).to(torch.uint8) for i in range(per)], -1)
    return codes.view(n, groups * per)[:, :num_codes].contiguous()


def _pad_columns(codes: torch.Tensor, multiple: int) -> torch.Tensor:
    """``codes`` with zero columns appended up to a multiple of ``multiple``."""
    extra = -codes.shape[1] % multiple
    if extra == 0:
        return codes.contiguous()
    return torch.nn.functional.pad(codes, (0, extra))


def lookup_codes(packed: np.ndarray, table: np.ndarray, bits: int, num_codes: int) -> np.ndarray:
    """``table[code]`` for every code of packed rows [n, w]: values [n, num_codes].

    Where whole codes fit a byte (1, 2, 4, 8 bits), one lookup per byte yields all of its
    values at once, with no unpacking; other widths unpack first.

    Raises:
        CodecError: a code has no entry in ``table`` (shorter than ``2**bits``).
    """
    n = packed.shape[0]
    if 8 % bits:
        unpacked = unpack_codes(torch.from_numpy(np.array(packed, copy=True)), bits, num_codes)
        index = unpacked.numpy()
        if index.size and int(index.max()) >= len(table):
            raise CodecError(f"code {int(index.max())} beyond a table of {len(table)} values")
        return table[index]
    per = 8 // bits
    # byte_codes[b]: the codes byte b holds, first code in the low bits.
    byte_codes = (np.arange(256)[:, None] >> (np.arange(per) * bits)) & ((1 << bits) - 1)
    if len(table) < 1 << bits:
        valid = (byte_codes < len(table)).all(axis=1)
        if not np.take(valid, packed).all():
            raise CodecError(f"a code beyond a table of {len(table)} values")
        table = np.concatenate([table, np.zeros((1 << bits) - len(table), table.dtype)])
    values = table[byte_codes][packed].reshape(n, -1)
    return np.ascontiguousarray(values[:, :num_codes])
