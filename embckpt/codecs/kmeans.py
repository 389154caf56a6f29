"""``kmeans``: non-uniform quantization on ``2**bits`` centroids shared by the whole batch.

Format (version 1). Each row ``x`` is ``scale * c[q] + bias``: codes ``q`` (``bits`` bits,
packed like FBGEMM's) then ``scale`` and ``bias`` (fp16, or fp32 when a row needs it, as for
``asymmetric``) in one ``payload`` entry, through the selected entropy stage; the codebook ``c``
(``2**bits`` fp32 values, ascending) is in the file's metadata.

Why one codebook per batch (a file holds one table shard) and not per row: a per-row codebook
costs ``2**bits`` stored values per row (32 extra bytes at 4 bits, doubling a 64-dim row's size)
for error no lower than this scheme's at 4 bits, whereas a shared codebook costs the same bytes
per row as ``asymmetric``. On 16k trained rows, per-row Lloyd k-means with fp16 centroids
reached 0.98 of asymmetric's l2 error at 4 bits against 0.89 for this scheme.

When it is worth it: on trained DLRM tables (benchmarks/results/codecs.json) this codec has the
lowest error of all at every bit width (4 bits: 0.89 of asymmetric's l2 error, adaptive 0.92;
2 bits: 0.72 and 0.75), at the same bytes per row. It encodes ~10x slower than asymmetric
(every row alternates three times between its codes and its scale and bias): on CPU tensors in
compiled per-row kernels (kmeans_kernels.py), ~0.15-0.25 GB/s of fp32 rows per core, from
0.01-0.03 with the vectorised torch path, which other devices still take; it decodes at ~0.4-0.9
GB/s.
Use it where a checkpoint is written rarely and restored often, or where bits are scarce; for
frequent checkpoints, adaptive gets most of the gain 2-3x faster.

Fitting: rows are first normalised to [0, 1] by their own min and max; scikit-learn's k-means
(1-D, initialised by companded quantiles) fits the codebook on a sample of the normalised
values. Then ``iterations`` rounds of alternating least squares on a sample of
rows refine the codebook: assign every value to its nearest centroid, refit each row's
``scale`` and ``bias`` by least squares, refit the centroids to all residuals. Finally, with the
codebook fixed, every row of the batch alternates ``iterations`` times between its codes and its
least-squares ``scale`` and ``bias``. The per-row work runs compiled, one row at a time, on
CPU tensors, and vectorised over rows in torch elsewhere. The last codebook seeds
the next batch, so the scikit-learn fit runs once per codec instance (once per training run).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import numpy as np
import torch

from embckpt.codecs.base import EncodedRows, register
from embckpt.codecs.common import (
    DEFAULT_ENTROPY,
    PAYLOAD,
    StagedCodec,
    check_bits,
    float_rows,
    param_tables,
)
from embckpt.codecs.packing import lookup_codes, pack_codes, packed_width
from embckpt.codecs.uniform import QUANT_BITS, half_params_fit, use_kernels
from embckpt.errors import CodecError, ConfigError, import_extra

_SAMPLE = 1 << 16
_SAMPLE_ROWS = 1 << 14


@register
class KMeansCodec(StagedCodec):
    """Shared-codebook non-uniform quantization with per-row scale and bias.

    Args:
        bits: code width: 2, 3, 4 or 8 (``2**bits`` centroids).
        entropy: entropy stage over the fused rows (see ``common.py``).
        iterations: alternating least-squares rounds after the initial fit (0: plain k-means
            on min/max-normalised rows).
        seed: seed of the value sample the codebook is first fitted on.
    """

    codec_id = "kmeans"
    format_version = 1

    def __init__(
        self, bits: int = 4, entropy: str = DEFAULT_ENTROPY, iterations: int = 3, seed: int = 0
    ) -> None:
        super().__init__(entropy)
        self.bits = check_bits(self.codec_id, bits, QUANT_BITS)
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
            raise ConfigError(f"codec 'kmeans': iterations must be an int >= 0, got {iterations!r}")
        self.iterations = iterations
        self.seed = int(seed)
        self._codebook: torch.Tensor | None = None
        self._lock = threading.Lock()

    def _options(self) -> dict[str, Any]:
        return {
            "bits": self.bits,
            "entropy": self.entropy,
            "iterations": self.iterations,
            "seed": self.seed,
        }

    def encode(self, rows: torch.Tensor) -> EncodedRows:
        x = float_rows(rows, self.codec_id)
        k = 1 << self.bits
        lo, hi = (x.amin(dim=1), x.amax(dim=1)) if x.shape[1] else (x.sum(1), x.sum(1))
        span = hi - lo
        with self._lock:
            cached = self._codebook
        codebook = cached if cached is not None else self._fit(x, lo, span, k)
        codebook = self._refine(x, codebook.to(x.device))
        with self._lock:
            self._codebook = codebook.cpu()
        # With the codebook fixed, each row's scale and bias alternate with its codes.
        scale, bias = span.clone(), lo.clone()
        scale, bias = _alternate(x, codebook, self.iterations, scale, bias)[1:]
        half = half_params_fit(lo, hi, self.bits) if x.shape[0] else True
        dtype = torch.float16 if half else torch.float32
        scale, bias = scale.to(dtype), bias.to(dtype)
        # Assign once more with the parameters as stored, so the codes fit what decodes.
        codes = _alternate(x, codebook, 0, scale.float(), bias.float())[0]
        params = torch.stack([scale, bias], dim=1).view(torch.uint8)
        fused = _fuse(codes, params, self.bits)
        tables = param_tables(fused.shape[1] - params.shape[1], params.shape[1])
        column, meta, hint = self._payload_column(fused.cpu().numpy(), tables)
        meta["param_dtype"] = "float16" if half else "float32"
        meta["codebook"] = [float(v) for v in codebook.cpu().tolist()]
        return EncodedRows(columns={PAYLOAD: column}, metadata=meta, compression=hint)

    def decode(self, encoded: EncodedRows, num_cols: int) -> torch.Tensor:
        meta = encoded.metadata
        dtype = {"float16": np.float16, "float32": np.float32}.get(str(meta.get("param_dtype")))
        codebook = meta.get("codebook")
        if dtype is None or not isinstance(codebook, list) or len(codebook) != 1 << self.bits:
            raise CodecError("kmeans metadata lacks a valid param_dtype or codebook")
        width = packed_width(num_cols, self.bits)
        itemsize = np.dtype(dtype).itemsize
        fused = self._payload_bytes(encoded, width + 2 * itemsize)
        params = np.ascontiguousarray(fused[:, width:]).view(dtype)
        compute = np.float64 if dtype == np.float32 else np.float32
        values = lookup_codes(
            fused[:, :width], np.asarray(codebook, dtype=compute), self.bits, num_cols
        )
        values *= params[:, :1].astype(compute)
        values += params[:, 1:].astype(compute)
        return torch.from_numpy(values.astype(np.float32, copy=False))

    def _refine(self, x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
        """The codebook after ``iterations`` rounds of alternating least squares on a sample
        of rows: one codebook serves the batch, and a sample of ``_SAMPLE_ROWS`` rows fixes it
        as well as every row would (measured), at a fraction of the cost on large batches."""
        rows = x[:: max(1, x.shape[0] // _SAMPLE_ROWS)]
        scale, bias = rows.amax(dim=1) - rows.amin(dim=1), rows.amin(dim=1)
        for _ in range(self.iterations):
            codes, scale, bias = _alternate(rows, codebook, 1, scale, bias)
            codebook = _refit_codebook(rows, codes, scale, bias, codebook)
        return codebook

    def _fit(self, x: torch.Tensor, lo: torch.Tensor, span: torch.Tensor, k: int) -> torch.Tensor:
        """A codebook on [0, 1] fitted by scikit-learn to a sample of min/max-normalised values."""
        KMeans = import_extra("sklearn.cluster", "kmeans").KMeans

        safe = torch.where(span > 0, span, 1.0)
        unit = ((x - lo[:, None]) / safe[:, None]).reshape(-1)
        generator = torch.Generator().manual_seed(self.seed)
        if unit.numel() > _SAMPLE:
            pick = torch.randint(0, unit.numel(), (_SAMPLE,), generator=generator)
            unit = unit[pick.to(unit.device)]
        sample = unit.double().cpu().numpy()
        distinct = np.unique(sample)
        if len(distinct) <= k:
            # Too few distinct values to cluster: keep them all, pad with an even grid.
            grid = np.linspace(0.0, 1.0, k)
            fill = grid[~np.isin(grid, distinct)][: k - len(distinct)]
            return torch.tensor(np.sort(np.concatenate([distinct, fill])), dtype=torch.float32)
        init = _companded_quantiles(sample, k)
        if len(np.unique(init)) < k:
            init = np.sort(np.random.default_rng(self.seed).choice(distinct, k, replace=False))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # convergence chatter on degenerate samples
            fitted = KMeans(n_clusters=k, init=init.reshape(-1, 1), n_init=1, max_iter=100).fit(
                sample.reshape(-1, 1)
            )
        return torch.tensor(np.sort(fitted.cluster_centers_.ravel()), dtype=torch.float32)


def _companded_quantiles(sample: np.ndarray, k: int) -> np.ndarray:
    """``k`` starting centroids spaced by the cube root of the sample's density: the spacing of
    an optimal many-level quantizer (Panter-Dite), which Lloyd's iterations then only refine.
    Plain quantiles would crowd the centroids into the dense middle and starve the tails."""
    counts, edges = np.histogram(sample, bins=1024, range=(0.0, 1.0))
    weight = np.cbrt(counts.astype(np.float64))
    cdf = np.concatenate(([0.0], np.cumsum(weight) / weight.sum()))
    return np.interp((np.arange(k) + 0.5) / k, cdf, edges)


def _alternate(
    x: torch.Tensor, codebook: torch.Tensor, rounds: int, scale: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rounds`` rounds of: every value's nearest centroid under its row's ``scale`` and
    ``bias``, then each row's least-squares ``scale`` and ``bias`` for those codes (0 rounds:
    the codes alone). Returns the last codes (uint8) and the parameters.

    CPU rows run in a compiled per-row kernel (kmeans_kernels.py), which keeps each row in L1
    across its rounds: ~10 vectorised torch passes per round over the whole batch measured
    30-100x slower. scikit-learn has no such per-row fit (its k-means fits the shared
    codebook, above).
    """
    if use_kernels(x) and x.shape[0]:
        from embckpt.codecs import kmeans_kernels

        codes_np = np.empty(x.shape, dtype=np.uint8)
        scale_np = np.array(scale.numpy(), dtype=np.float32)
        bias_np = np.array(bias.numpy(), dtype=np.float32)
        kmeans_kernels.kmeans_rows(x.numpy(), codebook.numpy(), rounds, scale_np, bias_np, codes_np)
        return torch.from_numpy(codes_np), torch.from_numpy(scale_np), torch.from_numpy(bias_np)
    codes = _assign(x, scale, bias, codebook)
    for done in range(rounds):
        if done:
            codes = _assign(x, scale, bias, codebook)
        scale, bias = _refit_rows(x, codebook[codes], scale, bias)
    return codes.to(torch.uint8), scale, bias


