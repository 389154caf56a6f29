"""Compiled (numba) Huffman coding of byte rows: the hot loops of huffman.py.

Why compiled: rows are independent bit strings, so a kernel walks each row once with a 64-bit
bit buffer, where a numpy pass per byte column would stream the whole batch through memory once
per column (and scatter-add its bits).

Contract (as uniform_kernels.py): C-contiguous arrays of fixed dtypes, compiled lazily on first call
and cached on disk, GIL released. Tables are flat, one block per code table, and ``base[j]`` is
the start of byte column ``j``'s block. Encode entries are ``code | length << 16`` (uint32, the
code already bit-reversed for the LSB-first stream); decode entries are ``length | symbol << 8``
(uint16) indexed by the next ``MAX_CODE_BITS`` bits, or ``NO_CODE`` for bits that start no
code. Encode length 0 marks a byte value that has no code. Indices are unsigned (no negative
index wraparound in the lookup chain). Streams are little-endian: bit ``i`` of a row is bit
``i % 8`` of its byte ``i // 8``, read and written eight bytes at a time, which assumes a
little-endian host.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

#: Longest code: a 64-bit window holds at least 57 unread bits after its byte-aligned load,
#: enough for four codes, so the loops move four bytes per load/store.
MAX_CODE_BITS = 12
_MASK = (1 << MAX_CODE_BITS) - 1
#: Decode entry of bits that start no code: length 0, a flag bit no length reaches.
NO_CODE = 0x80
_U64 = np.uint64


def read_span(width: int) -> int:
    """Bytes :func:`decode` may read from a row's start, valid or not: each symbol moves at
    most ``MAX_CODE_BITS`` bits and each window reads eight bytes."""
    return (MAX_CODE_BITS * width + 7) // 8 + 8


def _load_typer(typingctx: object, array: types.Array, index: types.Integer) -> Any:
    """The eight bytes of a uint8 array at ``index`` as one little-endian uint64, unaligned."""

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: list) -> Any:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        pointer = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(64).as_pointer())
        return builder.load(pointer, align=1)

    return types.uint64(array, index), codegen


def _store_typer(
    typingctx: object, array: types.Array, index: types.Integer, value: types.Integer
) -> Any:
    """Writes ``value`` as eight little-endian bytes of a uint8 array at ``index``, unaligned."""

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: list) -> Any:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        pointer = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(64).as_pointer())
        builder.store(args[2], pointer, align=1)
        return context.get_dummy_value()

    return types.void(array, index, types.uint64), codegen


# Typed as Any: numba's stubs see an intrinsic's typer arguments, not its call's.
_load_u64: Any = intrinsic(_load_typer)
_store_u64: Any = intrinsic(_store_typer)


@njit(nogil=True, cache=True, error_model="numpy")
def histograms(data: np.ndarray, step: int, column_tables: np.ndarray, counts: np.ndarray) -> None:
    """Adds the byte counts of every ``step``-th row of ``data`` [n, w] to ``counts`` [t, 256],
    each byte column counted in its table's row."""
    n, width = data.shape
    flat = counts.reshape(-1)
    base = column_tables.astype(np.uint64) * _U64(256)
    for r in range(0, n, step):
        for j in range(width):
            flat[base[j] + _U64(data[r, j])] += 1


