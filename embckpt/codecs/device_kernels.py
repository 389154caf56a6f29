"""Triton kernels of the GPU encoder (device_encode.py) and decoder (device_decode.py): the
uniform codecs' fused rows, computed where the rows live so that only the packed bytes cross
between host and device.

Why these bytes are the CPU's: every value that decides a byte goes through the same float32
operations, in the same order, as the numba kernels (uniform_kernels.py, adaptive_kernels.py)
and uniform.py's planning: IEEE division (``div_rn``), fp16 rounding by conversion (round to
nearest even, as fp16_bits.py's bit trick), no fused multiply-add (the launch passes
``enable_fp_fusion=False``), each row's sums of squares left to right over its columns (the
canonical order adaptive_kernels.search_rows keeps). Rounding is ``rint(clamp(t, 0, top))``,
which for finite ``t`` equals the numba kernels' ``clamp(rint(t), 0, top)`` (but for the sign
of a zero, which no sum or code sees), as ``(c + 2**23) - 2**23``: exact round-half-to-even
for ``0 <= c < 2**23``, in plain IEEE arithmetic that Triton's interpreter (numpy) runs too,
where libdevice's ``rint`` does not.

Layout: a program takes ``BLOCK`` rows, one per thread; every pass over a row is a loop over
its columns inside the kernel, so each thread's sums run in column order, and a block's rows
(16 KB for 64 rows of 64 columns) stay in L1 or L2 across the search's passes. The loops are
unrolled ``UNROLL`` columns deep, so that a thread has that many loads in flight (measured on
an H100: 2-3x faster for ``asymmetric``, whose first pass waits on memory; the order of the
operations does not change).

Per row the kernel also writes ``ok``: the row is finite and fp16 parameters hold it as
uniform.py would decide (``half_params_fit``, or symmetric's own test); the caller uses the
bytes only when every row is ok.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Kernels read module globals only as constexprs.
ASYMMETRIC = tl.constexpr(0)
SYMMETRIC = tl.constexpr(1)
ADAPTIVE = tl.constexpr(2)
_FP16_SAFE_MAX = tl.constexpr(65000.0)  # uniform.py's
_FP16_MIN_NORMAL = tl.constexpr(2.0**-14)
_FP16_REL = tl.constexpr(2.0**-11)
_ROUNDER = tl.constexpr(8388608.0)  # 2**23: adding and subtracting it rounds [0, 2**23)
_INF = tl.constexpr(float("inf"))


@triton.jit
def _half_round(value):
    """float32(float16(value)): round to nearest even, infinity beyond fp16's range."""
    return value.to(tl.float16).to(tl.float32)


@triton.jit
def _level(t, top):
    """clamp(rint(t), 0, top) for finite ``t`` (the zero's sign aside)."""
    c = tl.minimum(tl.maximum(t, 0.0), top)
    return (c + _ROUNDER) - _ROUNDER


@triton.jit
def _extremes(base, live, COLS: tl.constexpr, UNROLL: tl.constexpr):
    """Each row's min and max (a zero one as the row's first zero, 0.0 or -0.0, as
    adaptive_kernels._minmax and _first_zero), max |x|, and whether it is finite: one pass,
    on the values' bits ordered as integers (adaptive_kernels._order_key)."""
    low = tl.full(live.shape, 2147483647, tl.int32)
    high = tl.full(live.shape, -2147483647 - 1, tl.int32)
    peak = tl.zeros(live.shape, tl.int32)
    exponent = tl.zeros(live.shape, tl.int32)
    zero_bits = tl.zeros(live.shape, tl.int32)
    zero_seen = tl.zeros(live.shape, tl.int32)
    for j in tl.range(COLS, loop_unroll_factor=UNROLL):
        bits = tl.load(base + j, mask=live, other=0.0).to(tl.int32, bitcast=True)
        magnitude = bits & 0x7FFFFFFF
        sign = bits >> 31
        key = (magnitude ^ sign) - sign
        low = tl.minimum(low, key)
        high = tl.maximum(high, key)
        peak = tl.maximum(peak, magnitude)
        exponent = tl.maximum(exponent, bits & 0x7F800000)
        first = (magnitude == 0) & (zero_seen == 0)
        zero_bits = tl.where(first, bits, zero_bits)
        zero_seen = tl.where(magnitude == 0, 1, zero_seen)
    zero = zero_bits.to(tl.float32, bitcast=True)
    xmin = tl.where(low == 0, zero, _key_value(low))
    xmax = tl.where(high == 0, zero, _key_value(high))
    return xmin, xmax, peak.to(tl.float32, bitcast=True), exponent != 0x7F800000


