"""The restore's worker threads, or none: with one thread asked for, the work runs on the
calling thread.

A restore's buffers come from the allocator of the thread that decodes them. glibc gives each
new thread an arena of its own, and ``malloc_trim`` cannot shrink the top of such an arena, so
a worker thread leaves up to its arena's trim threshold resident after it exits; on the calling
thread the same buffers are given back (``heap.py``; measured in
``benchmarks/restore_memory.py``). One worker also gains nothing from a thread.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any


class InlineExecutor(concurrent.futures.Executor):
    """An executor that runs each task as it is submitted, on the submitting thread."""

    def submit(
        self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:  # kept in the future, raised by result() as a pool would
            future.set_exception(exc)
        else:
            future.set_result(result)
        return future


def worker_pool(threads: int, name: str) -> concurrent.futures.Executor:
    """``threads`` worker threads named ``name``, or the calling thread when ``threads`` <= 1."""
    if threads <= 1:
        return InlineExecutor()
    return concurrent.futures.ThreadPoolExecutor(threads, name)
