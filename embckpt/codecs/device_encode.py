"""Quantizing embedding rows on their GPU, before they are copied to host memory.

Why: encoding CUDA tables on the CPU first copies their fp32 rows to the host (4 bytes per
value), then quantizes them at 1-3 GB/s per core; quantized where they live, only the fused
rows cross (a few bits per value, plus 2-4 bytes per row). The bytes are exactly the CPU path's
(device_kernels.py says how), so a file does not depend on where its rows were encoded:
``codec.encode_fused(*device_fused(codec, rows))`` equals ``codec.encode(rows.cpu())``.
Measured on an H100 (torch 2.11, Triton 3.6; :func:`measure_gbps` on 1 GiB of trained-like
fp32 rows of 64 and 128 columns): ``adaptive`` 95-127 GB/s, ``asymmetric`` and ``symmetric``
327-483 GB/s at 2-4 bits, 62-121 GB/s at 8 bits (one byte store per value); copying the fp32
rows to (pageable) host memory ran at 1.4 GB/s there.

Contract: :func:`device_fused` returns the fused rows on the device and ``half`` (True), or
None where this path does not apply; the caller then copies the fp32 rows and encodes them on
the CPU, which also reports what is wrong with them (NaN, rows beyond fp16 under
``param_dtype="float16"``). It applies to ``asymmetric``, ``symmetric`` and ``adaptive``
(exactly those classes: a subclass, or an additive codec, may choose its ranges otherwise), on
float32 rows with unit column stride, when Triton is importable, and when every row of the
batch is finite and fp16 parameters hold it (fp32 parameters are the CPU's alone).

Test hook: with ``TRITON_INTERPRET=1`` in the environment when the kernels are first used,
Triton's interpreter runs them, on CPU tensors too (numpy arithmetic: the same IEEE float32
operations), so the bytes can be checked on a machine without a GPU.
"""

from __future__ import annotations

import functools
import time
from types import ModuleType

import numpy as np
import torch

from embckpt.codecs.adaptive import AdaptiveCodec
from embckpt.codecs.base import Codec
from embckpt.codecs.packing import packed_width
from embckpt.codecs.uniform import AsymmetricCodec, SymmetricCodec, UniformCodec
from embckpt.errors import CodecError

#: Rows per program, one per thread of ``_WARPS`` warps (64 measured a little faster than
#: 128 on an H100); the interpreter, whose cost is per operation on a whole block, takes
#: larger blocks. The bytes depend on neither.
_BLOCK = 64
_INTERPRETED_BLOCK = 1024
_WARPS = 2
#: Columns per iteration of the kernel's loops: independent loads in flight per thread.
_UNROLL = 8
#: Per bit width, packing.py's group: codes per group and the bytes they fill.
_GROUPS = {2: (4, 1), 3: (8, 3), 4: (2, 1), 8: (1, 1)}


@functools.cache
def _kernels() -> ModuleType | None:
    """device_kernels.py, or None without Triton; imported on first use, when the
    interpreter setting (``TRITON_INTERPRET``) decides how its kernels are built."""
    try:
        from embckpt.codecs import device_kernels
    except ImportError:
        return None
    return device_kernels


def is_available(device: torch.device) -> bool:
    """Whether the kernels run on ``device``: Triton is importable and ``device`` is CUDA, or
    Triton's interpreter is on (any device)."""
    kernels = _kernels()
    return kernels is not None and (kernels.INTERPRETED or device.type == "cuda")


def device_fused(codec: Codec, rows: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """The fused rows [n, width + params] (uint8, on ``rows``' device) that ``codec.encode``
    would write for float32 ``rows`` [n, cols], and ``half`` (True); None where the device
    path does not apply (see the module's docstring).

    Allocates the output and one byte per row; waits for the kernel (one flag read back).
    """
    kernels = _kernels()
    if kernels is None or not isinstance(codec, UniformCodec) or not _servable(rows):
        return None
    mode = _mode(kernels, codec)
    if mode is None:
        return None
    n, cols = rows.shape
    width = packed_width(cols, codec.bits) + codec._param_bytes(True)
    out = torch.empty((n, width), dtype=torch.uint8, device=rows.device)
    if n == 0:
        return out, True
    ok = torch.empty(n, dtype=torch.int8, device=rows.device)
    adaptive = isinstance(codec, AdaptiveCodec)
    per, nbytes = _GROUPS[codec.bits]
    block = _INTERPRETED_BLOCK if kernels.INTERPRETED else _BLOCK
    # The interpreter computes with numpy, which warns where IEEE arithmetic just returns
    # an infinity (a scale of 0, rows that will not fit); the kernel's tests catch those.
    with np.errstate(all="ignore"):
        kernels.encode_rows[(-(-n // block),)](
            rows.detach(),
            out,
            ok,
            n,
            rows.stride(0),
            out.stride(0),
            float(codec.n_bins) if adaptive else 1.0,
            COLS=cols,
            STEPS=codec._steps() if adaptive else 0,
            MODE=mode,
            CHECK_EXTREMES=codec.param_dtype == "auto",
            BITS=codec.bits,
            PER=per,
            NBYTES=nbytes,
            BLOCK=block,
            UNROLL=_UNROLL,
            num_warps=_WARPS,
            enable_fp_fusion=False,
        )
    return (out, True) if bool(ok.all()) else None


def _mode(kernels: ModuleType, codec: UniformCodec) -> int | None:
    """The kernel's mode for ``codec``, or None when the device path does not serve it."""
    if codec.param_dtype == "float32":
        return None
    if type(codec) is SymmetricCodec:
        return int(kernels.SYMMETRIC.value)
    if type(codec) is AdaptiveCodec and codec._steps() >= 2:
        return int(kernels.ADAPTIVE.value)
    # Under two steps the walk keeps each row's own range: asymmetric's.
    if type(codec) in (AsymmetricCodec, AdaptiveCodec):
        return int(kernels.ASYMMETRIC.value)
    return None


def _servable(rows: torch.Tensor) -> bool:
    """Whether the kernel reads ``rows`` as they are: float32 [n, cols > 0], unit column
    stride, on a device it runs on."""
    return (
        rows.dim() == 2
        and rows.dtype == torch.float32
        and rows.shape[1] > 0
        and (rows.stride(1) == 1 or rows.shape[1] == 1)
        and is_available(rows.device)
    )


def measure_gbps(codec: Codec, rows: torch.Tensor, repeats: int = 5) -> float:
    """GB/s of float32 rows that :func:`device_fused` encodes, over ``repeats`` synchronised
    calls after a first one (which compiles the kernel) that is not counted.

    Raises:
        CodecError: the device path does not apply to ``codec`` and ``rows``.
    """
    if device_fused(codec, rows) is None:
        raise CodecError(f"codec {codec.codec_id!r}: these rows do not encode on the device")
    _synchronize(rows.device)
    start = time.perf_counter()
    for _ in range(repeats):
        device_fused(codec, rows)
    _synchronize(rows.device)
    return rows.numel() * 4 * repeats / (time.perf_counter() - start) / 1e9


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