@triton.jit
def _key_value(key):
    """The float of an order key (adaptive_kernels._key_value)."""
    sign = key >> 31
    magnitude = (key ^ sign) - sign
    return (magnitude | (sign << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _fits(lo, hi, top):
    """uniform.half_params_fit, per row."""
    lo16 = _half_round(lo)
    width = hi - lo
    scale = tl.math.div_rn(width, top)
    constant = width == 0
    ok = tl.maximum(tl.abs(lo), tl.abs(hi)) < _FP16_SAFE_MAX
    ok &= constant | (scale >= _FP16_MIN_NORMAL)
    allowed = tl.where(constant, tl.abs(lo) * _FP16_REL, 0.5 * scale)
    return ok & (tl.abs(lo - lo16) <= allowed)


@triton.jit
def _symmetric_range(peak, BITS: tl.constexpr):
    """SymmetricCodec._plan with fp16 parameters, per row: its range and whether fp16 holds it.

    The plan divides in float64 and rounds to fp16 through float32, as torch converts; for a
    float32 ``peak`` and a small odd divisor ``k``, float32(float64(peak / k)) is the float32
    quotient itself (no double rounding: the quotient is never within 2**-53 of a float32
    midpoint), and comparisons with it are exact float32 comparisons with ``peak``."""
    half_levels: tl.constexpr = 1 << (BITS - 1)
    k: tl.constexpr = half_levels - 1
    fits = tl.math.div_rn(peak * half_levels, k * 1.0) < _FP16_SAFE_MAX
    fits &= (peak == 0) | (peak >= k * _FP16_MIN_NORMAL)
    rounded = tl.math.div_rn(peak, k * 1.0).to(tl.float16)
    bumped = (rounded.to(tl.int16, bitcast=True) + 1).to(tl.float16, bitcast=True)
    # Rounded down (below peak / k): one fp16 step up, so that max|x| stays on the grid.
    scale = tl.where(rounded.to(tl.float32) * k < peak, bumped, rounded).to(tl.float32)
    return -half_levels * scale, k * scale, fits


@triton.jit
def _scoring(lo, hi, top):
    """adaptive_kernels._scoring with fp16 parameters: (1 / scale, lo / scale, scale**2)."""
    lo = _half_round(lo)
    span = hi - lo
    scale = _half_round(tl.where(span > 0, tl.math.div_rn(span, top), 1.0))
    scale = tl.where(scale > 0, scale, 1.0)
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    return inv, lo * inv, scale * scale


@triton.jit
def _sumsq(base, live, inv, off, top, COLS: tl.constexpr, UNROLL: tl.constexpr):
    """Each row's sum of (t - clamp(rint(t), 0, top))**2, t = x * inv - off, left to right."""
    acc = tl.zeros(live.shape, tl.float32)
    for j in tl.range(COLS, loop_unroll_factor=UNROLL):
        t = tl.load(base + j, mask=live, other=0.0) * inv - off
        d = t - _level(t, top)
        acc += d * d
    return acc


@triton.jit
def _sumsq2(base, live, inv1, off1, inv2, off2, top, COLS: tl.constexpr, UNROLL: tl.constexpr):
    """:func:`_sumsq` for two ranges in one pass over the rows."""
    acc1 = tl.zeros(live.shape, tl.float32)
    acc2 = tl.zeros(live.shape, tl.float32)
    for j in tl.range(COLS, loop_unroll_factor=UNROLL):
        v = tl.load(base + j, mask=live, other=0.0)
        t = v * inv1 - off1
        d = t - _level(t, top)
        acc1 += d * d
        t = v * inv2 - off2
        d = t - _level(t, top)
        acc2 += d * d
    return acc1, acc2


@triton.jit
def _search(
    base, live, xmin, xmax, top, bins, COLS: tl.constexpr, STEPS: tl.constexpr, UNROLL: tl.constexpr
):
    """adaptive_kernels.search_rows' greedy walk with fp16 parameters: each row's best range."""
    cur_lo = xmin
    cur_hi = xmax
    step = tl.math.div_rn(xmax - xmin, bins)
    inv, off, square = _scoring(cur_lo, cur_hi, top)
    loss = _sumsq(base, live, inv, off, top, COLS, UNROLL) * square
    best = tl.full(live.shape, _INF, tl.float32)
    lo = xmin
    hi = xmax
    for _ in range(STEPS):
        inv1, off1, sq1 = _scoring(cur_lo + step, cur_hi, top)
        inv2, off2, sq2 = _scoring(cur_lo, cur_hi - step, top)
        ups, downs = _sumsq2(base, live, inv1, off1, inv2, off2, top, COLS, UNROLL)
        up = ups * sq1
        down = downs * sq2
        # A local optimum: both neighbours are worse. Keep the best one met so far.
        keep = (loss < up) & (loss < down) & (loss < best)
        best = tl.where(keep, loss, best)
        lo = tl.where(keep, cur_lo, lo)
        hi = tl.where(keep, cur_hi, hi)
        move_up = up < down
        cur_lo = tl.where(move_up, cur_lo + step, cur_lo)
        cur_hi = tl.where(move_up, cur_hi, cur_hi - step)
        loss = tl.where(move_up, up, down)
    return lo, hi


@triton.jit
def _put_half(row, at, value, live):
    """``value`` (exact in fp16, or an infinity) as fp16 little-endian bytes at ``row + at``."""
    half = value.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    tl.store(row + at, (half & 0xFF).to(tl.uint8), mask=live)
    tl.store(row + at + 1, (half >> 8).to(tl.uint8), mask=live)


@triton.jit
def _quantize(
    base,
    row,
    live,
    lo,
    hi,
    top,
    COLS: tl.constexpr,
    BITS: tl.constexpr,
    PER: tl.constexpr,
    NBYTES: tl.constexpr,
    WITH_BIAS: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """uniform_kernels._quantize_row and pack_row: each row's codes over [lo, hi], packed in
    groups of ``PER`` codes into ``NBYTES`` bytes (packing.py's layout), then its fp16
    parameters."""
    bias = _half_round(lo)
    span = hi - bias
    scale = _half_round(tl.where(span != 0, tl.math.div_rn(span, top), 1.0))
    inverse = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    bad = (scale == 0) | (tl.abs(inverse) == _INF)
    scale = tl.where(bad, 1.0, scale)
    inverse = tl.where(bad, 1.0, inverse)
    width: tl.constexpr = (COLS * BITS + 7) // 8
    for g in tl.range((COLS + PER - 1) // PER, loop_unroll_factor=UNROLL // PER):
        word = tl.zeros(live.shape, tl.int32)
        for i in tl.static_range(PER):
            col = g * PER + i
            v = tl.load(base + col, mask=live & (col < COLS), other=0.0)
            code = _level((v - bias) * inverse, top).to(tl.int32)
            word |= tl.where(col < COLS, code, 0) << (BITS * i)
        for b in tl.static_range(NBYTES):
            at = g * NBYTES + b
            tl.store(row + at, ((word >> (8 * b)) & 0xFF).to(tl.uint8), mask=live & (at < width))
    if WITH_BIAS:
        _put_half(row, width, scale, live)
        _put_half(row, width + 2, bias, live)
    else:
        _put_half(row, width, _half_round(tl.math.div_rn(hi - lo, top)), live)


@triton.jit
def encode_rows(
    x_ptr,
    out_ptr,
    ok_ptr,
    n,
    x_stride,
    out_stride,
    bins,
    COLS: tl.constexpr,
    STEPS: tl.constexpr,
    MODE: tl.constexpr,
    CHECK_EXTREMES: tl.constexpr,
    BITS: tl.constexpr,
    PER: tl.constexpr,
    NBYTES: tl.constexpr,
    BLOCK: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """Fused rows [n, width + params] of float32 rows [n, COLS] (unit column stride) for one
    codec (``MODE``), and each row's ``ok``; ``bins`` (float32) and ``STEPS``: the adaptive
    walk's; ``CHECK_EXTREMES``: adaptive's ``auto`` test of the rows' own min and max.

    The widths are compile-time constants (one kernel per table width, bits and codec: a
    checkpoint has few), so the loops over columns have constant bounds."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = rows < n
    base = x_ptr + rows.to(tl.int64) * x_stride
    row = out_ptr + rows.to(tl.int64) * out_stride
    top = ((1 << BITS) - 1) * 1.0
    xmin, xmax, peak, ok = _extremes(base, live, COLS, UNROLL)
    if MODE == SYMMETRIC:
        lo, hi, fits = _symmetric_range(peak, BITS)
        ok &= fits
    elif MODE == ADAPTIVE:
        lo, hi = _search(base, live, xmin, xmax, top, bins, COLS, STEPS, UNROLL)
        ok &= _fits(lo, hi, top)
        if CHECK_EXTREMES:
            ok &= _fits(xmin, xmax, top)
    else:
        lo = xmin
        hi = xmax
        ok &= _fits(lo, hi, top)
    _quantize(base, row, live, lo, hi, top, COLS, BITS, PER, NBYTES, MODE != SYMMETRIC, UNROLL)
    tl.store(ok_ptr + rows, ok.to(tl.int8), mask=live)


@triton.jit
def _param(row, at, live, HALF: tl.constexpr):
    """A row's fp16 (``HALF``) or fp32 parameter at byte ``at``, little-endian, as float64."""
    if HALF:
        low = tl.load(row + at, mask=live, other=0).to(tl.int32)
        high = tl.load(row + at + 1, mask=live, other=0).to(tl.int32)
        bits16 = (low | (high << 8)).to(tl.int16)
        return bits16.to(tl.float16, bitcast=True).to(tl.float32).to(tl.float64)
    word = tl.zeros(live.shape, tl.int32)
    for k in tl.static_range(4):
        word |= tl.load(row + at + k, mask=live, other=0).to(tl.int32) << (8 * k)
    return word.to(tl.float32, bitcast=True).to(tl.float64)


@triton.jit
def decode_rows(
    fused_ptr,
    out_ptr,
    n,
    fused_stride,
    out_stride,
    COLS: tl.constexpr,
    COLS_P2: tl.constexpr,
    BITS: tl.constexpr,
    WIDTH: tl.constexpr,
    HALF: tl.constexpr,
    BIAS_STORED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """float32 rows [n, COLS] (unit column stride) from fused rows [n, WIDTH + params]: each
    value ``scale * q + bias`` as uniform_kernels.dequantize computes it, in float32 for fp16
    parameters (``HALF``), in float64 rounded once for fp32 ones; without ``BIAS_STORED``
    (symmetric) the bias is ``-2**(BITS-1) * scale``, exact in float64."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = rows < n
    row = fused_ptr + rows.to(tl.int64) * fused_stride
    s64 = _param(row, WIDTH, live, HALF)
    if BIAS_STORED:
        b64 = _param(row, WIDTH + (2 if HALF else 4), live, HALF)
    else:
        b64 = -((1 << (BITS - 1)) * 1.0) * s64
    cols = tl.arange(0, COLS_P2)
    cell = live[:, None] & (cols < COLS)[None, :]
    at = cols * BITS
    first = (at >> 3)[None, :]
    shift = (at & 7)[None, :]
    word = tl.load(row[:, None] + first, mask=cell, other=0).to(tl.int32)
    spill = cell & (shift + BITS > 8) & (first + 1 < WIDTH)
    word |= tl.load(row[:, None] + first + 1, mask=spill, other=0).to(tl.int32) << 8
    q = (word >> shift) & ((1 << BITS) - 1)
    if HALF:
        value = q.to(tl.float32) * s64.to(tl.float32)[:, None] + b64.to(tl.float32)[:, None]
    else:
        value = (q.to(tl.float64) * s64[:, None] + b64[:, None]).to(tl.float32)
    target = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(target, value, mask=cell)


#: Whether Triton's interpreter runs these kernels (``TRITON_INTERPRET`` was on at import).
INTERPRETED = not isinstance(encode_rows, triton.runtime.JITFunction)
