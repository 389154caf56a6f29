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