@njit(nogil=True, cache=True, error_model="numpy")
def row_bits(data: np.ndarray, table: np.ndarray, base: np.ndarray, out: np.ndarray) -> int:
    """Bits of each row of ``data`` [n, w] into ``out`` [n]; the first row holding a byte value
    without a code, or -1."""
    n, width = data.shape
    for r in range(n):
        bits = _U64(0)
        missing = False
        for j in range(width):
            length = _U64(table[base[j] + _U64(data[r, j])]) >> _U64(16)
            bits += length
            missing |= length == 0
        out[r] = bits
        if missing:
            return r
    return -1


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _put(
    data: np.ndarray,
    table: np.ndarray,
    base: np.ndarray,
    r: int,
    j: int,
    count: int,
    acc: np.uint64,
    held: np.uint64,
) -> tuple[np.uint64, np.uint64]:
    """Appends the codes of ``data[r, j:j + count]`` (at most four) to the bit buffer."""
    for k in range(count):
        entry = _U64(table[base[j + k] + _U64(data[r, j + k])])
        acc |= (entry & _U64(0xFFFF)) << held
        held += entry >> _U64(16)
    return acc, held


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
        at = _U64(offsets[r])
        acc = _U64(0)
        held = _U64(0)
        for j in range(0, whole, 4):
            # At most 7 held bits plus four 12-bit codes: 55 bits, below 64.
            acc, held = _put(data, table, base, r, j, 4, acc, held)
            _store_u64(out, at, acc)
            at += held >> _U64(3)
            acc >>= held & _U64(56)
            held &= _U64(7)
        acc, held = _put(data, table, base, r, whole, width - whole, acc, held)
        if held:
            _store_u64(out, at, acc)


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _take(
    buffer: np.ndarray,
    table: np.ndarray,
    base: np.ndarray,
    out: np.ndarray,
    r: int,
    j: int,
    count: int,
    bit: np.uint64,
    flags: np.uint64,
) -> tuple[np.uint64, np.uint64]:
    """Decodes ``out[r, j:j + count]`` (at most four symbols) from one window at ``bit``."""
    window = _load_u64(buffer, bit >> _U64(3)) >> (bit & _U64(7))
    for k in range(count):
        entry = _U64(table[base[j + k] + (window & _U64(_MASK))])
        out[r, j + k] = np.uint8(entry >> _U64(8))
        length = entry & _U64(63)
        window >>= length
        bit += length
        flags |= entry
    return bit, flags


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _decode_row(
    buffer: np.ndarray,
    offsets: np.ndarray,
    table: np.ndarray,
    base: np.ndarray,
    out: np.ndarray,
    r: int,
) -> bool:
    """Decodes row ``r`` alone; whether it went wrong (see :func:`decode`)."""
    width = out.shape[1]
    whole = width - width % 4
    bit = _U64(offsets[r]) << _U64(3)
    flags = _U64(0)
    for j in range(0, whole, 4):
        bit, flags = _take(buffer, table, base, out, r, j, 4, bit, flags)
    bit, flags = _take(buffer, table, base, out, r, whole, width - whole, bit, flags)
    return bool((flags & _U64(NO_CODE)) != 0 or bit > _U64(offsets[r + 1]) << _U64(3))


@njit(nogil=True, cache=True, error_model="numpy")
def decode(
    buffer: np.ndarray, offsets: np.ndarray, table: np.ndarray, base: np.ndarray, out: np.ndarray
) -> int:
    """Decodes row ``r`` of ``out`` [n, w] from byte ``offsets[r]`` of ``buffer``; the first row
    that reads past its end or meets bits that start no code, or -1.

    Unchecked reads: ``buffer`` must hold ``offsets[r] + read_span(w)`` bytes for every row.
    Four rows are decoded side by side, so four independent chains of lookups overlap.
    """
    n, width = out.shape
    whole = width - width % 4
    lanes = n - n % 4
    for r in range(0, lanes, 4):
        b0 = _U64(offsets[r]) << _U64(3)
        b1 = _U64(offsets[r + 1]) << _U64(3)
        b2 = _U64(offsets[r + 2]) << _U64(3)
        b3 = _U64(offsets[r + 3]) << _U64(3)
        f0 = f1 = f2 = f3 = _U64(0)
        for j in range(0, whole, 4):
            b0, f0 = _take(buffer, table, base, out, r, j, 4, b0, f0)
            b1, f1 = _take(buffer, table, base, out, r + 1, j, 4, b1, f1)
            b2, f2 = _take(buffer, table, base, out, r + 2, j, 4, b2, f2)
            b3, f3 = _take(buffer, table, base, out, r + 3, j, 4, b3, f3)
        tail = width - whole
        b0, f0 = _take(buffer, table, base, out, r, whole, tail, b0, f0)
        b1, f1 = _take(buffer, table, base, out, r + 1, whole, tail, b1, f1)
        b2, f2 = _take(buffer, table, base, out, r + 2, whole, tail, b2, f2)
        b3, f3 = _take(buffer, table, base, out, r + 3, whole, tail, b3, f3)
        ends = (b0, b1, b2, b3)
        flags = (f0, f1, f2, f3)
        for i in range(4):
            if (flags[i] & _U64(NO_CODE)) != 0 or ends[i] > _U64(offsets[r + i + 1]) << _U64(3):
                return r + i
    for r in range(lanes, n):
        if _decode_row(buffer, offsets, table, base, out, r):
            return r
    return -1
