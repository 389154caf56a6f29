"""fp16 rounding for the compiled kernels (uniform_kernels.py, adaptive_kernels.py), done on
the float32 bit pattern (round to nearest even, as ``Tensor.half()``): numba has no fp16
arithmetic on the CPU. Both kernel modules round their parameters here, so that they round
alike; tests/test_codecs.py checks the rounding against torch.

numba's disk cache (``cache=True``) sees edits to a kernel's own file only: the kernels inline
these helpers, so after editing this file delete the ``*.nbi`` and ``*.nbc`` files of
codecs/__pycache__.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

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
bits_f32 = _bitcast(types.uint32, types.float32, ir.FloatType())


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def half_round(value: np.float32) -> np.float32:
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
        tiny = bits_f32(mag) * _F32(16777216.0)
        mag = _f32_bits(np.rint(tiny) * _F32(5.960464477539063e-08))
    return bits_f32(mag | sign)


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def half_bits(value: np.float32) -> np.uint32:
    """The fp16 bit pattern of a float32 that fp16 represents exactly (or an infinity)."""
    bits = _f32_bits(value)
    sign = (bits >> _U32(16)) & _U32(0x8000)
    mag = bits & _U32(0x7FFFFFFF)
    if mag >= _U32(0x7F800000):
        half = _U32(0x7C00)
    elif mag >= _U32(0x38800000):
        half = (mag >> _U32(13)) - _U32(112 << 10)
    else:
        half = _U32(bits_f32(mag) * _F32(16777216.0))
    return half | sign


@njit(nogil=True, cache=True, error_model="numpy", inline="always")
def half_value(bits: np.uint32) -> np.float32:
    """The float32 an fp16 bit pattern (low 16 bits of ``bits``) stands for, exactly as
    ``numpy.float16.astype(float32)``: subnormals scaled from their mantissa, infinities and
    NaNs kept."""
    sign = (bits & _U32(0x8000)) << _U32(16)
    exponent = (bits >> _U32(10)) & _U32(31)
    mantissa = bits & _U32(0x3FF)
    if exponent == _U32(0):
        magnitude = _F32(mantissa) * _F32(5.960464477539063e-08)  # 2**-24: exact
        return -magnitude if sign else magnitude
    if exponent == _U32(31):
        return bits_f32(sign | _U32(0x7F800000) | (mantissa << _U32(13)))
    return bits_f32(sign | ((exponent + _U32(112)) << _U32(23)) | (mantissa << _U32(13)))
