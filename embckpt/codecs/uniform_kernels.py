"""Compiled per-row kernels (numba) of the uniform codecs (uniform.py) on CPU tensors: each
row quantized, packed and written as a fused row in one pass (``quantize_half``), and decoded
in one (``dequantize``), while it stays in L1 and registers, where the torch path makes a pass
over the whole batch per operation (uniform.py gives the measured speeds). The range search
(adaptive_kernels.py) quantizes through ``quantize_rows``, k-means (kmeans_kernels.py) packs
through ``pack_row``.

Contract (of these kernels and of adaptive_kernels.py's and kmeans_kernels.py's): kernels take
C-contiguous numpy arrays of fixed dtypes (float32 rows and ranges, uint8 bytes, float64
parameters; int and bool options), so each compiles once, lazily on its first call, and numba
caches the machine code on disk (``cache=True``); they release the GIL (``nogil``: the writer
encodes in threads), and divide by zero as IEEE says (numpy's error model), as torch does.
Quantization and decoding reproduce the torch path of uniform.py bit for bit (same float32
operations in the same order, no fused multiply-add). CUDA tensors never come here: they take
device_encode.py or torch.

numba's disk cache sees edits to a kernel's own file only: after editing this file (or
fp16_bits.py), delete the ``*.nbi`` and ``*.nbc`` files of codecs/__pycache__, so that the
kernels of adaptive_kernels.py and kmeans_kernels.py compile again.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from embckpt.codecs.fp16_bits import bits_f32, half_bits, half_round, half_value

_F32 = np.float32
_U32 = np.uint32


@njit(nogil=True, cache=True, error_model="numpy")
def quantize_half(
    x: np.ndarray, lo: np.ndarray, hi: np.ndarray, bits: int, with_bias: bool, out: np.ndarray
) -> None:
    """uniform.quantize_affine with fp16 parameters, fused: each row of ``out`` [n, w + p]
    gets its packed codes (w bytes), then its fp16 ``scale`` and, with ``with_bias``, ``bias``.

    Without ``with_bias`` (symmetric) the stored scale is ``(hi - lo) / levels`` itself, as
    ``UniformCodec.encode`` stores it, not the quantizer's (1 for an all-zero row).
    """
    quantize_rows(x, 0, x.shape[0], lo, hi, bits, with_bias, out)


@njit(nogil=True, cache=True, error_model="numpy")
def quantize_rows(
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
    bias = half_round(lo)
    span = hi - bias
    scale = half_round(span / top if span != 0 else _F32(1))
    inverse = _F32(1) / scale
    if scale == 0 or np.isinf(inverse):
        scale = _F32(1)
        inverse = _F32(1)
    for j in range(cols):
        codes[j] = np.uint8(min(max(np.rint((x[r, j] - bias) * inverse), _F32(0)), top))
    pack_row(codes, cols, bits, out, r)
    if with_bias:
        _put_half(out, r, width, scale)
        _put_half(out, r, width + 2, bias)
    else:
        _put_half(out, r, width, half_round((hi - lo) / top))


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _put_half(out: np.ndarray, r: int, at: int, value: np.float32) -> None:
    half = half_bits(value)
    out[r, at] = np.uint8(half & _U32(0xFF))
    out[r, at + 1] = np.uint8(half >> _U32(8))


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def pack_row(codes: np.ndarray, cols: int, bits: int, out: np.ndarray, r: int) -> None:
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


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def word_at(row: np.ndarray, at: int) -> np.uint32:
    """The little-endian 32-bit word at ``row[at:at + 4]`` (``row``: bytes, 1-D)."""
    return (
        _U32(row[at])
        | (_U32(row[at + 1]) << _U32(8))
        | (_U32(row[at + 2]) << _U32(16))
        | (_U32(row[at + 3]) << _U32(24))
    )


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _half_word(row: np.ndarray, at: int) -> np.uint32:
    """The little-endian 16-bit word at ``row[at:at + 2]``."""
    return _U32(row[at]) | (_U32(row[at + 1]) << _U32(8))


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def params_of(
    row: np.ndarray, at: int, bits: int, half: bool, bias_stored: bool
) -> tuple[np.float64, np.float64]:
    """A fused row's scale and bias from its bytes at ``at`` (fp16 when ``half``, else fp32;
    without a stored bias, the symmetric grid's ``-2**(bits-1) * scale``)."""
    if half:
        scale = np.float64(half_value(_half_word(row, at)))
        if not bias_stored:
            return scale, -np.float64(1 << (bits - 1)) * scale
        return scale, np.float64(half_value(_half_word(row, at + 2)))
    scale = np.float64(bits_f32(word_at(row, at)))
    if not bias_stored:
        return scale, -np.float64(1 << (bits - 1)) * scale
    return scale, np.float64(bits_f32(word_at(row, at + 4)))


