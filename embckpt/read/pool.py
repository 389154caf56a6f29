"""The restore's worker threads, or none: with one thread asked for, the work runs on the
calling thread; small work (``INLINE_BYTES``) runs there too.

A restore's buffers come from the allocator of the thread that decodes them. glibc gives each
new thread an arena of its own, and ``malloc_trim`` cannot shrink the top of such an arena, so
a worker thread leaves up to its arena's trim threshold resident after it exits; on the calling
thread the same buffers are given back (``heap.py``; measured in
``benchmarks/restore_memory.py``). One worker also gains nothing from a thread.

Small work (a chain's diffs: staging a few small files, decoding a few thousand rows) is mostly
Python: on threads it waits for the GIL and pays a hand-over per task. Measured on the 2-core
machine of ``benchmarks/results/`` (2 ranks, a 15-link chain of the test model, both ways side
by side in one process, best of 40): 6.2 ms per extra link with every file on two threads per
rank, 5.6 ms with the small ones on the calling thread. Large work (a
full's row groups: Parquet and the codecs' kernels, which release the GIL) still goes to the
threads, and so does fetching from a store that is not a local disk, where a thread waits on
the network.
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable, Sequence
from typing import Any

from embckpt.cores import rank_cores


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


INLINE_BYTES = 1 << 20
"""Small work on at most this many encoded bytes in all runs on the calling thread where the
rank has more than one core (``submit_all``)."""


def inline_size(encoded_bytes: int, local: bool = True) -> int | None:
    """``encoded_bytes`` where work on them may run on the calling thread (small, and read
    from a local disk (``local``) or already in memory), else None: what
    :func:`submit_all` weighs against its budget."""
    return encoded_bytes if local and encoded_bytes <= INLINE_BYTES else None


_INLINE = InlineExecutor()


def submit_all(
    pool: concurrent.futures.Executor,
    tasks: Sequence[tuple[int | None, Callable[..., Any], tuple]],
) -> list[concurrent.futures.Future]:
    """Each task ``(inline_bytes, fn, args)``: ``fn(*args)`` on ``pool``, or on the calling
    thread for the smallest tasks that may run there (``inline_bytes``, from
    :func:`inline_size`) while their bytes add up to at most ``INLINE_BYTES`` (all of them on
    one core per rank: module doc). The pool's are submitted first, so that they run while
    the calling thread works through its own; the futures come back in the tasks' order."""
    budget, here = (INLINE_BYTES if rank_cores() > 1 else math.inf), set()
    small = sorted((t[0], i) for i, t in enumerate(tasks) if t[0] is not None)
    for size, i in small:
        if size > budget:
            break
        budget -= size
        here.add(i)
    futures: list[concurrent.futures.Future | None] = [None] * len(tasks)
    for inline in (False, True):
        for i, (_, fn, args) in enumerate(tasks):
            if (i in here) == inline:
                futures[i] = (_INLINE if inline else pool).submit(fn, *args)
    return [f for f in futures if f is not None]


def worker_pool(threads: int, name: str) -> concurrent.futures.Executor:
    """``threads`` worker threads named ``name``, or the calling thread when ``threads`` <= 1."""
    if threads <= 1:
        return InlineExecutor()
    return concurrent.futures.ThreadPoolExecutor(threads, name)
