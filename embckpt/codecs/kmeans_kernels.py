"""Compiled per-row kernels (numba) of the kmeans codec (kmeans.py) on CPU tensors: the
alternation of nearest centroids and least-squares scale and bias (``kmeans_rows``), the
codebook refit's sums (``codebook_sums``) and the codes' packing (``pack_rows``), each row kept
in L1 across its rounds.

Contract: as uniform_kernels.py states it for every compiled kernel (fixed dtypes, compiled
once and cached on disk, GIL released, numpy's error model); ``kmeans_rows`` keeps kmeans.py's
float32 formulas but sums in another order (reassociated, so that the sums vectorise).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from embckpt.codecs.uniform_kernels import pack_row

_F32 = np.float32


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
        pack_row(row, cols, bits, out, r)
