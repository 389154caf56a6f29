"""The cores a rank may use: its share of the host's, for the threads that read and write files."""

from __future__ import annotations

import os


def rank_cores() -> int:
    """This rank's share of the cores this process may run on (``LOCAL_WORLD_SIZE`` ranks per
    host share them), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:  # pragma: no cover - macOS
        cores = os.cpu_count() or 1
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, cores // local_ranks)


def writer_threads(configured: int | None) -> int:
    """Threads encoding and writing a save's files (``CheckpointConfig.io_threads``): as
    configured, else the rank's cores but one, which the training thread keeps; at least 1,
    at most 16 (beyond that the writes, not the encoding, bound a save)."""
    if configured is not None:
        return configured
    return min(16, max(1, rank_cores() - 1))


def restore_threads() -> int:
    """Threads decoding a restore on one rank: twice the rank's share of the cores, at most 8.

    Why more than the share: ranks seldom restore equal work (table-wise sharding puts a large
    table on one rank) and training waits for the slowest, so a rank takes the cores the ranks
    that finish first leave idle. Measured on the 2-core machine of ``benchmarks/results/``
    (2 ranks, one holding a 10M-row table): its 4-bit full restored in 0.82 s with one thread
    per rank and 0.46 s with two; balanced ranks lost nothing."""
    return min(8, 2 * rank_cores())
