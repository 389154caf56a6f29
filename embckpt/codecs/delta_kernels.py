"""The compiled loop that adds a ``delta`` diff's changes into a CPU block straight from their
coded entries: each row's entry decoded (the codes of its width, by ``uniform_kernels``' row
loops, or its fp32 bytes) into a scratch row that stays in L1, then added.

Why: decoding a file's rows first (each width's entries gathered into an array of their own,
decoded into a float32 array, then added through an index) wrote and read every change twice
more than adding it does. Measured on the 2-core machine of ``benchmarks/results/``, the delta
rows of rank 0's packed diff in chains of ``benchmarks/family.py``'s models, decoded and added
(read/changes.py): 50,764 rows of 16 columns into cold rows of a 10.2M-row block (its
10.2M-row model; best of 20) in 2.7-3.0 ms against 4.4-4.6 ms decoded first; 6,206 rows of 128
columns (its dim128 model, warm; best of 30) in 0.6-0.7 ms against 1.5 ms.

The rows are taken width by width, each width's loop compiled on its own (as
``uniform_kernels.dequantize`` decodes): one loop over the rows choosing each one's width
measured 5-8x slower, the compiler vectorising none of the widths' loops inside it, and one
function taking the width as a compile-time literal (``numba.literally``, a version compiled per
width) 2.4x slower; hence the four near-copies below. A prefetch of each row ahead inside those
loops made them 2-3x slower too, so the block rows of the next ``AHEAD`` rows are asked for by
a loop of their own (the 16-column case, cold: 2.7-3.0 ms against 3.6-3.9 ms without any
prefetch).

Exactness: each value is decoded by the same loops as ``uniform_kernels.dequantize`` and added
as ``row_kernels.add_indexed`` adds it, so the block gets the same bits.

numba's disk cache sees edits to a kernel's own file only: after editing uniform_kernels.py,
row_kernels.py or fp16_bits.py (whose helpers these loops inline), delete the ``*.nbi`` and
``*.nbc`` files of codecs/__pycache__.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.core.typing.templates import Signature

from embckpt.codecs.delta import RAW_BITS
from embckpt.codecs.fp16_bits import bits_f32
from embckpt.codecs.prefetch import prefetch_row
from embckpt.codecs.row_kernels import add_zero_change
from embckpt.codecs.uniform_kernels import any_width, fours, params_of, threes, twos, word_at

#: ``parts`` columns: an entry kind's width (``RAW_BITS``: the change's fp32 bytes), whether
#: its parameters are fp16, whether its bias is stored, its entry's length in bytes.
BITS, HALF, BIAS, LENGTH = range(4)

_INDEX = types.Array(types.int64, 1, "A", readonly=True)
_BYTES = types.Array(types.uint8, 1, "C", readonly=True)
_PARTS = types.Array(types.int64, 2, "C", readonly=True)


#: Rows whose block rows are asked for at once, a chunk ahead of the ones being added.
AHEAD = 16


@njit(nogil=True, cache=True, error_model="numpy")
def _ask(out: np.ndarray, dest: np.ndarray, kinds: np.ndarray, kind: int, k: int) -> None:
    """Asks the cache for the block rows of ``kind`` among ``dest[k:k + AHEAD]``: in a loop
    (and a function) of its own, since a prefetch inside the loops that decode left them
    2-3x slower (it kept the compiler from vectorising them)."""
    for i in range(k, min(k + AHEAD, dest.shape[0])):
        if kinds[i] == kind:
            prefetch_row(out, dest[i])


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _add(row: np.ndarray, change: np.ndarray, col_lo: int) -> None:
    """``row += change[col_lo:]``, through a slice, as ``row_kernels.add_indexed`` adds:
    the loop then vectorises."""
    added = change[col_lo : col_lo + row.shape[0]]
    for j in range(row.shape[0]):
        row[j] += added[j]


@njit(nogil=True, cache=True, error_model="numpy")
def _add_zeros(out: np.ndarray, dest: np.ndarray, kinds: np.ndarray) -> None:
    """The zero changes (kind -1)."""
    for k in range(dest.shape[0]):
        if kinds[k] < 0:
            add_zero_change(out[dest[k]])


@njit(nogil=True, cache=True, error_model="numpy")
def _add_raw(
    out: np.ndarray,
    dest: np.ndarray,
    kinds: np.ndarray,
    kind: int,
    starts: np.ndarray,
    data: np.ndarray,
    col_lo: int,
) -> None:
    """Changes stored as their fp32 bytes (little-endian), added as they are."""
    for k in range(dest.shape[0]):
        if k % AHEAD == 0:
            _ask(out, dest, kinds, kind, k + AHEAD)
        if kinds[k] == kind:
            row = out[dest[k]]
            at = starts[k] + 4 * col_lo
            for j in range(row.shape[0]):
                row[j] += bits_f32(word_at(data, at + 4 * j))


@njit(nogil=True, cache=True, error_model="numpy")
def _add_fours(
    out: np.ndarray,
    dest: np.ndarray,
    kinds: np.ndarray,
    kind: int,
    starts: np.ndarray,
    data: np.ndarray,
    length: int,
    cols: int,
    col_lo: int,
    half: bool,
    bias: bool,
    change: np.ndarray,
) -> None:
    """Changes of kind ``kind``: 4-bit codes."""
    at = (cols * 4 + 7) // 8
    for k in range(dest.shape[0]):
        if k % AHEAD == 0:
            _ask(out, dest, kinds, kind, k + AHEAD)
        if kinds[k] == kind:
            entry = data[starts[k] : starts[k] + length]
            s64, b64 = params_of(entry, at, 4, half, bias)
            fours(entry, cols, s64, b64, not half, change)
            _add(out[dest[k]], change, col_lo)


@njit(nogil=True, cache=True, error_model="numpy")
def _add_twos(
    out: np.ndarray,
    dest: np.ndarray,
    kinds: np.ndarray,
    kind: int,
    starts: np.ndarray,
    data: np.ndarray,
    length: int,
    cols: int,
    col_lo: int,
    half: bool,
    bias: bool,
    change: np.ndarray,
) -> None:
    """Changes of kind ``kind``: 2-bit codes."""
    at = (cols * 2 + 7) // 8
    for k in range(dest.shape[0]):
        if k % AHEAD == 0:
            _ask(out, dest, kinds, kind, k + AHEAD)
        if kinds[k] == kind:
            entry = data[starts[k] : starts[k] + length]
            s64, b64 = params_of(entry, at, 2, half, bias)
            twos(entry, cols, s64, b64, not half, change)
            _add(out[dest[k]], change, col_lo)


@njit(nogil=True, cache=True, error_model="numpy")
def _add_threes(
    out: np.ndarray,
    dest: np.ndarray,
    kinds: np.ndarray,
    kind: int,
    starts: np.ndarray,
    data: np.ndarray,
    length: int,
    cols: int,
    col_lo: int,
    half: bool,
    bias: bool,
    change: np.ndarray,
) -> None:
    """Changes of kind ``kind``: 3-bit codes."""
    at = (cols * 3 + 7) // 8
    for k in range(dest.shape[0]):
        if k % AHEAD == 0:
            _ask(out, dest, kinds, kind, k + AHEAD)
        if kinds[k] == kind:
            entry = data[starts[k] : starts[k] + length]
            s64, b64 = params_of(entry, at, 3, half, bias)
            threes(entry, cols, s64, b64, not half, change)
            _add(out[dest[k]], change, col_lo)


@njit(nogil=True, cache=True, error_model="numpy")
def _add_any(
    out: np.ndarray,
    dest: np.ndarray,
    kinds: np.ndarray,
    kind: int,
    starts: np.ndarray,
    data: np.ndarray,
    length: int,
    bits: int,
    cols: int,
    col_lo: int,
    half: bool,
    bias: bool,
    change: np.ndarray,
) -> None:
    """Changes of kind ``kind``: codes of any other width (8 bits)."""
    at = (cols * bits + 7) // 8
    for k in range(dest.shape[0]):
        if k % AHEAD == 0:
            _ask(out, dest, kinds, kind, k + AHEAD)
        if kinds[k] == kind:
            entry = data[starts[k] : starts[k] + length]
            s64, b64 = params_of(entry, at, bits, half, bias)
            any_width(entry, bits, cols, s64, b64, not half, change)
            _add(out[dest[k]], change, col_lo)


def _signature(out: types.Array) -> Signature:
    return types.void(out, _INDEX, _INDEX, _INDEX, _BYTES, _PARTS, types.int64, types.int64)


@njit(
    # Whole rows of a block (the usual case), then a column segment of one.
    [_signature(types.float32[:, ::1]), _signature(types.float32[:, :])],
    nogil=True,
    cache=True,
    error_model="numpy",
)
def add_coded(
    out: np.ndarray,
    dest: np.ndarray,
    kinds: np.ndarray,
    starts: np.ndarray,
    data: np.ndarray,
    parts: np.ndarray,
    cols: int,
    col_lo: int,
) -> None:
    """For each k, ``out[dest[k]] +=`` the change coded at ``data[starts[k]:]`` (of kind
    ``parts[kinds[k]]``, ``cols`` values, of which columns ``col_lo`` on are added), or,
    where ``kinds[k]`` < 0, a zero change (``row_kernels.add_zero_change``). ``dest`` holds
    each row once (a file's rows), so taking the rows kind by kind keeps each cell's one
    addition. The caller checks each kind's entry length against its width
    (``DeltaCodec.kernel_parts``), and each ``dest`` against the block."""
    change = np.empty(cols, dtype=np.float32)
    _add_zeros(out, dest, kinds)
    for kind in range(parts.shape[0]):
        bits, length = parts[kind, BITS], parts[kind, LENGTH]
        half, bias = parts[kind, HALF] != 0, parts[kind, BIAS] != 0
        if bits == RAW_BITS:
            _add_raw(out, dest, kinds, kind, starts, data, col_lo)
        elif bits == 4:
            _add_fours(
                out, dest, kinds, kind, starts, data, length, cols, col_lo, half, bias, change
            )
        elif bits == 2:
            _add_twos(
                out, dest, kinds, kind, starts, data, length, cols, col_lo, half, bias, change
            )
        elif bits == 3:
            _add_threes(
                out, dest, kinds, kind, starts, data, length, cols, col_lo, half, bias, change
            )
        else:
            _add_any(
                out, dest, kinds, kind, starts, data, length, bits, cols, col_lo, half, bias, change
            )