@njit(nogil=True, cache=True, error_model="numpy")
def dequantize(
    fused: np.ndarray,
    bits: int,
    cols: int,
    half: bool,
    bias_stored: bool,
    out: np.ndarray,
) -> None:
    """``scale * q + bias`` for the packed codes at the start of each row of ``fused``, its
    parameters read from the row's tail (fp16 when ``half``, else fp32; the bias implied
    where not ``bias_stored``): in float32 like the torch path for fp16 parameters, in
    float64 for fp32 ones. Reading them here, not gathered into arrays first, saved the
    strided copies and casts that took most of a 4-bit full's decode (10.2M rows of 16
    columns: 160 of 440 ms on a rank).

    Each width has a loop over rows of its own, the width and ``wide`` fixed outside the
    row's loop over codes, which the compiler vectorises for 2 and 4 bits, the defaults:
    measured 3x faster for 4-bit rows of 128 columns (0.70 to 0.23 ns a value), 2.3x for 16,
    the same values bit for bit. One loop taking the width as an argument measured 3-4x
    slower (the codes per byte are then unknown to the compiler). The loops over one row's
    codes (:func:`fours`, :func:`twos`, :func:`threes`, :func:`any_width`) are shared with
    ``delta_kernels.add_coded``; each width's loop over rows stays a function of its own:
    inlined into this one body, 4-bit rows of 16 columns decoded 7% slower.
    """
    at = (cols * bits + 7) // 8
    if bits == 4:
        _rows_of_four(fused, cols, at, not half, bias_stored, out)
    elif bits == 2:
        _rows_of_two(fused, cols, at, not half, bias_stored, out)
    elif bits == 3:
        _rows_of_three(fused, cols, at, not half, bias_stored, out)
    else:
        for r in range(fused.shape[0]):
            row = fused[r]
            s64, b64 = params_of(row, at, bits, half, bias_stored)
            any_width(row, bits, cols, s64, b64, not half, out[r])


@njit(nogil=True, cache=True, error_model="numpy")
def _rows_of_four(
    fused: np.ndarray, cols: int, at: int, wide: bool, bias_stored: bool, out: np.ndarray
) -> None:
    """:func:`dequantize` of 4-bit rows."""
    for r in range(fused.shape[0]):
        row = fused[r]
        s64, b64 = params_of(row, at, 4, not wide, bias_stored)
        fours(row, cols, s64, b64, wide, out[r])


@njit(nogil=True, cache=True, error_model="numpy")
def _rows_of_two(
    fused: np.ndarray, cols: int, at: int, wide: bool, bias_stored: bool, out: np.ndarray
) -> None:
    """:func:`dequantize` of 2-bit rows."""
    for r in range(fused.shape[0]):
        row = fused[r]
        s64, b64 = params_of(row, at, 2, not wide, bias_stored)
        twos(row, cols, s64, b64, wide, out[r])


