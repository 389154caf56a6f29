"""``asymmetric`` and ``symmetric``: per-row uniform quantization to 2, 3, 4 or 8 bits.

Format (both codecs, format version 1). Each row ``x`` is one ``payload`` entry in FBGEMM's
fused n-bit row layout: the codes ``q`` (``bits`` bits each, packed as in ``packing.py``), then
``scale``, then ``bias``; the row decodes to ``scale * q + bias``.

- ``asymmetric``: the codes span the row's own range [min, max] and ``bias`` is its min: exactly
  FBGEMM's fused row, which FBGEMM decodes in place.
- ``symmetric``: the codes span [-max|x|, max|x|] on a grid that holds 0 exactly; only
  ``scale`` is stored, ``bias = -2**(bits-1) * scale``.

Parameters are fp16 when every row of the batch fits fp16 without loss of accuracy (always, for
trained embeddings), else fp32 for the whole batch (the file's ``param_dtype``): rows beyond
fp16's range, rows so narrow that their step is subnormal in fp16, and rows whose offset fp16
cannot place within half a step. Per element the error is at most half a step (``scale / 2``)
plus the rounding of ``scale`` and ``bias`` to that dtype.

Paths: CPU rows with fp16 parameters (every trained table) go through compiled kernels
(uniform_kernels.py): quantize, pack and write the fused row in one pass per row, and decode the
same way; measured on trained 64-dim rows, one core, they encode at 3-6 GB/s and decode at 4-9 GB/s
of fp32 rows, where FBGEMM's row-wise op managed 2 GB/s (2 and 4 bits only) and the torch path
0.5-0.9. Other devices and fp32 parameters take the vectorised torch path, which reproduces FBGEMM's
bytes exactly, as the kernels reproduce the torch path's (tested), so all write one format. FBGEMM's
op is kept for CPU rows when the kernels are switched off (``COMPILED``), where it quantizes over
the ranges it is given (checked once: fbgemm-gpu-cpu 1.9.0's does not). Rows on a GPU can be fused
there instead (device_encode.py), to the same bytes, and encoded from those (``encode_fused``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch

from embckpt.codecs.base import EncodedRows, register
from embckpt.codecs.common import (
    PAYLOAD,
    UNIFORM_ENTROPY,
    StagedCodec,
    check_bits,
    float_rows,
    param_tables,
    require_finite,
)
from embckpt.codecs.packing import pack_codes, packed_width, unpack_codes
from embckpt.errors import CodecError, ConfigError

QUANT_BITS = (2, 3, 4, 8)
PARAM_DTYPES = ("auto", "float16", "float32")
_FP16_SAFE_MAX = 65000.0
_FP16_MIN_NORMAL = 2.0**-14
_FP16_REL = 2.0**-11

#: Whether CPU rows go through the compiled kernels (uniform_kernels.py, adaptive_kernels.py,
#: kmeans_kernels.py); tests switch it off to check the torch path, which tensors on other
#: devices always take.
COMPILED = True


def use_kernels(x: torch.Tensor) -> bool:
    """Whether the compiled kernels serve ``x``: CPU tensors, while ``COMPILED`` is on.

    The kernel modules are imported where used, on first use: numba costs about half a
    second to import, and only CPU encoding and decoding need it.
    """
    return COMPILED and x.device.type == "cpu"


@functools.cache
def _fbgemm_ops() -> Any:
    """``torch.ops.fbgemm`` with FBGEMM's ops registered where it is installed (without it, the
    torch path). Imported on first use, not with the codecs: a writer process, whose codecs
    encode with the kernels, never needs it, and importing it (with what it pulls in) was a
    third of that process's imports (2.8-3.2 s, now 2.1 s, on the 2-core machine of
    ``benchmarks/results/``)."""
    with contextlib.suppress(ImportError):
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
    return torch.ops.fbgemm


def _has_fbgemm() -> bool:
    return hasattr(_fbgemm_ops(), "FusedNBitRowwiseQuantizedSBHalfToFloat")


@functools.cache
def _fbgemm_minmax_op_honours_ranges() -> bool:
    """Whether FBGEMM's CPU n-bit op with row-wise min/max quantizes over the ranges it is given.

    fbgemm-gpu-cpu 1.9.0's does not: it takes each row's own min and max instead (1.8.0's
    honours them), which would write other bytes than the kernels and the torch path.
    """
    op = getattr(
        _fbgemm_ops(), "FloatOrHalfToFusedNBitRowwiseQuantizedSBHalfWithRowwiseMinMax", None
    )
    if op is None:
        return False
    x = torch.arange(8, dtype=torch.float32).reshape(1, 8)
    fused = op(x, 4, torch.tensor([[-8.0, 22.0]]))
    params = fused[:, packed_width(8, 4) :].contiguous().view(torch.float16).float()
    return params.tolist() == [[2.0, -8.0]]  # scale (22 - -8) / 15, bias -8


def fbgemm_fits(x: torch.Tensor, bits: int) -> bool:
    """Whether FBGEMM's n-bit row ops can quantize ``x`` [n, cols] at ``bits``."""
    # FBGEMM's 8-bit n-bit op measured half as fast as the torch path (same bytes out).
    return (
        bits in (2, 4)
        and x.device.type == "cpu"
        and x.shape[0] > 0
        and (x.shape[1] * bits) % 16 == 0
        and _fbgemm_minmax_op_honours_ranges()
    )


