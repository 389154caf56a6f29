"""Compiled per-row kernels (numba) for the uniform codecs on CPU tensors.

Why compiled: a torch or numpy operation makes one pass over the whole batch, so a row-wise
search that scores ~11 clipping ranges of the same 64 values pays ~70 passes over memory
(adaptive.py); here each row stays in L1 and registers while it is scored, quantized and packed.

Contract: kernels take C-contiguous numpy arrays of fixed dtypes (float32 rows and ranges,
uint8 bytes, float64 parameters; int and bool options), so each compiles once, lazily on its
first call, and numba caches the machine code on disk (``cache=True``); they release the GIL
(``nogil``: the writer encodes in threads), and divide by zero as IEEE says (numpy's error
model), as torch does. Quantization and decoding reproduce the torch path
of uniform.py bit for bit (same float32 operations in the same order, no fused multiply-add);
the range search runs the same greedy walk as adaptive.py, each row's sums of squares strictly
left to right over its columns (vectorised across a tile of rows instead), the canonical order
that the GPU encoder (device_kernels.py) reproduces; tests/test_search_order.py checks it
against a plain numpy walk. CUDA tensors never come here: they take device_encode.py or torch.

fp16 rounding is done on the float32 bit pattern (round to nearest even, as ``Tensor.half()``):
numba has no fp16 arithmetic on the CPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

#: Rows per tile of the range search: each step of the walk runs over a tile of rows at a
#: time, so the rows' independent chains (fp16 rounding, divisions, sums, choices) vectorise
#: across rows; 64 rows of 64 floats (16 KB), and their transpose, stay in L1.
_TILE = 64
_F32 = np.float32
_U32 = np.uint32


def _bitcast(source: types.Type, target: types.Type, llvm_target: ir.Type) -> Any:
    """An intrinsic that reads a 32-bit value's bits as another 32-bit type."""

    def typer(typingctx: object, value: types.Type) -> object:
        def codegen(
            context: object, builder: ir.IRBuilder, signature: object, args: list
        ) -> object:
            return builder.bitcast(args[0], llvm_target)

        return target(source), codegen

    return intrinsic(typer)


_f32_bits = _bitcast(types.float32, types.uint32, ir.IntType(32))
_bits_f32 = _bitcast(types.uint32, types.float32, ir.FloatType())


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _half_round(value: np.float32) -> np.float32:
    """``float32(float16(value))`` for a finite float32: round to nearest even on 10 mantissa
    bits (2**-24 steps below fp16's smallest normal), infinity beyond fp16's largest value."""
    bits = _f32_bits(value)
    sign = bits & _U32(0x80000000)
    mag = bits & _U32(0x7FFFFFFF)
    if mag >= _U32(0x38800000):
        mag = (mag + _U32(0x0FFF) + ((mag >> _U32(13)) & _U32(1))) & _U32(0xFFFFE000)
        if mag > _U32(0x477FE000):
            mag = _U32(0x7F800000)
    else:
        tiny = _bits_f32(mag) * _F32(16777216.0)
        mag = _f32_bits(np.rint(tiny) * _F32(5.960464477539063e-08))
    return _bits_f32(mag | sign)


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _half_bits(value: np.float32) -> np.uint32:
    """The fp16 bit pattern of a float32 that fp16 represents exactly (or an infinity)."""
    bits = _f32_bits(value)
    sign = (bits >> _U32(16)) & _U32(0x8000)
    mag = bits & _U32(0x7FFFFFFF)
    if mag >= _U32(0x7F800000):
        half = _U32(0x7C00)
    elif mag >= _U32(0x38800000):
        half = (mag >> _U32(13)) - _U32(112 << 10)
    else:
        half = _U32(_bits_f32(mag) * _F32(16777216.0))
    return half | sign


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
    return _bits_f32(_U32(np.int64(magnitude | (sign & np.int32(-0x80000000))) & 0xFFFFFFFF))


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
        lo = _half_round(lo)
    span = hi - lo
    scale = span / top if span > 0 else _F32(1)
    if half:
        scale = _half_round(scale)
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
    :func:`quantize_half` with its bias), while the row is still in L1.

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
            _quantize_rows(x, start, start + m, lo, hi, bits, True, out)
    return True


