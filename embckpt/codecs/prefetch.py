"""A cache prefetch for the compiled kernels that write scattered rows of a block
(``row_kernels.py``, ``delta_kernels.py``).

Why: a restore adds a diff's changes into, or copies its rows over, rows spread over the
whole block. Where the block is larger than the cache, each row is a cache (and TLB) miss,
and the loop waits for one miss at a time: measured on the 2-core machine of
``benchmarks/results/``, 40,000 sorted random rows of 16 columns added into a 10M-row block
took 3.1 ms, 77 ns a row. Asking for the row a few rows ahead before adding this one keeps
several misses in flight: 1.1 ms (0.29 ms instead of 0.47 for 7,000 rows of 64 columns in a
150k-row block). Every cache line of the row is asked for, not only its first: rows of 64 and
128 columns span 4 and 8 lines, and copying 6,000 sorted random rows of 128 columns over a
100k-row block took 0.57 ms instead of 0.77 (30,000 rows of 64 columns in a 1.2M-row block:
1.9 instead of 2.4 ms); additions, and rows of one line, measured alike. numba has no prefetch
of its own, hence this intrinsic over LLVM's ``llvm.prefetch``. A prefetch is a hint: it
changes no value and never faults.

numba's disk cache (``cache=True``) sees edits to a kernel's own file only: the kernels
inline this, so after editing this file delete the ``*.nbi`` and ``*.nbc`` files of
codecs/__pycache__.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

#: Rows ahead of the one being written whose cache lines are asked for. 8 and 16 measured
#: alike (16 to 128 columns, 66k- to 10M-row blocks); 32 was slower on the 10M-row block.
ROWS_AHEAD = 8

LINE_BYTES = 64  # a cache line

_I8P = ir.IntType(8).as_pointer()
_I32 = ir.IntType(32)


@intrinsic
def _prefetch_at(typingctx: Any, array: types.Array, row: types.Integer, at: types.Integer) -> Any:
    """Asks the cache for the byte ``at`` of ``array[row]`` (2-D, any layout), to be written."""
    if not isinstance(array, types.Array) or array.ndim != 2:
        return None

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: list) -> Any:
        view = context.make_array(signature.args[0])(context, builder, args[0])
        stride = cgutils.unpack_tuple(builder, view.strides, 2)[0]
        index = context.cast(builder, args[1], signature.args[1], types.intp)
        offset = builder.add(
            builder.mul(index, stride),
            context.cast(builder, args[2], signature.args[2], types.intp),
        )
        start = builder.gep(builder.bitcast(view.data, _I8P), [offset])
        kind = ir.FunctionType(ir.VoidType(), [_I8P, _I32, _I32, _I32])
        prefetch = builder.module.declare_intrinsic("llvm.prefetch", fnty=kind)
        # Arguments: address, write (1), locality (3: keep in every cache level), data (1).
        builder.call(prefetch, [start, _I32(1), _I32(3), _I32(1)])
        return context.get_dummy_value()

    return types.void(array, row, at), codegen


_prefetch = cast("Callable[[Any, int, int], None]", _prefetch_at)


@njit(nogil=True, cache=True, inline="always")
def prefetch_row(array: np.ndarray, row: int) -> None:
    """Asks the cache for every line of ``array[row]`` (2-D, any layout), to be written."""
    for at in range(0, array.shape[1] * array.strides[1], LINE_BYTES):
        _prefetch(array, row, at)
