"""Compiled range search (numba) of the adaptive codec (adaptive.py) on CPU tensors.

Why compiled: a torch or numpy operation makes one pass over the whole batch, so a row-wise
search that scores ~11 clipping ranges of the same 64 values pays ~70 passes over memory
(adaptive.py); here each row stays in L1 and registers while it is scored, quantized and packed.

Contract: as uniform_kernels.py states it for every compiled kernel (fixed dtypes, compiled
once and cached on disk, GIL released, numpy's error model). The range search runs the same
greedy walk as adaptive.py, each row's sums of squares strictly left to right over its columns
(vectorised across a tile of rows instead), the canonical order that the GPU encoder
(device_kernels.py) reproduces; tests/test_search_order.py checks it against a plain numpy
walk. CUDA tensors never come here: they take device_encode.py or torch.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from embckpt.codecs.fp16_bits import bits_f32, half_round
from embckpt.codecs.uniform_kernels import quantize_rows

#: Rows per tile of the range search: each step of the walk runs over a tile of rows at a
#: time, so the rows' independent chains (fp16 rounding, divisions, sums, choices) vectorise
#: across rows; 64 rows of 64 floats (16 KB), and their transpose, stay in L1.
_TILE = 64
_F32 = np.float32
_U32 = np.uint32


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _order_key(bits: np.int32) -> np.int32:
    """A float32's bits (as int32) as an integer that orders like the float: the magnitude,
    negated for a negative value (both zeros map to 0); :func:`_key_value` inverts it."""
    magnitude = np.int32(bits & np.int32(0x7FFFFFFF))
    sign = np.int32(bits >> np.int32(31))  # 0 or -1
    return np.int32((magnitude ^ sign) - sign)


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _key_value(key: np.int32) -> np.float32:
    """The float of an :func:`_order_key` (0.0 for both zeros)."""
    sign = np.int32(key >> np.int32(31))
    magnitude = np.int32((key ^ sign) - sign)
    return bits_f32(_U32(np.int64(magnitude | (sign & np.int32(-0x80000000))) & 0xFFFFFFFF))


@njit(nogil=True, cache=True, error_model="numpy")
def _minmax(keys: np.ndarray, r: int) -> tuple[np.float32, np.float32]:
    """Min and max of finite row ``r`` given as int32 bits, a zero result as 0.0 whichever
    zero the row holds (:func:`_first_zero` settles that): integer min/max reductions
    vectorise where float ones, which must keep the first of equal values, do not."""
    low = _order_key(keys[r, 0])
    high = low
    for j in range(keys.shape[1]):
        key = _order_key(keys[r, j])
        low = min(low, key)
        high = max(high, key)
    return _key_value(low), _key_value(high)


@njit(nogil=True, cache=True, error_model="numpy")
def _first_zero(x: np.ndarray, r: int) -> np.float32:
    """The first zero (0.0 or -0.0) of row ``r``, which holds one: the min or max that a
    left-to-right ``min``/``max`` finds when it is zero."""
    j = 0
    while x[r, j] != 0:
        j += 1
    return x[r, j]


@njit(nogil=True, cache=True, error_model="numpy")
def _tile_sumsq(
    xt: np.ndarray, inv: np.ndarray, off: np.ndarray, top: np.float32, out: np.ndarray
) -> None:
    """Per row ``i`` of a transposed tile ``xt`` [cols, _TILE], the sum over its columns of
    (t - clamp(rint(t), 0, top))**2 with t = xt[j, i] * inv[i] - off[i], into ``out[i]``: each
    sum strictly left to right (the canonical order), vectorised across the rows."""
    zero = _F32(0)
    for i in range(_TILE):
        out[i] = zero
    for j in range(xt.shape[0]):
        for i in range(_TILE):
            t = xt[j, i] * inv[i] - off[i]
            d = t - min(max(np.rint(t), zero), top)
            out[i] += d * d


@njit(nogil=True, cache=True, error_model="numpy")
def _tile_sumsq2(
    xt: np.ndarray,
    inv1: np.ndarray,
    off1: np.ndarray,
    inv2: np.ndarray,
    off2: np.ndarray,
    top: np.float32,
    out1: np.ndarray,
    out2: np.ndarray,
) -> None:
    """:func:`_tile_sumsq` for two ranges per row in one pass over the tile."""
    zero = _F32(0)
    for i in range(_TILE):
        out1[i] = zero
        out2[i] = zero
    for j in range(xt.shape[0]):
        for i in range(_TILE):
            v = xt[j, i]
            t = v * inv1[i] - off1[i]
            d = t - min(max(np.rint(t), zero), top)
            out1[i] += d * d
            t = v * inv2[i] - off2[i]
            d = t - min(max(np.rint(t), zero), top)
            out2[i] += d * d


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _scoring(
    lo: np.float32, hi: np.float32, top: np.float32, half: bool
) -> tuple[np.float32, np.float32, np.float32]:
    """(1 / scale, lo / scale, scale**2) of the range [lo, hi] as adaptive.range_loss sets it."""
    if half:
        lo = half_round(lo)
    span = hi - lo
    scale = span / top if span > 0 else _F32(1)
    if half:
        scale = half_round(scale)
        if not scale > 0:
            scale = _F32(1)
    inv = _F32(1) / scale
    return inv, lo * inv, scale * scale


@njit(nogil=True, cache=True, error_model="numpy")
def _finite(keys: np.ndarray, r: int) -> bool:
    """Whether row ``r`` of float32 bit patterns (as int32) holds no NaN and no infinity (an
    all-ones exponent): integer work, so the vectorised max holds whatever the values are."""
    exponent = np.int32(0x7F800000)
    top = np.int32(0)
    for j in range(keys.shape[1]):
        top = max(top, keys[r, j] & exponent)
    return top != exponent


#: Rows of the per-tile scratch of :func:`search_rows`, one value per row of the tile.
_CUR_LO, _CUR_HI, _STEP, _LOSS, _BEST = 0, 1, 2, 3, 4
_INV1, _OFF1, _SQ1, _INV2, _OFF2, _SQ2, _UP, _DOWN = 5, 6, 7, 8, 9, 10, 11, 12
_SCRATCH = 13


@njit(nogil=True, cache=True, error_model="numpy")
def search_rows(
    x: np.ndarray,
    bits: int,
    n_bins: int,
    steps: int,
    half: bool,
    lo: np.ndarray,
    hi: np.ndarray,
    xmin: np.ndarray,
    xmax: np.ndarray,
    quantize: bool,
    out: np.ndarray,
) -> bool:
    """adaptive.greedy_ranges for float32 rows ``x`` [n, cols]: each row's best range into
    ``lo`` and ``hi`` [n], its min and max into ``xmin`` and ``xmax``; with ``quantize``, also
    the row quantized over its range with fp16 parameters into ``out`` (as
    uniform_kernels.quantize_half with its bias), while the row is still in L1.

    The walk runs over a tile of rows at a time, in lockstep: each step computes every row's
    two candidate ranges (fp16 rounding, divisions) in one loop, then their sums of squares
    over the tile's transpose (each row's sum left to right, vectorised across the rows), then
    every row's choice in one branch-free loop, so the per-step scalars vectorise across rows
    and no choice is a branch to mispredict. Same operations on the same values as a
    row-by-row walk summing left to right: the same ranges.

    Returns False, at once, on reaching a row that holds NaN or an infinity (``lo``, ``hi``
    and ``out`` are then incomplete).
    """
    n, cols = x.shape
    top = _F32((1 << bits) - 1)
    bins = _F32(n_bins)
    # Zeroed: rows past a short last tile are summed too (harmless finite values).
    work = np.zeros((_SCRATCH, _TILE), _F32)
    xt = np.zeros((cols, _TILE), _F32)
    cur_lo, cur_hi, step, loss, best = (
        work[_CUR_LO],
        work[_CUR_HI],
        work[_STEP],
        work[_LOSS],
        work[_BEST],
    )
    inv1, off1, sq1, inv2, off2, sq2 = (
        work[_INV1],
        work[_OFF1],
        work[_SQ1],
        work[_INV2],
        work[_OFF2],
        work[_SQ2],
    )
    ups, downs = work[_UP], work[_DOWN]
    keys = x.view(np.int32)
    for start in range(0, n, _TILE):
        m = min(_TILE, n - start)
        for i in range(m):
            r = start + i
            if not _finite(keys, r):
                return False
            cur_lo[i], cur_hi[i] = _minmax(keys, r)
        for i in range(m):
            r = start + i
            if cur_lo[i] == 0 or cur_hi[i] == 0:
                zero = _first_zero(x, r)
                cur_lo[i] = zero if cur_lo[i] == 0 else cur_lo[i]
                cur_hi[i] = zero if cur_hi[i] == 0 else cur_hi[i]
            xmin[r] = cur_lo[i]
            xmax[r] = cur_hi[i]
            step[i] = (cur_hi[i] - cur_lo[i]) / bins
            best[i] = np.inf
            for j in range(cols):
                xt[j, i] = x[r, j]
        for i in range(m):
            inv1[i], off1[i], sq1[i] = _scoring(cur_lo[i], cur_hi[i], top, half)
        _tile_sumsq(xt, inv1, off1, top, loss)
        for i in range(m):
            loss[i] *= sq1[i]
            lo[start + i] = cur_lo[i]
            hi[start + i] = cur_hi[i]
        for _ in range(steps):
            for i in range(m):
                inv1[i], off1[i], sq1[i] = _scoring(cur_lo[i] + step[i], cur_hi[i], top, half)
                inv2[i], off2[i], sq2[i] = _scoring(cur_lo[i], cur_hi[i] - step[i], top, half)
            _tile_sumsq2(xt, inv1, off1, inv2, off2, top, ups, downs)
            for i in range(m):
                r = start + i
                up = ups[i] * sq1[i]
                down = downs[i] * sq2[i]
                here = loss[i]
                # A local optimum: both neighbours are worse. Keep the best one met so far.
                keep = (here < up) & (here < down) & (here < best[i])
                best[i] = here if keep else best[i]
                lo[r] = cur_lo[i] if keep else lo[r]
                hi[r] = cur_hi[i] if keep else hi[r]
                move_up = up < down
                cur_lo[i] = cur_lo[i] + step[i] if move_up else cur_lo[i]
                cur_hi[i] = cur_hi[i] if move_up else cur_hi[i] - step[i]
                loss[i] = up if move_up else down
        if quantize:
            quantize_rows(x, start, start + m, lo, hi, bits, True, out)
    return True
