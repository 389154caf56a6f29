"""Giving the C heap's free pages back to the system after a restore.

A restore decodes through many mid-size buffers (batches of a few MB) on worker threads. glibc
serves those from per-thread arenas once its dynamic mmap threshold has risen past their size,
and keeps what they free: the next restore's threads may get other arenas, so the resident
memory of a process that restores again and again (a job that reloads, a test or benchmark)
grows by the buffers' peak, restore after restore, while the bytes in use stay flat
(``benchmarks/restore_memory.py`` measures both). ``malloc_trim(0)`` returns every arena's
free pages; it costs milliseconds, once per restore. Elsewhere than glibc it does nothing.
Arrow's own pool (the Parquet reads' buffers) is asked to give back what it keeps too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

import pyarrow as pa


@functools.cache
def _libc() -> Any | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to trim
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc


def trim_heap() -> bool:
    """Returns the C heap's and Arrow's free pages to the system; whether glibc returned any."""
    pa.default_memory_pool().release_unused()
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
