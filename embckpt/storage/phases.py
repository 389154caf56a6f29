"""Where a save's or a restore's time goes: seconds per phase, summed over the threads that
worked on it.

A save runs its phases on several threads at once (the persist thread, the file writers), and so
does a restore (its reader threads), so each phase's figure is thread-seconds: the sum, over
threads, of the wall time spent in it.
Phases nest (a file write times its checksum, and inside it the write and the fsync); a phase
counts only its own time, never that of the phases nested inside it, so the figures add up to
the threads' busy time without double counting.

The names are the flows' own (docs/ARCHITECTURE.md): a save's snapshot, encode, write (its
checksums timed apart as ``hash``, its fsyncs as ``fsync``) and commit; a restore's plan, fetch,
verify, decode and apply.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = ("snapshot", "encode", "hash", "write", "fsync", "commit")
RESTORE_PHASES = ("plan", "fetch", "verify", "decode", "apply")


class PhaseClock:
    """Thread-safe seconds per phase of one save (``PHASES``, the default) or one restore
    (``RESTORE_PHASES``); ``reset()`` starts again."""

    def __init__(self, phases: tuple[str, ...] = PHASES) -> None:
        self.phases = phases
        self._lock = threading.Lock()
        self._seconds = dict.fromkeys(phases, 0.0)
        self._local = threading.local()

    def reset(self) -> None:
        with self._lock:
            self._seconds = dict.fromkeys(self.phases, 0.0)

    def add(self, phase: str, seconds: float) -> None:
        """Counts ``seconds`` measured by the caller towards ``phase``."""
        with self._lock:
            self._seconds[phase] += seconds

    @contextmanager
    def time(self, phase: str) -> Iterator[None]:
        """Counts the time of the block, less its nested phases, towards ``phase``."""
        if phase not in self.phases:
            what = "save" if self.phases == PHASES else "restore"
            raise ValueError(f"unknown {what} phase {phase!r}; phases are {self.phases}")
        stack: list[float] = self._local.__dict__.setdefault("nested", [])
        stack.append(0.0)  # seconds of phases nested in this one
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            nested = stack.pop()
            if stack:
                stack[-1] += elapsed
            with self._lock:
                self._seconds[phase] += elapsed - nested

    def seconds(self) -> dict[str, float]:
        """Seconds per phase so far, every phase present."""
        with self._lock:
            return dict(self._seconds)


@contextmanager
def timed(clock: PhaseClock | None, phase: str) -> Iterator[None]:
    """``clock.time(phase)``, or nothing when there is no clock (offline writers)."""
    if clock is None:
        yield
    else:
        with clock.time(phase):
            yield