@njit(nogil=True, cache=True, error_model="numpy")
def _rows_of_three(
    fused: np.ndarray, cols: int, at: int, wide: bool, bias_stored: bool, out: np.ndarray
) -> None:
    """:func:`dequantize` of 3-bit rows."""
    for r in range(fused.shape[0]):
        row = fused[r]
        s64, b64 = params_of(row, at, 3, not wide, bias_stored)
        threes(row, cols, s64, b64, wide, out[r])


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def any_width(
    row: np.ndarray,
    bits: int,
    cols: int,
    s64: np.float64,
    b64: np.float64,
    wide: bool,
    out: np.ndarray,
) -> None:
    """A row of codes of any width up to 8 bits, one code at a time."""
    s32, b32 = _F32(s64), _F32(b64)
    mask = (1 << bits) - 1
    for j in range(cols):
        if bits == 8:
            q = np.int64(row[j])
        else:
            bit = j * bits
            byte = bit >> 3
            shift = bit & 7
            q = np.int64(row[byte]) >> shift
            if shift + bits > 8:
                q |= np.int64(row[byte + 1]) << (8 - shift)
            q &= mask
        if wide:
            out[j] = _F32(np.float64(q) * s64 + b64)
        else:
            out[j] = _F32(q) * s32 + b32


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def threes(
    row: np.ndarray,
    cols: int,
    s64: np.float64,
    b64: np.float64,
    wide: bool,
    out: np.ndarray,
) -> None:
    """A row of 3-bit codes, eight at a time."""
    s32, b32 = _F32(s64), _F32(b64)
    whole = cols // 8
    for g in range(whole):
        # Three bytes hold eight 3-bit codes.
        word = (
            np.int64(row[3 * g])
            | (np.int64(row[3 * g + 1]) << 8)
            | (np.int64(row[3 * g + 2]) << 16)
        )
        for i in range(8):
            q = (word >> (3 * i)) & 7
            if wide:
                out[8 * g + i] = _F32(np.float64(q) * s64 + b64)
            else:
                out[8 * g + i] = _F32(q) * s32 + b32
    for j in range(8 * whole, cols):
        at = 3 * j
        q = np.int64(row[at >> 3]) >> (at & 7)
        if (at & 7) > 5:
            q |= np.int64(row[(at >> 3) + 1]) << (8 - (at & 7))
        q &= 7
        if wide:
            out[j] = _F32(np.float64(q) * s64 + b64)
        else:
            out[j] = _F32(q) * s32 + b32


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def fours(
    row: np.ndarray,
    cols: int,
    s64: np.float64,
    b64: np.float64,
    wide: bool,
    out: np.ndarray,
) -> None:
    """A row of 4-bit codes, two a byte (low nibble first)."""
    s32, b32 = _F32(s64), _F32(b64)
    pairs = cols // 2
    if wide:
        for k in range(pairs):
            byte = row[k]
            out[2 * k] = _F32(np.float64(byte & 15) * s64 + b64)
            out[2 * k + 1] = _F32(np.float64(byte >> 4) * s64 + b64)
    else:
        for k in range(pairs):
            byte = row[k]
            out[2 * k] = _F32(byte & 15) * s32 + b32
            out[2 * k + 1] = _F32(byte >> 4) * s32 + b32
    if cols & 1:
        q = row[pairs] & 15
        out[cols - 1] = _F32(np.float64(q) * s64 + b64) if wide else _F32(q) * s32 + b32


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def twos(
    row: np.ndarray,
    cols: int,
    s64: np.float64,
    b64: np.float64,
    wide: bool,
    out: np.ndarray,
) -> None:
    """A row of 2-bit codes, four a byte (lowest bits first)."""
    s32, b32 = _F32(s64), _F32(b64)
    quads = cols // 4
    if wide:
        for k in range(quads):
            byte = row[k]
            for i in range(4):
                q = (byte >> (2 * i)) & 3
                out[4 * k + i] = _F32(np.float64(q) * s64 + b64)
    else:
        for k in range(quads):
            byte = row[k]
            for i in range(4):
                q = (byte >> (2 * i)) & 3
                out[4 * k + i] = _F32(q) * s32 + b32
    for j in range(4 * quads, cols):
        q = (row[j >> 2] >> ((j & 3) * 2)) & 3
        out[j] = _F32(np.float64(q) * s64 + b64) if wide else _F32(q) * s32 + b32
