"""Rows that decide a quantizer's bytes, shared by the tests of its implementations (the
compiled CPU kernels, the GPU encoder): every one must write the same bytes for them."""

from __future__ import annotations

import torch


def embedding_rows(n: int, cols: int, seed: int, tiny: bool = True) -> torch.Tensor:
    """Embedding-like rows with the cases that decide bytes: rows scaled x100 (and, with
    ``tiny``, x0.001, which most widths store with fp32 parameters), zero and constant
    rows, -0.0 beside 0.0 (first in either order, at a row's min or max), values on coarse
    grids (ties between candidate ranges), an fp32 subnormal."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cols, generator=g) * 0.05
    x[3::10] *= 100
    if tiny:
        x[7::50] *= 0.001
    x[::7, ::3] = 0.0
    x[::11, ::2] = -0.0
    x[::13] = 0.0
    x[::17] = -0.0
    x[::19] = 0.37
    x[1::19] = -0.125
    x[::29] = x[::29].abs()
    x[::29, ::4] = -0.0
    x[::29, 2::4] = 0.0
    x[1::29] = -x[1::29].abs()
    x[1::29, 1::4] = -0.0
    x[1::29, ::4] = 0.0
    x[2::31] = torch.randint(-3, 4, (len(x[2::31]), cols), generator=g).float() / 16
    x[3::31] = torch.round(x[3::31] * 64) / 64
    x[2::37, 0] = 0.25
    x[2::37, -1] = 1e-40
    return x
