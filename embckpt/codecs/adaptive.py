"""``adaptive``: Check-N-Run's adaptive uniform quantization (format: ``asymmetric``'s).

Each row is quantized exactly like ``asymmetric`` (FBGEMM's fused n-bit row, fp16 scale and
bias), but over a clipping range [lo, hi] chosen per row to minimise the l2 error, instead of
the row's full [min, max]. Files decode with the asymmetric decoder; only encoding differs.

The range search is FBGEMM/caffe2's ``param_search_greedy``: with ``step = (max - min) /
n_bins``, start from the full range and repeatedly shrink it by one step from whichever end gives
the lower l2 error (computed with fp16-rounded scale and bias, as FBGEMM will store them), at most
``floor(n_bins * ratio)`` times, and keep the best range among the local optima met on the way
(the full range when there is none).

Defaults per bit width, chosen on trained DLRM tables (benchmarks/codecs.py): every default
walks 5 steps of about a third of a quantization step (``n_bins ~ 3.3 * (2**bits - 1)``), which
captures nearly all of the error that Check-N-Run's reported setting (25 bins, ratio 0.6: 15
steps) or caffe2's (200, 0.16: 32 steps) recovers, at a third of the cost or less (l2 error vs
asymmetric: 0.75, 0.87, 0.92, 0.95 at 2, 3, 4, 8 bits).

Cost: each step scores two ranges exactly, so encoding quantizes every row about 11 times.
On CPU tensors one compiled pass (adaptive_kernels.search_rows) takes a tile of rows at a
time: their min and max (integer reductions), the walk in lockstep (each step: every row's
candidate scales, the rows' sums of squares, every row's choice without a branch), then the
tile quantized and packed while it is still in L1. The ranges are exactly those of the row-by-row
walk it replaced (tests/test_codecs.py); the sums of squares run in another order than
torch's, so the torch path's ranges differ on ~1e-5 of trained rows, no row's error by more
than 0.1%. Measured on 131072 trained 64-dim rows (``benchmarks/codecs.py --quick``, thread
CPU time, a 2-core AMD EPYC at load ~2): the whole encode at 1.8-2.1 GB/s of fp32 rows per
core with entropy ``none`` (1.3-1.6 up to the zstd-compressed file), from 0.95-1.0 before; the
search alone 2.5-2.6 GB/s: ~12-13 ns per scored range, compute-bound in the sums (two ranges'
64 values: ~9 ns a step, measured alone). On other devices the walk runs vectorised over the
batch in torch, in cache-sized chunks; the only Python loop is over the walk's steps (scoring
one range costs about 6 passes over the rows there, ~0.25-0.5 ms per MB on this CPU).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from embckpt.codecs.base import register
from embckpt.codecs.common import UNIFORM_ENTROPY
from embckpt.codecs.packing import packed_width
from embckpt.codecs.uniform import AsymmetricCodec, half_params_fit, row_extremes, use_kernels
from embckpt.errors import ConfigError

#: (n_bins, ratio) per bit width when not given.
DEFAULT_SEARCH = {2: (10, 0.5), 3: (20, 0.25), 4: (50, 0.1), 8: (1000, 0.005)}
_CHUNK_ROWS = 8192


@register
class AdaptiveCodec(AsymmetricCodec):
    """Per-row uniform quantization over a searched clipping range.

    Args:
        bits: code width: 2, 3, 4 or 8.
        entropy: entropy stage over the fused rows (see ``common.py``; default none,
            ``UNIFORM_ENTROPY``).
        param_dtype: as for ``asymmetric``.
        n_bins: the search grid: the range moves in steps of ``(max - min) / n_bins``
            (default: per bit width, see ``DEFAULT_SEARCH``).
        ratio: at most this fraction of the range is clipped off, in total.
    """

    codec_id = "adaptive"

    def __init__(
        self,
        bits: int = 4,
        entropy: str = UNIFORM_ENTROPY,
        param_dtype: str = "auto",
        n_bins: int | None = None,
        ratio: float | None = None,
    ) -> None:
        super().__init__(bits=bits, entropy=entropy, param_dtype=param_dtype)
        default_bins, default_ratio = DEFAULT_SEARCH[self.bits]
        n_bins = default_bins if n_bins is None else n_bins
        ratio = default_ratio if ratio is None else ratio
        if isinstance(n_bins, bool) or not isinstance(n_bins, int) or n_bins < 2:
            raise ConfigError(f"codec 'adaptive': n_bins must be an int >= 2, got {n_bins!r}")
        if not isinstance(ratio, (int, float)) or not 0.0 <= ratio < 1.0:
            raise ConfigError(f"codec 'adaptive': ratio must be in [0, 1), got {ratio!r}")
        self.n_bins = n_bins
        self.ratio = float(ratio)

    def _options(self) -> dict[str, Any]:
        return {**super()._options(), "n_bins": self.n_bins, "ratio": self.ratio}

    def _steps(self) -> int:
        return math.floor(self.n_bins * self.ratio + 1e-9)

    def _plan_fused(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, bool, torch.Tensor | None]:
        """On CPU rows, one compiled pass: each tile of rows is searched, then quantized while
        it is still in L1, on the assumption (true of trained tables) that fp16 parameters
        hold the batch; where that turns out wrong, or a row is not finite, the fused rows
        are dropped and the search runs as :meth:`_ranges` would have (same ranges)."""
        if (
            not use_kernels(x)
            or self._steps() < 2
            or x.shape[0] == 0
            or self.param_dtype == "float32"
        ):
            return super()._plan_fused(x)
        from embckpt.codecs import adaptive_kernels

        n, cols = x.shape
        lo, hi, xmin, xmax = (np.empty(n, dtype=np.float32) for _ in range(4))
        fused = np.empty((n, packed_width(cols, self.bits) + 4), dtype=np.uint8)
        finite = adaptive_kernels.search_rows(
            x.numpy(), self.bits, self.n_bins, self._steps(), True, lo, hi, xmin, xmax, True, fused
        )
        if not finite or (
            self.param_dtype == "auto"
            and not half_params_fit(torch.from_numpy(xmin), torch.from_numpy(xmax), self.bits)
        ):
            return super()._plan_fused(x)
        lo_t, hi_t = torch.from_numpy(lo), torch.from_numpy(hi)
        half = self._half(half_params_fit(lo_t, hi_t, self.bits))
        return lo_t, hi_t, half, torch.from_numpy(fused) if half else None

    def _ranges(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xmin, xmax = row_extremes(x)
        steps = self._steps()
        if (
            steps < 2
            or x.shape[0] == 0
            or not bool(torch.isfinite(xmin).all() & torch.isfinite(xmax).all())
        ):
            # Under two steps the walk never meets a local optimum but the full range; NaN
            # and infinities are reported by encode(), from these ranges (a search over a row
            # holding +inf could settle on a finite range and clip it silently).
            return xmin, xmax
        half = self.param_dtype == "float16" or (
            self.param_dtype == "auto" and half_params_fit(xmin, xmax, self.bits)
        )
        if use_kernels(x):
            from embckpt.codecs import adaptive_kernels

            n = x.shape[0]
            lo_np, hi_np, xmin_np, xmax_np = (np.empty(n, dtype=np.float32) for _ in range(4))
            none = np.empty((0, 0), dtype=np.uint8)
            adaptive_kernels.search_rows(
                x.numpy(),
                self.bits,
                self.n_bins,
                steps,
                half,
                lo_np,
                hi_np,
                xmin_np,
                xmax_np,
                False,
                none,
            )
            return torch.from_numpy(lo_np), torch.from_numpy(hi_np)
        lo, hi = torch.empty_like(xmin), torch.empty_like(xmax)
        for start in range(0, x.shape[0], _CHUNK_ROWS):
            part = slice(start, start + _CHUNK_ROWS)
            lo[part], hi[part] = greedy_ranges(
                x[part], xmin[part], xmax[part], self.bits, self.n_bins, steps, half
            )
        return lo, hi


def range_loss(
    x: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    levels: int,
    half: bool,
    work: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Per-row squared l2 error of quantizing ``x`` over [lo, hi] on ``levels + 1`` levels,
    with fp16-rounded scale and bias when ``half`` (as FBGEMM stores them).

    ``work`` is a pair of scratch tensors shaped like ``x``, so a search allocates nothing.
    """
    if half:
        lo = lo.half().float()
    span = (hi - lo).clamp_(min=0)
    scale = torch.where(span > 0, span / levels, 1.0)
    if half:
        scale = scale.half().float()
        scale = torch.where(scale > 0, scale, 1.0)
    inverse = 1.0 / scale
    t, r = work if work is not None else (torch.empty_like(x), torch.empty_like(x))
    # (x - lo) / scale as x * inverse - lo * inverse: two passes over x, no temporaries.
    torch.mul(x, inverse[:, None], out=t)
    t.sub_((lo * inverse)[:, None])
    torch.round(t, out=r).clamp_(0, levels)
    t.sub_(r)
    # vector_norm measured faster than vecdot(t, t) or (t * t).sum(1) here.
    return torch.linalg.vector_norm(t, dim=1).square_().mul_(scale.square())