def half_params_fit(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> bool:
    """Whether fp16 ``scale`` and ``bias`` represent every row's range [lo, hi] faithfully."""
    levels = (1 << bits) - 1
    lo, hi = lo.float(), hi.float()
    lo16 = lo.half().float()
    width = hi - lo
    scale = width / levels
    constant = width == 0
    ok = torch.maximum(lo.abs(), hi.abs()) < _FP16_SAFE_MAX
    ok &= constant | (scale >= _FP16_MIN_NORMAL)
    allowed = torch.where(constant, lo.abs() * _FP16_REL, 0.5 * scale)
    ok &= (lo - lo16).abs() <= allowed
    return bool(ok.all())


def row_extremes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's min and max; one that is zero is the row's first zero (0.0 or -0.0).

    ``amin`` and ``amax`` return either zero of a row holding both, depending on how the
    reduction is vectorised, and the sign reaches the stored bias; the first zero in column
    order is what adaptive_kernels.py's search and the GPU encoder (device_kernels.py) reproduce.
    """
    lo, hi = x.amin(dim=1), x.amax(dim=1)
    zero = (lo == 0) | (hi == 0)
    if bool(zero.any()):
        rows = zero.nonzero()[:, 0]
        part = x[rows]
        first = part.gather(1, (part == 0).to(torch.uint8).argmax(dim=1, keepdim=True))[:, 0]
        lo[rows] = torch.where(lo[rows] == 0, first, lo[rows])
        hi[rows] = torch.where(hi[rows] == 0, first, hi[rows])
    return lo, hi


def quantize_affine(
    x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int, half: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes each row of ``x`` onto ``2**bits`` levels spanning its [lo, hi].

    Values outside [lo, hi] clamp to the end levels. With ``half``, this follows FBGEMM exactly:
    ``bias = fp16(lo)``, ``scale = fp16((hi - bias) / (2**bits - 1))`` (1 where that is 0), codes
    ``rint((x - bias) / scale)``.

    Returns:
        Packed codes [n, ceil(cols * bits / 8)] and params [n, 4 or 8] (``scale`` then
        ``bias``, fp16 or fp32 bytes), both uint8 on ``x``'s device.
    """
    levels = (1 << bits) - 1
    if half and use_kernels(x):
        fused = quantize_half(x, lo, hi, bits, with_bias=True)
        width = packed_width(x.shape[1], bits)
        return fused[:, :width], fused[:, width:]
    if half and fbgemm_fits(x, bits):
        minmax = torch.stack([lo.float(), hi.float()], dim=1)
        op = _fbgemm_ops().FloatOrHalfToFusedNBitRowwiseQuantizedSBHalfWithRowwiseMinMax
        fused = op(x, bits, minmax)
        width = packed_width(x.shape[1], bits)
        return fused[:, :width], fused[:, width:]
    if half:
        bias = lo.float().half().float()
        span = hi.float() - bias
        scale = torch.where(span == 0, 1.0, span / levels).half().float()
        inverse = 1.0 / scale
        bad = (scale == 0) | torch.isinf(inverse)
        scale = torch.where(bad, 1.0, scale)
        inverse = torch.where(bad, 1.0, inverse)
        codes = (x - bias[:, None]).mul_(inverse[:, None]).round_().clamp_(0, levels)
        params = torch.stack([scale.half(), bias.half()], dim=1).view(torch.uint8)
    else:
        # fp32 parameters serve the rows fp16 cannot; float64 arithmetic keeps huge values
        # (|x| near fp32's maximum) from overflowing on the way.
        bias64 = lo.double()
        span = hi.double() - bias64
        scale = torch.where(span == 0, 1.0, span / levels).float()
        scale = torch.where(scale == 0, 1.0, scale)
        codes = (x.double() - bias64[:, None]).div_(scale.double()[:, None])
        codes = codes.round_().clamp_(0, levels)
        params = torch.stack([scale, bias64.float()], dim=1).view(torch.uint8)
    return pack_codes(codes.to(torch.uint8), bits), params


def quantize_half(
    x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int, with_bias: bool
) -> torch.Tensor:
    """Fused rows [n, w + 4] (or [n, w + 2] without ``with_bias``: symmetric's scale alone) of
    CPU rows ``x`` quantized over [lo, hi] with fp16 parameters, by the compiled kernel."""
    from embckpt.codecs import uniform_kernels

    n, cols = x.shape
    fused = np.empty((n, packed_width(cols, bits) + (4 if with_bias else 2)), dtype=np.uint8)
    uniform_kernels.quantize_half(
        x.numpy(),
        np.ascontiguousarray(lo.numpy(), dtype=np.float32),
        np.ascontiguousarray(hi.numpy(), dtype=np.float32),
        bits,
        with_bias,
        fused,
    )
    return torch.from_numpy(fused)


def dequantize_fused(
    fused: np.ndarray,
    bits: int,
    cols: int,
    dtype: type,
    implied_bias: bool = False,
    out: np.ndarray | None = None,
) -> torch.Tensor:
    """Decodes fused rows [n, w + p] (codes, ``scale``, then ``bias``, both of ``dtype``); with
    ``implied_bias``, the rows hold their scale alone and the bias is the symmetric grid's
    ``-2**(bits-1) * scale`` (exact in the parameters' own dtype). ``out`` (float32 [n, cols],
    C-contiguous; only while ``COMPILED``) receives the rows: a restore decodes into the
    model's own rows instead of copying them there.

    The compiled kernel decodes when on, reading each row's parameters from its bytes;
    otherwise fp16 parameters on FBGEMM-sized rows decode through FBGEMM, the rest through
    torch. Both in float64 for fp32 parameters, so that huge rows do not overflow before the
    final rounding.
    """
    n = fused.shape[0]
    width = packed_width(cols, bits)
    itemsize = np.dtype(dtype).itemsize
    if fused.shape[1] != width + itemsize * (1 if implied_bias else 2):
        raise CodecError(f"fused rows of {fused.shape[1]} bytes for {cols} {bits}-bit codes")
    if COMPILED:
        from embckpt.codecs import uniform_kernels

        if out is None:
            out = np.empty((n, cols), dtype=np.float32)
        elif out.shape != (n, cols):  # the kernel does not check its bounds
            raise CodecError(f"{n} rows of {cols} decode into an array of {out.shape}")
        packed = np.ascontiguousarray(fused).view()
        packed.flags.writeable = False  # one compiled signature for Arrow's read-only buffers
        uniform_kernels.dequantize(packed, bits, cols, dtype == np.float16, not implied_bias, out)
        return torch.from_numpy(out)
    params = np.ascontiguousarray(fused[:, width:]).view(dtype).astype(np.float64)
    if implied_bias:
        bias = -np.float64(1 << (bits - 1)) * params[:, 0]
        bias16 = bias.astype(dtype).reshape(n, 1).view(np.uint8)
        fused = np.concatenate([fused, bias16], axis=1)
        params = np.concatenate([params, bias.reshape(n, 1)], axis=1)
    if (
        dtype == np.float16
        and n
        and bits in (2, 4, 8)
        and (cols * bits) % 16 == 0
        and _has_fbgemm()
    ):
        op = _fbgemm_ops().FusedNBitRowwiseQuantizedSBHalfToFloat
        return op(torch.from_numpy(np.array(fused, copy=True)), bits)
    compute = torch.float64 if dtype == np.float32 else torch.float32
    codes = unpack_codes(torch.from_numpy(np.array(fused[:, :width], copy=True)), bits, cols)
    scales = torch.from_numpy(params[:, 0]).to(compute)
    biases = torch.from_numpy(params[:, 1]).to(compute)
    return codes.to(compute).mul_(scales[:, None]).add_(biases[:, None]).float()


class UniformCodec(StagedCodec):
    """Per-row uniform quantization; subclasses choose each row's range.

    Args:
        bits: code width: 2, 3, 4 or 8.
        entropy: entropy stage over the packed codes (see ``common.py``; default none,
            ``UNIFORM_ENTROPY``).
        param_dtype: ``auto`` (fp16 unless a row needs fp32), ``float16`` (refuse rows fp16
            cannot hold) or ``float32``.
    """

    format_version: ClassVar[int] = 1
    bias_stored: ClassVar[bool] = True
    rows_independent = True

    def __init__(
        self, bits: int = 4, entropy: str = UNIFORM_ENTROPY, param_dtype: str = "auto"
    ) -> None:
        super().__init__(entropy)
        self.bits = check_bits(self.codec_id, bits, QUANT_BITS)
        if param_dtype not in PARAM_DTYPES:
            raise ConfigError(
                f"codec {self.codec_id!r}: param_dtype must be one of {PARAM_DTYPES}, "
                f"got {param_dtype!r}"
            )
        self.param_dtype = param_dtype

    def _options(self) -> dict[str, Any]:
        return {"bits": self.bits, "entropy": self.entropy, "param_dtype": self.param_dtype}

    def _ranges(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's quantization range [lo, hi] (per-row vectors)."""
        raise NotImplementedError

    def _plan_fused(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, bool, torch.Tensor | None]:
        """:meth:`_plan`, plus the fused rows when planning already wrote them (else None)."""
        return (*self._plan(x), None)

    def _plan(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Each row's range and whether fp16 parameters hold the whole batch."""
        lo, hi = self._ranges(x)
        fits = half_params_fit(lo, hi, self.bits) if lo.numel() else True
        return lo, hi, self._half(fits)

    def _half(self, fits: bool) -> bool:
        if self.param_dtype == "float16" and not fits:
            raise CodecError(
                f"codec {self.codec_id!r}: rows exceed what fp16 parameters can hold; "
                "use param_dtype 'auto' or 'float32'"
            )
        return self.param_dtype == "float16" or (self.param_dtype == "auto" and fits)

    def _param_bytes(self, half: bool) -> int:
        return (2 if half else 4) * (2 if self.bias_stored else 1)

    def encode(self, rows: torch.Tensor) -> EncodedRows:
        x = float_rows(rows, self.codec_id, check=False)
        lo, hi, half, fused = self._plan_fused(x)
        # NaN and infinities propagate into every row's range: checking the ranges is enough.
        if lo.numel() and not bool(torch.isfinite(lo).all() & torch.isfinite(hi).all()):
            require_finite(x, self.codec_id)
        if fused is None:
            fused = self._fuse(x, lo, hi, half)
        return self.encode_fused(fused, half)

    def encode_fused(self, fused: torch.Tensor, half: bool) -> EncodedRows:
        """The encoded batch of rows already fused [n, w + p] (codes, then parameters, fp16
        with ``half``), on any device: what :meth:`encode` returns once it has fused them,
        so rows fused elsewhere (device_encode.py, on their GPU) encode to the same bytes."""
        width = fused.shape[1] - self._param_bytes(half)
        tables = param_tables(width, fused.shape[1] - width)
        column, meta, hint = self._payload_column(fused.cpu().numpy(), tables)
        meta["param_dtype"] = "float16" if half else "float32"
        return EncodedRows(columns={PAYLOAD: column}, metadata=meta, compression=hint)

    def _fuse(
        self, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, half: bool
    ) -> torch.Tensor:
        """The fused rows [n, w + p]: ``x`` quantized over [lo, hi], then its parameters."""
        if half and use_kernels(x):
            # One pass per row: codes, scale and bias straight into the fused row.
            return quantize_half(x, lo, hi, self.bits, with_bias=self.bias_stored)
        if self.bias_stored:
            codes, params = quantize_affine(x, lo, hi, self.bits, half)
            return _join(codes, params)
        codes, _ = quantize_affine(x, lo, hi, self.bits, half)
        # The scale itself, not the quantizer's: for an all-zero row FBGEMM stores 1.0,
        # which with an implied bias would decode to -2**(bits-1).
        scale = (hi - lo) / ((1 << self.bits) - 1)
        scale = scale.to(torch.float16 if half else torch.float32)[:, None]
        return torch.cat([codes, scale.view(torch.uint8)], dim=1)

    def decode(self, encoded: EncodedRows, num_cols: int) -> torch.Tensor:
        return self._decode(encoded, num_cols, None)

    def decode_into(self, encoded: EncodedRows, num_cols: int, out: np.ndarray) -> bool:
        """Decodes straight into ``out`` (float32 [n, num_cols], C-contiguous: rows of a block
        a restore would copy the decoded rows into); False, with ``out`` untouched, where only
        :meth:`decode` can (the compiled kernels off)."""
        if (
            not COMPILED
            or type(self).decode is not UniformCodec.decode  # a subclass decoding otherwise
            or out.dtype != np.float32
            or not out.flags.c_contiguous
        ):
            return False
        self._decode(encoded, num_cols, out)
        return True

    def fused_layout(self, metadata: Mapping[str, Any], num_cols: int) -> tuple[bool, int] | None:
        """Whether a batch with ``metadata`` has fp16 parameters, and the bytes of its fused
        rows, where the compiled kernels decode its rows one by one
        (as ``delta_kernels.add_coded`` does, through ``uniform_kernels``' row loops); None where
        only :meth:`decode` can (the kernels off, or a subclass decoding otherwise).

        Raises:
            CodecError: an unknown ``param_dtype``.
        """
        if not COMPILED or type(self).decode is not UniformCodec.decode:
            return None
        half = _param_dtype(metadata) == np.float16
        return half, packed_width(num_cols, self.bits) + self._param_bytes(half)

    def _decode(self, encoded: EncodedRows, num_cols: int, out: np.ndarray | None) -> torch.Tensor:
        dtype = _param_dtype(encoded.metadata)
        width = packed_width(num_cols, self.bits)
        fused = self._payload_bytes(encoded, width + self._param_bytes(dtype == np.float16))
        # The symmetric grid's offset is a power-of-two multiple of its scale: exact in the
        # parameters' own dtype, so the fused decode (FBGEMM's) applies unchanged.
        return dequantize_fused(
            fused, self.bits, num_cols, dtype, implied_bias=not self.bias_stored, out=out
        )


def _param_dtype(metadata: Mapping[str, Any]) -> type:
    """The parameters' dtype a batch's metadata names (fp16 where it names none)."""
    dtype = {"float16": np.float16, "float32": np.float32}.get(
        str(metadata.get("param_dtype", "float16"))
    )
    if dtype is None:
        raise CodecError(f"unknown param_dtype {metadata.get('param_dtype')!r}")
    return dtype


def _join(codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Codes and params as one fused row, without a copy when they already are one."""
    if (
        codes.shape[0]
        and codes.stride(0) == params.stride(0) == codes.shape[1] + params.shape[1]
        and codes.stride(1) == 1
        and params.data_ptr() == codes.data_ptr() + codes.shape[1]
    ):
        return codes.as_strided((codes.shape[0], codes.stride(0)), (codes.stride(0), 1))
    return torch.cat([codes, params], dim=1)


@register
class AsymmetricCodec(UniformCodec):
    """Each row's own [min, max] on ``2**bits`` levels: FBGEMM's row-wise quantization."""

    codec_id = "asymmetric"

    def _ranges(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return row_extremes(x)


@register
class SymmetricCodec(UniformCodec):
    """Each row on a grid symmetric about 0, ``scale = max|x| / (2**(bits-1) - 1)``.

    Zero and ``±max|x|`` are exact, one code (the most negative) goes unused, and only the
    scale is stored: 2 bytes per row instead of 4.
    """

    codec_id = "symmetric"
    bias_stored = False

    def _plan(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        half_levels = 1 << (self.bits - 1)
        levels = (1 << self.bits) - 1
        peak = x.abs().amax(dim=1) if x.shape[1] else x.new_zeros(x.shape[0])
        wanted = peak.double() / (half_levels - 1)
        fits = bool((peak * half_levels / (half_levels - 1) < _FP16_SAFE_MAX).all()) and bool(
            ((peak == 0) | (wanted >= _FP16_MIN_NORMAL)).all()
        )
        half = self._half(fits)
        scale = _round_up(wanted, torch.float16 if half else torch.float32)
        lo = -half_levels * scale
        hi = (levels - half_levels) * scale
        return (lo.float(), hi.float(), half) if half else (lo, hi, half)


def _round_up(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Non-negative ``value`` (float64) rounded to ``dtype``, then up one step where rounding
    went down, so that ``max|x|`` stays on the grid; returned as float64."""
    rounded = value.to(dtype)
    if dtype == torch.float16:
        # Positive floats order like their bit patterns: one more is the next value up.
        bumped = (rounded.view(torch.int16) + 1).view(torch.float16)
    else:
        bumped = torch.nextafter(rounded, torch.full_like(rounded, float("inf")))
    return torch.where(rounded.double() < value, bumped, rounded).double()