def _assign(
    x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, codebook: torch.Tensor
) -> torch.Tensor:
    """Index (int64) of the nearest centroid of every value.

    A row of scale 0 is constant and equal to its bias: it decodes right whatever its codes.
    """
    safe = torch.where(scale > 0, scale, 1.0)
    unit = (x - bias[:, None]).div_(safe[:, None])
    return _nearest(unit, codebook)


def _nearest(unit: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index (int64) of the nearest of the sorted ``codebook`` values for every element."""
    mids = (codebook[1:] + codebook[:-1]) / 2
    if len(mids) > 15:
        return torch.bucketize(unit, mids)
    # Up to 4 bits, counting the boundaries below each value (one compare-and-add pass per
    # boundary) measured 2-8x faster than torch.bucketize's per-value binary search.
    count = torch.zeros(unit.shape, dtype=torch.uint8, device=unit.device)
    for boundary in mids.tolist():
        count += unit >= boundary
    return count.long()


def _refit_rows(
    x: torch.Tensor, centroids: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's least-squares ``scale``, ``bias`` for ``x ~ scale * centroids + bias``."""
    c_mean = centroids.mean(dim=1, keepdim=True)
    x_mean = x.mean(dim=1, keepdim=True)
    dc = centroids - c_mean
    var = torch.linalg.vecdot(dc, dc)
    cov = torch.linalg.vecdot(dc, x - x_mean)
    # A row on a single centroid has no slope to fit: keep its scale and recentre its bias.
    fitted = torch.where(var > 0, cov / torch.where(var > 0, var, 1.0), scale).clamp_(min=0)
    return fitted, (x_mean - fitted[:, None] * c_mean).squeeze(1)


def _fuse(codes: torch.Tensor, params: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed codes [n, cols] (uint8) then the parameter bytes, one fused row each."""
    if not use_kernels(codes):
        return torch.cat([pack_codes(codes, bits), params], dim=1)
    from embckpt.codecs import kmeans_kernels

    width = packed_width(codes.shape[1], bits)
    fused = np.empty((codes.shape[0], width + params.shape[1]), dtype=np.uint8)
    kmeans_kernels.pack_rows(codes.numpy(), bits, fused)
    fused[:, width:] = params.numpy()
    return torch.from_numpy(fused)


def _refit_codebook(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, old: torch.Tensor
) -> torch.Tensor:
    """Centroids minimising the total squared error given every row's codes (uint8) and
    parameters."""
    k = len(old)
    # scale**2 * (c - (x - bias)/scale)**2 = (scale*c - (x - bias))**2: weighted least squares.
    if use_kernels(x):
        from embckpt.codecs import kmeans_kernels

        num_np, den_np = np.zeros(k), np.zeros(k)
        kmeans_kernels.codebook_sums(
            x.numpy(), codes.numpy(), scale.numpy(), bias.numpy(), num_np, den_np
        )
        num, den = torch.from_numpy(num_np), torch.from_numpy(den_np)
    else:
        flat = codes.reshape(-1).long()
        weight = scale.double().square()[:, None].expand_as(x).reshape(-1)
        target = ((x - bias[:, None]).double() * scale.double()[:, None]).reshape(-1)
        num = torch.bincount(flat, weights=target, minlength=k)
        den = torch.bincount(flat, weights=weight, minlength=k)
    fresh = torch.where(den > 0, num / torch.where(den > 0, den, 1.0), old.double())
    return fresh.float().sort().values
