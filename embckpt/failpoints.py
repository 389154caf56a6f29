"""Named failure points on the save and restore paths, for fault-schedule tests.

Storage faults reach embckpt through the filesystem a job passes; faults of embckpt's own code
(a codec that raises, a rank that fails while planning, a crash between the files and the
manifest) need a way in as well. Each phase boundary calls :func:`hit` with its name; a test
arms a point for one rank and the n-th time it is reached, and the point then raises
:class:`InjectedFault` (or runs the test's action, e.g. killing the process). Nothing is armed
in normal runs, where :func:`hit` is one dictionary lookup.

Points are process-wide: arm them in the process (rank) that should fail.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

#: Every point, in the order a save or a restore reaches them.
SAVE_POINTS = (
    "save.decide",  # training thread, before the ranks' dirty fractions are combined
    "save.plan",  # training thread, after the tracker bits are taken, before units are planned
    "save.stage",  # each piece's copy into the staging arena
    "save.encode",  # each unit, before its codec runs
    "save.write",  # each unit, after encoding, before its file is written
    "save.dense",  # before the dense and rank files are written
    "save.agree",  # before the ranks agree that every file is written
    "save.manifest",  # rank 0, before the manifest is written
    "save.retention",  # rank 0, after the commit, before retention deletes old checkpoints
)
RESTORE_POINTS = (
    "restore.plan",  # after the chain is read, before reads are planned
    "restore.fetch",  # before the planned row groups are fetched and verified
    "restore.side_state",  # before the dense and rank files are read
    "restore.apply",  # after every rank agreed, before rows are written into the model
)
MERGE_POINTS = ("merge.write",)  # before a merged checkpoint's manifest is written
POINTS = SAVE_POINTS + RESTORE_POINTS + MERGE_POINTS


class InjectedFault(RuntimeError):
    """The error an armed point raises."""


@dataclass
class _Rule:
    nth: int  # fire on this hit (1-based) of the point, counted in this process
    action: Callable[[], None] | None
    hits: int = 0


_armed: dict[str, _Rule] = {}
_lock = threading.Lock()


def arm(point: str, *, nth: int = 1, action: Callable[[], None] | None = None) -> None:
    """Makes the ``nth`` hit of ``point`` in this process fail: ``action`` runs if given,
    else :class:`InjectedFault` is raised. The point disarms itself once it fired."""
    if point not in POINTS:
        raise ValueError(f"unknown failure point {point!r}; known: {', '.join(POINTS)}")
    if nth < 1:
        raise ValueError(f"nth must be >= 1, got {nth}")
    with _lock:
        _armed[point] = _Rule(nth, action)


def disarm() -> None:
    """Disarms every point of this process."""
    with _lock:
        _armed.clear()


def armed() -> tuple[str, ...]:
    """The points armed and not yet fired."""
    with _lock:
        return tuple(_armed)


def hit(point: str) -> None:
    """Called by embckpt at ``point``; fails there if a test armed it."""
    if not _armed:
        return
    with _lock:
        rule = _armed.get(point)
        if rule is None:
            return
        rule.hits += 1
        if rule.hits < rule.nth:
            return
        del _armed[point]
    if rule.action is not None:
        rule.action()
        return
    raise InjectedFault(f"injected fault at {point}")