@njit(nogil=True, cache=True, error_model="numpy")
def quantize_half(
    x: np.ndarray, lo: np.ndarray, hi: np.ndarray, bits: int, with_bias: bool, out: np.ndarray
) -> None:
    """uniform.quantize_affine with fp16 parameters, fused: each row of ``out`` [n, w + p]
    gets its packed codes (w bytes), then its fp16 ``scale`` and, with ``with_bias``, ``bias``.

    Without ``with_bias`` (symmetric) the stored scale is ``(hi - lo) / levels`` itself, as
    ``UniformCodec.encode`` stores it, not the quantizer's (1 for an all-zero row).
    """
    _quantize_rows(x, 0, x.shape[0], lo, hi, bits, with_bias, out)


@njit(nogil=True, cache=True, error_model="numpy")
def _quantize_rows(
    x: np.ndarray,
    first: int,
    stop: int,
    lo: np.ndarray,
    hi: np.ndarray,
    bits: int,
    with_bias: bool,
    out: np.ndarray,
) -> None:
    """Rows ``first`` to ``stop`` of :func:`quantize_half`, each width and bias option its own
    compiled loop: constant there, they let the compiler specialise the packing (measured 3x
    faster than one loop over a runtime width)."""
    if with_bias:
        if bits == 2:
            _quantize_span(x, first, stop, lo, hi, 2, True, out)
        elif bits == 3:
            _quantize_span(x, first, stop, lo, hi, 3, True, out)
        elif bits == 4:
            _quantize_span(x, first, stop, lo, hi, 4, True, out)
        elif bits == 8:
            _quantize_span(x, first, stop, lo, hi, 8, True, out)
        else:
            _quantize_span(x, first, stop, lo, hi, bits, True, out)
    elif bits == 2:
        _quantize_span(x, first, stop, lo, hi, 2, False, out)
    elif bits == 3:
        _quantize_span(x, first, stop, lo, hi, 3, False, out)
    elif bits == 4:
        _quantize_span(x, first, stop, lo, hi, 4, False, out)
    elif bits == 8:
        _quantize_span(x, first, stop, lo, hi, 8, False, out)
    else:
        _quantize_span(x, first, stop, lo, hi, bits, False, out)


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _quantize_span(
    x: np.ndarray,
    first: int,
    stop: int,
    lo: np.ndarray,
    hi: np.ndarray,
    bits: int,
    with_bias: bool,
    out: np.ndarray,
) -> None:
    width = (x.shape[1] * bits + 7) // 8
    codes = np.zeros(x.shape[1] + 8, np.uint8)
    for r in range(first, stop):
        _quantize_row(x, r, lo[r], hi[r], bits, width, with_bias, codes, out)


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _quantize_row(
    x: np.ndarray,
    r: int,
    lo: np.float32,
    hi: np.float32,
    bits: int,
    width: int,
    with_bias: bool,
    codes: np.ndarray,
    out: np.ndarray,
) -> None:
    """Row ``r`` of :func:`quantize_half` (``codes``: zeroed scratch of ``cols + 8``)."""
    cols = x.shape[1]
    top = _F32((1 << bits) - 1)
    bias = _half_round(lo)
    span = hi - bias
    scale = _half_round(span / top if span != 0 else _F32(1))
    inverse = _F32(1) / scale
    if scale == 0 or np.isinf(inverse):
        scale = _F32(1)
        inverse = _F32(1)
    for j in range(cols):
        codes[j] = np.uint8(min(max(np.rint((x[r, j] - bias) * inverse), _F32(0)), top))
    _pack(codes, cols, bits, out, r)
    if with_bias:
        _put_half(out, r, width, scale)
        _put_half(out, r, width + 2, bias)
    else:
        _put_half(out, r, width, _half_round((hi - lo) / top))


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _put_half(out: np.ndarray, r: int, at: int, value: np.float32) -> None:
    half = _half_bits(value)
    out[r, at] = np.uint8(half & _U32(0xFF))
    out[r, at + 1] = np.uint8(half >> _U32(8))


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _pack(codes: np.ndarray, cols: int, bits: int, out: np.ndarray, r: int) -> None:
    """Codes (``codes`` is zero past ``cols``) into row ``r`` of ``out`` in packing.py's layout."""
    if bits == 8:
        for j in range(cols):
            out[r, j] = codes[j]
    elif bits == 4:
        for k in range((cols + 1) // 2):
            out[r, k] = codes[2 * k] | (codes[2 * k + 1] << 4)
    elif bits == 2:
        for k in range((cols + 3) // 4):
            c = 4 * k
            out[r, k] = codes[c] | (codes[c + 1] << 2) | (codes[c + 2] << 4) | (codes[c + 3] << 6)
    elif bits == 3:
        # Eight codes fill three bytes; ``codes`` is zero past ``cols``, so whole groups only.
        width = (cols * 3 + 7) // 8
        for g in range((cols + 7) // 8):
            word = np.int64(0)
            for i in range(8):
                word |= np.int64(codes[8 * g + i]) << (3 * i)
            for k in range(min(3, width - 3 * g)):
                out[r, 3 * g + k] = np.uint8((word >> (8 * k)) & 0xFF)
    else:
        word = np.int64(0)
        filled = 0
        at = 0
        for j in range(cols):
            word |= np.int64(codes[j]) << filled
            filled += bits
            if filled >= 8:
                out[r, at] = np.uint8(word & 0xFF)
                word >>= 8
                filled -= 8
                at += 1
        if filled > 0:
            out[r, at] = np.uint8(word & 0xFF)


@njit(nogil=True, cache=True, error_model="numpy")
def dequantize(
    fused: np.ndarray,
    bits: int,
    cols: int,
    scale: np.ndarray,
    bias: np.ndarray,
    wide: bool,
    out: np.ndarray,
) -> None:
    """``scale * q + bias`` for the packed codes at the start of each row of ``fused``: in
    float32 like the torch path for fp16 parameters, in float64 (``wide``) for fp32 ones."""
    mask = (1 << bits) - 1
    for r in range(fused.shape[0]):
        s64 = scale[r]
        b64 = bias[r]
        s32 = _F32(s64)
        b32 = _F32(b64)
        if bits == 3:
            _decode_threes(fused, r, cols, s64, b64, s32, b32, wide, out)
            continue
        for j in range(cols):
            if bits == 8:
                q = np.int64(fused[r, j])
            elif bits == 4:
                q = np.int64(fused[r, j >> 1] >> ((j & 1) * 4)) & 15
            elif bits == 2:
                q = np.int64(fused[r, j >> 2] >> ((j & 3) * 2)) & 3
            else:
                at = j * bits
                byte = at >> 3
                shift = at & 7
                q = np.int64(fused[r, byte]) >> shift
                if shift + bits > 8:
                    q |= np.int64(fused[r, byte + 1]) << (8 - shift)
                q &= mask
            if wide:
                out[r, j] = _F32(np.float64(q) * s64 + b64)
            else:
                out[r, j] = _F32(q) * s32 + b32


@njit(nogil=True, cache=True, error_model="numpy", fastmath={"reassoc", "nsz"})
def kmeans_rows(
    x: np.ndarray,
    codebook: np.ndarray,
    rounds: int,
    scale: np.ndarray,
    bias: np.ndarray,
    codes: np.ndarray,
) -> None:
    """kmeans.py's per-row alternation, ``rounds`` times per row: codes of the nearest
    centroids under the row's ``scale`` and ``bias`` (into ``codes`` [n, cols]), then the
    least-squares ``scale`` and ``bias`` for those codes (updated in place). ``rounds`` 0:
    only the codes. Same float32 formulas as kmeans.py, sums in another order (reassociated,
    so that they vectorise)."""
    n, cols = x.shape
    mids = (codebook[1:] + codebook[:-1]) / _F32(2)
    edges = mids.shape[0]
    few = edges <= 15
    # Beyond 4 bits: start[i] = midpoints below grid cell i, cells spanning the midpoints.
    cells = 4 * (edges + 1)
    span = mids[edges - 1] - mids[0]
    cell_scale = _F32(cells) / span if span > 0 else _F32(0)
    start = np.searchsorted(mids, mids[0] + np.arange(cells) / np.float64(cell_scale))
    unit = np.empty(cols, _F32)
    count = np.empty(cols, np.int32)
    for r in range(n):
        s = scale[r]
        b = bias[r]
        for it in range(max(rounds, 1)):
            safe = s if s > 0 else _F32(1)
            for j in range(cols):
                unit[j] = (x[r, j] - b) / safe
                count[j] = 0
            # The nearest centroid's index is the number of midpoints below the value.
            if few:
                # One vectorised compare-and-add pass per midpoint, no branches (numba's
                # np.searchsorted per value measured 14x slower here at 4 bits).
                for m in range(edges):
                    edge = mids[m]
                    for j in range(cols):
                        count[j] += np.int32(unit[j] >= edge)
            else:
                # A grid cell's count, then a step or two to the exact one; a value on a
                # midpoint goes below it, as kmeans._nearest's torch.bucketize does.
                for j in range(cols):
                    u = unit[j]
                    cell = (u - mids[0]) * cell_scale
                    at = start[min(max(np.int64(cell), 0), cells - 1)] if cell == cell else 0
                    while at < edges and mids[at] < u:
                        at += 1
                    while at > 0 and mids[at - 1] >= u:
                        at -= 1
                    count[j] = at
            for j in range(cols):
                codes[r, j] = count[j]
            if it == rounds:
                break
            c_sum = _F32(0)
            x_sum = _F32(0)
            for j in range(cols):
                c_sum += codebook[codes[r, j]]
                x_sum += x[r, j]
            c_mean = c_sum / _F32(cols)
            x_mean = x_sum / _F32(cols)
            var = _F32(0)
            cov = _F32(0)
            for j in range(cols):
                dc = codebook[codes[r, j]] - c_mean
                var += dc * dc
                cov += dc * (x[r, j] - x_mean)
            # A row on a single centroid has no slope to fit: keep its scale, recentre its bias.
            fitted = max(cov / var if var > 0 else s, _F32(0))
            b = x_mean - fitted * c_mean
            s = fitted
        scale[r] = s
        bias[r] = b


@njit(nogil=True, cache=True, error_model="numpy")
def codebook_sums(
    x: np.ndarray,
    codes: np.ndarray,
    scale: np.ndarray,
    bias: np.ndarray,
    num: np.ndarray,
    den: np.ndarray,
) -> None:
    """Per centroid, the float64 sums of ``scale * (x - bias)`` and ``scale**2`` over the values
    coded to it (added into ``num`` and ``den``): kmeans._refit_codebook's weighted means."""
    for r in range(x.shape[0]):
        s = np.float64(scale[r])
        w = s * s
        for j in range(x.shape[1]):
            c = codes[r, j]
            num[c] += np.float64(x[r, j] - bias[r]) * s
            den[c] += w


@njit(nogil=True, cache=True, error_model="numpy")
def pack_rows(codes: np.ndarray, bits: int, out: np.ndarray) -> None:
    """packing.pack_codes for uint8 codes [n, cols] into the first bytes of each row of
    ``out``."""
    cols = codes.shape[1]
    row = np.zeros(cols + 8, np.uint8)
    for r in range(codes.shape[0]):
        row[:cols] = codes[r]
        _pack(row, cols, bits, out, r)


@njit(nogil=True, cache=True, error_model="numpy")
def _decode_threes(
    fused: np.ndarray,
    r: int,
    cols: int,
    s64: np.float64,
    b64: np.float64,
    s32: np.float32,
    b32: np.float32,
    wide: bool,
    out: np.ndarray,
) -> None:
    """:func:`dequantize` of one row of 3-bit codes, eight at a time."""
    whole = cols // 8
    for g in range(whole):
        # Three bytes hold eight 3-bit codes.
        word = (
            np.int64(fused[r, 3 * g])
            | (np.int64(fused[r, 3 * g + 1]) << 8)
            | (np.int64(fused[r, 3 * g + 2]) << 16)
        )
        for i in range(8):
            q = (word >> (3 * i)) & 7
            if wide:
                out[r, 8 * g + i] = _F32(np.float64(q) * s64 + b64)
            else:
                out[r, 8 * g + i] = _F32(q) * s32 + b32
    for j in range(8 * whole, cols):
        at = 3 * j
        q = np.int64(fused[r, at >> 3]) >> (at & 7)
        if (at & 7) > 5:
            q |= np.int64(fused[r, (at >> 3) + 1]) << (8 - (at & 7))
        q &= 7
        if wide:
            out[r, j] = _F32(np.float64(q) * s64 + b64)
        else:
            out[r, j] = _F32(q) * s32 + b32
