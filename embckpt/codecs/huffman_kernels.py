"""Compiled (numba) Huffman coding of byte rows: the hot loops of huffman.py.

Why compiled: rows are independent bit strings, so a kernel walks each row once with a 64-bit
bit buffer, where a numpy pass per byte column would stream the whole batch through memory once
per column (and scatter-add its bits).

Contract (as kernels.py): C-contiguous arrays of fixed dtypes, compiled lazily on first call
and cached on disk, GIL released. Tables are flat, one block per code table, and ``base[j]`` is
the start of byte column ``j``'s block. Encode entries are ``code | length << 16`` (uint32, the
code already bit-reversed for the LSB-first stream); decode entries are ``symbol | length << 8``
(uint16) indexed by the next ``MAX_CODE_BITS`` bits. Length 0 marks a byte value (encode) or a
bit pattern (decode) that has no code. Streams are little-endian: bit ``i`` of a row is bit
``i % 8`` of its byte ``i // 8``, read and written eight bytes at a time on a little-endian
host (the only kind numba's CPU targets here run on).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

#: Longest code (huffman.MAX_CODE_BITS): a 64-bit window holds at least 57 unread bits after
#: its byte-aligned load, enough for four codes, so the loops move four bytes per load/store.
_CODE_BITS = 12
_MASK = (1 << _CODE_BITS) - 1
#: Rows decoded side by side: each symbol's lookup waits on the previous one's length, so
#: interleaving independent rows keeps several lookups in flight.
_LANES = 4
_U64 = np.uint64


@intrinsic
def _load_u64(typingctx: object, array: types.Array, index: types.Integer) -> Any:
    """The eight bytes of a uint8 array at ``index`` as one little-endian uint64, unaligned."""

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: list) -> Any:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        pointer = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(64).as_pointer())
        return builder.load(pointer, align=1)

    return types.uint64(array, index), codegen


@intrinsic
def _store_u64(
    typingctx: object, array: types.Array, index: types.Integer, value: types.Integer
) -> Any:
    """Writes ``value`` as eight little-endian bytes of a uint8 array at ``index``, unaligned."""

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: list) -> Any:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        pointer = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(64).as_pointer())
        builder.store(args[2], pointer, align=1)
        return context.get_dummy_value()

    return types.void(array, index, types.uint64), codegen


@njit(nogil=True, cache=True, error_model="numpy")
def row_bits(data: np.ndarray, table: np.ndarray, base: np.ndarray, out: np.ndarray) -> int:
    """Bits of each row of ``data`` [n, w] into ``out`` [n]; the first row holding a byte value
    without a code, or -1."""
    n, width = data.shape
    for r in range(n):
        bits = 0
        missing = 0
        for j in range(width):
            length = np.int64(table[base[j] + data[r, j]] >> 16)
            bits += length
            missing |= length == 0
        out[r] = bits
        if missing:
            return r
    return -1


@njit(nogil=True, cache=True, error_model="numpy")
def encode(
    data: np.ndarray, table: np.ndarray, base: np.ndarray, offsets: np.ndarray, out: np.ndarray
) -> None:
    """Writes row ``r`` of ``data`` [n, w] at byte ``offsets[r]`` of ``out``, whose size is
    ``offsets[n] + 8``: each flush stores eight bytes, the bits past the row's end are zeros,
    and the next row (or the slack) overwrites them."""
    n, width = data.shape
    whole = width - width % 4
    for r in range(n):
        at = offsets[r]
        acc = _U64(0)
        held = _U64(0)
        for j in range(0, whole, 4):
            # At most 7 held bits plus four 12-bit codes: 55 bits, below 64.
            for k in range(4):
                entry = _U64(table[base[j + k] + data[r, j + k]])
                acc |= (entry & _U64(0xFFFF)) << held
                held += entry >> _U64(16)
            _store_u64(out, at, acc)
            at += np.int64(held >> _U64(3))
            acc >>= held & _U64(56)
            held &= _U64(7)
        for j in range(whole, width):
            entry = _U64(table[base[j] + data[r, j]])
            acc |= (entry & _U64(0xFFFF)) << held
            held += entry >> _U64(16)
        if held:
            _store_u64(out, at, acc)


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _window(buffer: np.ndarray, bit: int) -> np.uint64:
    """At least 57 bits of ``buffer`` from bit ``bit`` on (zeros past its end)."""
    byte = bit >> 3
    if byte + 8 <= len(buffer):
        word = _load_u64(buffer, byte)
    else:
        word = _U64(0)
        for i in range(max(0, len(buffer) - byte)):
            word |= _U64(buffer[byte + i]) << _U64(8 * i)
    return word >> _U64(bit & 7)


@njit(nogil=True, cache=True, error_model="numpy")
def decode(
    buffer: np.ndarray, offsets: np.ndarray, table: np.ndarray, base: np.ndarray, out: np.ndarray
) -> int:
    """Decodes row ``r`` of ``out`` [n, w] from byte ``offsets[r]`` of ``buffer``; the first row
    that reads past its end or meets a bit pattern without a code, or -1."""
    n, width = out.shape
    lanes = n - n % _LANES
    pos = np.empty(_LANES, np.int64)
    bad = np.zeros(_LANES, np.int64)
    for r0 in range(0, lanes, _LANES):
        for i in range(_LANES):
            pos[i] = offsets[r0 + i] << 3
            bad[i] = 0
        j = 0
        while j < width:
            step = min(4, width - j)
            for i in range(_LANES):
                window = _window(buffer, pos[i])
                used = _U64(0)
                for k in range(step):
                    entry = table[base[j + k] + np.int64(window & _U64(_MASK))]
                    length = _U64(entry >> 8)
                    out[r0 + i, j + k] = entry & 0xFF
                    window >>= length
                    used += length
                    bad[i] |= length == 0
                pos[i] += np.int64(used)
            j += step
        for i in range(_LANES):
            if bad[i] or pos[i] > offsets[r0 + i + 1] << 3:
                return r0 + i
    for r in range(lanes, n):
        bit = offsets[r] << 3
        missing = 0
        for j in range(0, width, 4):
            window = _window(buffer, bit)
            for k in range(min(4, width - j)):
                entry = table[base[j + k] + np.int64(window & _U64(_MASK))]
                length = entry >> 8
                out[r, j + k] = entry & 0xFF
                window >>= _U64(length)
                bit += length
                missing |= length == 0
        if missing or bit > offsets[r + 1] << 3:
            return r
    return -1