def greedy_ranges(
    x: torch.Tensor,
    xmin: torch.Tensor,
    xmax: torch.Tensor,
    bits: int,
    n_bins: int,
    steps: int,
    half: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``param_search_greedy`` for every row of ``x`` at once, scored by the exact error."""
    levels = (1 << bits) - 1
    work = (torch.empty_like(x), torch.empty_like(x))
    step = (xmax - xmin) / n_bins
    lo, hi = xmin.clone(), xmax.clone()
    loss = range_loss(x, lo, hi, levels, half, work)
    best = torch.full_like(loss, float("inf"))
    best_lo, best_hi = xmin.clone(), xmax.clone()
    for _ in range(steps):
        up = lo + step
        down = hi - step
        loss_up = range_loss(x, up, hi, levels, half, work)
        loss_down = range_loss(x, lo, down, levels, half, work)
        # A local optimum: both neighbours are worse. Keep the best one met so far.
        keep = (loss < loss_up) & (loss < loss_down) & (loss < best)
        best = torch.where(keep, loss, best)
        best_lo = torch.where(keep, lo, best_lo)
        best_hi = torch.where(keep, hi, best_hi)
        move_up = loss_up < loss_down
        lo = torch.where(move_up, up, lo)
        hi = torch.where(move_up, hi, down)
        loss = torch.where(move_up, loss_up, loss_down)
    return best_lo, best_hi
