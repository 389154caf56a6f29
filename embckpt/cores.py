"""The cores a rank may use: its share of the host's, for the threads that read and write files."""

from __future__ import annotations

import os
from collections.abc import Sequence


def rank_cores() -> int:
    """This rank's share of the cores this process may run on (``LOCAL_WORLD_SIZE`` ranks per
    host share them), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:  # pragma: no cover - macOS
        cores = os.cpu_count() or 1
    return max(1, cores // local_ranks())


def writer_threads(configured: int | None) -> int:
    """Threads encoding and writing a save's files (``CheckpointConfig.io_threads``): as
    configured, else the rank's cores but one, which the training thread keeps; at least 1,
    at most 16 (beyond that the writes, not the encoding, bound a save)."""
    if configured is not None:
        return configured
    return min(16, max(1, rank_cores() - 1))


def local_ranks() -> int:
    """Ranks on this host (``LOCAL_WORLD_SIZE``), at least 1."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def restore_threads() -> int:
    """Threads decoding a restore on one rank: twice the rank's share of the cores, at most 8.

    Why more than the share: ranks seldom restore equal work (table-wise sharding puts a large
    table on one rank) and training waits for the slowest, so a rank takes the cores the ranks
    that finish first leave idle. Measured on the 2-core machine of ``benchmarks/results/``
    (2 ranks, one holding a 10M-row table): its 4-bit full restored in 0.82 s with one thread
    per rank and 0.46 s with two. A restore that knows the other ranks' work takes
    :func:`balanced_restore_threads` instead."""
    return min(8, 2 * rank_cores())


def balanced_restore_threads(mine: float, others: Sequence[float]) -> int:
    """Threads for a restore of ``mine`` planned bytes on this rank while the other ranks of
    its host restore ``others``: its share of the cores, plus the share each of them leaves
    idle while this one works (one with a tenth of this rank's bytes: nine tenths of its
    cores), at most :func:`restore_threads`.

    Why not always :func:`restore_threads`: its second share pays only where other ranks
    finish first. Where they restore as much as this one, every core is busy and the extra
    threads only contend for them: measured on the 2-core machine of ``benchmarks/results/``
    (2 ranks, in the training processes, medians of 20 restores), ``benchmarks/family.py``'s
    zipf1.0_dim32 chain restored in 63-66 ms on one thread per rank against 70-73 ms on two,
    its full in 31-32 against 37-39 ms; the 10.2M-row model's full, on one rank, still needs
    the other rank's idle core (195 ms on two threads, 280 ms on one).
    """
    own = rank_cores()
    idle = sum(own * max(0.0, 1.0 - other / max(mine, 1.0)) for other in others)
    return max(1, min(restore_threads(), round(own + idle)))
