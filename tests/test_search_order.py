"""The adaptive search's canonical arithmetic: adaptive_kernels.search_rows against a numpy walk.

The reference runs the greedy walk of adaptive.py with every float32 operation spelled out in
numpy (no fused multiply-add, no reassociation), each row's sum of squares left to right over
its columns, min and max left to right (a zero one is the row's first zero). The compiled
kernel, and through it the codec's bytes, must match it exactly: that order is what the GPU
encoder (device_kernels.py) reproduces, so ties between candidate ranges fall the same way
everywhere.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from codec_rows import embedding_rows

from embckpt.codecs.adaptive import AdaptiveCodec
from embckpt.codecs.base import fixed_binary_values
from embckpt.codecs.packing import pack_codes
from embckpt.codecs.uniform import half_params_fit

F32 = np.float32


def _half(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).astype(F32)


def _scoring(
    lo: np.ndarray, hi: np.ndarray, top: np.float32, half: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(1 / scale, lo / scale, scale**2) of each range, as adaptive.range_loss sets them."""
    if half:
        lo = _half(lo)
    span = hi - lo
    scale = np.where(span > 0, span / top, F32(1))
    if half:
        scale = _half(scale)
        scale = np.where(scale > 0, scale, F32(1))
    inv = F32(1) / scale
    return inv, lo * inv, scale * scale


def _sumsq(x: np.ndarray, inv: np.ndarray, off: np.ndarray, top: np.float32) -> np.ndarray:
    """Each row's sum of squared rounding errors, left to right over its columns."""
    acc = np.zeros(len(x), F32)
    for j in range(x.shape[1]):
        t = x[:, j] * inv - off
        d = t - np.minimum(np.maximum(np.rint(t), F32(0)), top)
        acc = acc + d * d
    return acc


def reference_walk(
    x: np.ndarray, bits: int, n_bins: int, steps: int, half: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's range by the greedy walk, all rows at once, one column at a time."""
    top = F32((1 << bits) - 1)
    cur_lo, cur_hi = x[:, 0].copy(), x[:, 0].copy()
    for j in range(x.shape[1]):
        cur_lo = np.where(x[:, j] < cur_lo, x[:, j], cur_lo)
        cur_hi = np.where(x[:, j] > cur_hi, x[:, j], cur_hi)
    step = (cur_hi - cur_lo) / F32(n_bins)
    inv, off, square = _scoring(cur_lo, cur_hi, top, half)
    loss = _sumsq(x, inv, off, top) * square
    best = np.full(len(x), np.inf, F32)
    lo, hi = cur_lo.copy(), cur_hi.copy()
    for _ in range(steps):
        inv1, off1, sq1 = _scoring(cur_lo + step, cur_hi, top, half)
        inv2, off2, sq2 = _scoring(cur_lo, cur_hi - step, top, half)
        up = _sumsq(x, inv1, off1, top) * sq1
        down = _sumsq(x, inv2, off2, top) * sq2
        keep = (loss < up) & (loss < down) & (loss < best)
        best = np.where(keep, loss, best)
        lo = np.where(keep, cur_lo, lo)
        hi = np.where(keep, cur_hi, hi)
        move_up = up < down
        cur_lo = np.where(move_up, cur_lo + step, cur_lo)
        cur_hi = np.where(move_up, cur_hi, cur_hi - step)
        loss = np.where(move_up, up, down)
    return lo, hi


def reference_fused(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, bits: int) -> np.ndarray:
    """The fused rows of ``x`` quantized over [lo, hi] with fp16 scale and bias."""
    top = F32((1 << bits) - 1)
    bias = _half(lo)
    span = hi - bias
    scale = _half(np.where(span != 0, span / top, F32(1)))
    inverse = F32(1) / scale
    bad = (scale == 0) | np.isinf(inverse)
    scale, inverse = np.where(bad, F32(1), scale), np.where(bad, F32(1), inverse)
    t = (x - bias[:, None]) * inverse[:, None]
    codes = np.minimum(np.maximum(np.rint(t), F32(0)), top).astype(np.uint8)
    packed = pack_codes(torch.from_numpy(codes), bits).numpy()
    params = np.stack([scale.astype(np.float16), bias.astype(np.float16)], axis=1)
    return np.concatenate([packed, params.view(np.uint8)], axis=1)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("cols", [5, 37])
def test_kernel_search_is_the_sequential_walk(bits: int, cols: int) -> None:
    from embckpt.codecs import adaptive_kernels

    codec = AdaptiveCodec(bits=bits, entropy="none")
    steps = codec._steps()
    x = embedding_rows(300, cols, seed=bits * cols, tiny=False)
    xn = x.numpy()
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for half in (False, True):
            ref_lo, ref_hi = reference_walk(xn, bits, codec.n_bins, steps, half)
            lo, hi, xmin, xmax = (np.empty(len(xn), dtype=F32) for _ in range(4))
            none = np.empty((0, 0), dtype=np.uint8)
            assert adaptive_kernels.search_rows(
                xn, bits, codec.n_bins, steps, half, lo, hi, xmin, xmax, False, none
            )
            assert np.array_equal(lo.view(np.uint32), ref_lo.view(np.uint32)), (half, cols)
            assert np.array_equal(hi.view(np.uint32), ref_hi.view(np.uint32)), (half, cols)
        expected = reference_fused(xn, ref_lo, ref_hi, bits)
    # The codec's bytes, on the rows that fp16 parameters hold (else the batch takes fp32).
    fits = [
        half_params_fit(x[r : r + 1].amin(1), x[r : r + 1].amax(1), bits)
        and half_params_fit(
            torch.from_numpy(ref_lo[r : r + 1]), torch.from_numpy(ref_hi[r : r + 1]), bits
        )
        for r in range(len(x))
    ]
    assert sum(fits) > 250
    encoded = codec.encode(x[fits])
    assert encoded.metadata["param_dtype"] == "float16"
    assert np.array_equal(fixed_binary_values(encoded.columns["payload"]), expected[fits])
