"""Compiled loops that move whole rows: adding decoded rows into a block (how an additive
codec's rows, a delta diff's, are applied: from a dense array, or from the decoded changes'
rows an index picks, in the order given, and zero changes), copying rows over a block's
scattered rows, and gathering a binary column's entries of one width (how the delta codec
splits its rows by width before decoding them). The loops that write scattered rows of a
block ask for the row ``prefetch.ROWS_AHEAD`` rows ahead first (``prefetch.py`` says why).

Why kernels: numpy's ``out[rows] += values`` gathers the rows, adds, and scatters them back,
three passes that each miss the cache once per row of a large block; and gathering entries
with numpy builds an index of every byte first. Measured on the 2-core machine of
``benchmarks/results/``: 40,000 rows of 16 columns added into a 10M-row block took 6 ms with
numpy, 1.2 ms here. Each addition is the same float addition numpy makes (no fast-math), so
the result is the same to the bit.

The signatures are given, so that every layout a caller passes (a block's column slice, a
read-only Arrow buffer) runs a loop compiled beforehand instead of compiling another (the
addition of changes has one for whole C-ordered rows, which vectorises, and one for the rest).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit, types
from numba.core.typing.templates import Signature

from embckpt.codecs.prefetch import ROWS_AHEAD, prefetch_row

_READ_ONLY_BYTES = types.Array(types.uint8, 1, "C", readonly=True)


def _read_only(dtype: types.Type, ndim: int) -> types.Array:
    """An array argument of any layout that the kernel only reads: read-only arrays (Arrow's
    buffers) and writable ones alike run the one compiled loop."""
    return types.Array(dtype, ndim, "A", readonly=True)


@njit(
    [
        # C-ordered blocks and values vectorise (66k-row block, 2,000 rows of 128 columns:
        # 0.40 ms strided, 0.14 ms this way); strided ones (column segments) take the others.
        "void(float32[:, ::1], int64[::1], float32[:, ::1])",
        "void(float64[:, ::1], int64[::1], float64[:, ::1])",
        "void(float32[:, :], int64[:], float32[:, :])",
        "void(float64[:, :], int64[:], float64[:, :])",
    ],
    nogil=True,
    cache=True,
    error_model="numpy",
)
def add_rows(out: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
    """``out[rows[i]] += values[i]`` for each i (``rows`` unique)."""
    n = rows.shape[0]
    for i in range(n):
        if i + ROWS_AHEAD < n:
            prefetch_row(out, rows[i + ROWS_AHEAD])
        row = rows[i]
        for j in range(values.shape[1]):
            out[row, j] += values[i, j]


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def add_zero_change(row: np.ndarray) -> None:
    """``row += 0.0`` as the dense addition makes it: x + 0.0 is x for every finite x but
    -0.0, which becomes +0.0 (rows are finite: the codecs refuse others). Only zeros are
    written, so a row without one is read, not dirtied (30% faster on 128k rows of a 10M-row
    block)."""
    zero = np.float32(0.0)
    for j in range(row.shape[0]):
        if row[j] == zero:
            row[j] += zero


def _indexed(out: types.Array, values: types.Array) -> Signature:
    """``add_indexed``'s signature for a layout of its block and values."""
    return types.void(
        out,
        _read_only(types.int64, 1),
        _read_only(types.int64, 1),
        values,
        types.int64,
    )


def _copied(out: types.Array, values: types.Array) -> Signature:
    """``copy_rows``'s signature for a layout of its block and values."""
    return types.void(out, _read_only(types.int64, 1), values)


def _layouts(signature: Callable[[types.Array, types.Array], Signature]) -> list[Signature]:
    """A kernel's signatures for whole rows of a block and C-ordered values (the usual case,
    which vectorises: adding 30,000 rows of 128 columns took 2.5 ms this way, 4.8 ms
    strided), then for strided ones (a column segment)."""
    return [
        signature(types.float32[:, ::1], types.Array(types.float32, 2, "C", readonly=True)),
        signature(types.float32[:, :], _read_only(types.float32, 2)),
    ]


@njit(
    _layouts(_indexed),
    nogil=True,
    cache=True,
    error_model="numpy",
)
def add_indexed(
    out: np.ndarray, dest: np.ndarray, index: np.ndarray, values: np.ndarray, col_lo: int
) -> None:
    """For each k in turn: ``out[dest[k]] += values[index[k], col_lo:col_lo + out.shape[1]]``,
    or, where ``index[k]`` < 0, a zero change: a -0.0 becomes +0.0, every other value stays,
    as the dense addition makes it. A row ``dest`` holds twice gets its additions in the
    order given."""
    width = out.shape[1]
    n = dest.shape[0]
    for k in range(n):
        if k + ROWS_AHEAD < n:
            prefetch_row(out, dest[k + ROWS_AHEAD])
        row = out[dest[k]]
        i = index[k]
        if i < 0:
            add_zero_change(row)
        else:
            # Through a slice: indexed as ``values[i, col_lo + j]``, an index numba cannot
            # prove non-negative, the loop took a wraparound test per value and did not
            # vectorise (30,000 rows of 128 columns added: 5.2 ms that way, 1.8 ms this way).
            change = values[i, col_lo : col_lo + width]
            for j in range(width):
                row[j] += change[j]


@njit(
    _layouts(_copied),
    nogil=True,
    cache=True,
    error_model="numpy",
)
def copy_rows(out: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
    """``out[rows[i]] = values[i]`` for each i: numpy's ``out[rows] = values`` without its
    wait for each scattered row."""
    width = out.shape[1]
    n = rows.shape[0]
    for i in range(n):
        if i + ROWS_AHEAD < n:
            prefetch_row(out, rows[i + ROWS_AHEAD])
        row = out[rows[i]]
        src = values[i]
        for j in range(width):
            row[j] = src[j]


@njit(
    [types.uint8[:, ::1](_READ_ONLY_BYTES, types.int64[::1], types.int64)],
    nogil=True,
    cache=True,
)
def gather_entries(data: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    """The ``length`` bytes at each of ``starts`` in ``data``, one row each."""
    out = np.empty((starts.shape[0], length), dtype=np.uint8)
    for i in range(starts.shape[0]):
        # A slice copy, not a loop over bytes: twice as fast (4,207 entries of 64 bytes:
        # 205 us by byte, 110 us by slice, on the 2-core machine of benchmarks/results/).
        out[i, :] = data[starts[i] : starts[i] + length]
    return out
