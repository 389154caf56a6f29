"""CheckFreq's adaptive checkpoint interval: as often as the measured stall allows.

The cost of one checkpoint to training is what it blocks (the time ``save`` holds the training
thread: waiting for the previous persist, deciding, snapshotting) plus what it slows (iterations
that run while a persist competes for the same cores take longer than clean ones). With ``t``
the clean iteration time and ``c`` that cost, checkpointing every ``k`` iterations costs
``c / (k t)`` of training time; the interval is the smallest ``k`` that keeps this under the
bound. Costs are running averages, so the interval follows drift (other jobs, larger diffs).

Ranks measure different times, so the checkpointer combines every rank's measurements (the
slowest counts) before calling :meth:`AdaptiveInterval.update`, and every rank gets the same
next checkpoint step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class IntervalMeasurements:
    """One rank's measurements since the previous checkpoint."""

    clean_iter_s: float  # mean iteration time with no persist running (0 if none seen)
    busy_extra_s: float  # summed extra time of iterations that overlapped a persist
    blocked_s: float  # time the last save() held the training thread
    iterations: int


@dataclass(frozen=True)
class ClockWindow:
    """The iterations an :class:`IterationClock` timed since its last collect."""

    clean_sum: float
    clean_n: int
    busy: tuple[float, ...]
    clean_ewma: float | None


@dataclass(frozen=True)
class IntervalState:
    """What :meth:`AdaptiveInterval.update` changes, for :meth:`AdaptiveInterval.restore`."""

    interval: int
    cost_s: float | None
    iteration_s: float | None
    updates: int


class IterationClock:
    """Times iterations between ``maybe_save`` calls on one rank."""

    def __init__(self) -> None:
        self._last: float | None = None
        self._clean_sum = 0.0
        self._clean_n = 0
        self._busy: list[float] = []
        self._clean_ewma: float | None = None

    def tick(self, now: float, busy: bool, exclude_s: float = 0.0) -> None:
        """Marks the end of an iteration; ``exclude_s`` is checkpoint time inside it."""
        if self._last is not None:
            elapsed = max(now - self._last - exclude_s, 0.0)
            if busy:
                self._busy.append(elapsed)
            else:
                self._clean_sum += elapsed
                self._clean_n += 1
        self._last = now

    def window(self) -> ClockWindow:
        """What the next :meth:`collect` consumes, for :meth:`give_back`."""
        return ClockWindow(self._clean_sum, self._clean_n, tuple(self._busy), self._clean_ewma)

    def give_back(self, window: ClockWindow) -> None:
        """Puts back a window a failed checkpoint collected: its iterations count again at
        the next checkpoint, with those timed since."""
        self._clean_sum += window.clean_sum
        self._clean_n += window.clean_n
        self._busy = [*window.busy, *self._busy]
        self._clean_ewma = window.clean_ewma

    def collect(self, blocked_s: float) -> IntervalMeasurements:
        """Measurements since the last collect; resets the window."""
        if self._clean_n:
            mean = self._clean_sum / self._clean_n
            self._clean_ewma = mean if self._clean_ewma is None else 0.5 * (self._clean_ewma + mean)
        clean = self._clean_ewma or 0.0
        extra = sum(max(t - clean, 0.0) for t in self._busy) if clean else 0.0
        out = IntervalMeasurements(clean, extra, blocked_s, self._clean_n + len(self._busy))
        self._clean_sum, self._clean_n, self._busy = 0.0, 0, []
        return out


class AdaptiveInterval:
    """Chooses the checkpoint interval (in iterations) from measured costs.

    Args:
        initial: the interval before anything is measured.
        stall_bound: the share of training time checkpoints may take (CheckFreq: a few %).
        minimum, maximum: limits on the interval.
        smoothing: weight of the newest checkpoint's cost in the running average.
    """

    def __init__(
        self,
        initial: int,
        stall_bound: float,
        minimum: int = 1,
        maximum: int = 100_000,
        smoothing: float = 0.5,
    ) -> None:
        self.interval = initial
        self.stall_bound = stall_bound
        self.minimum, self.maximum = minimum, maximum
        self.smoothing = smoothing
        self.cost_s: float | None = None
        self.iteration_s: float | None = None
        self.history: list[dict[str, float]] = []

    def update(self, m: IntervalMeasurements) -> int:
        """Folds in one checkpoint's measurements and returns the new interval."""
        cost = m.blocked_s + m.busy_extra_s
        a = self.smoothing
        self.cost_s = cost if self.cost_s is None else a * cost + (1 - a) * self.cost_s
        if m.clean_iter_s > 0:
            self.iteration_s = m.clean_iter_s
        if self.iteration_s:
            wanted = self.cost_s / (self.stall_bound * self.iteration_s)
            self.interval = int(min(max(math.ceil(wanted), self.minimum), self.maximum))
        self.history.append(
            {"cost_s": cost, "iteration_s": m.clean_iter_s, "interval": float(self.interval)}
        )
        return self.interval

    def state(self) -> IntervalState:
        return IntervalState(self.interval, self.cost_s, self.iteration_s, len(self.history))

    def restore(self, state: IntervalState) -> None:
        """Undoes the updates made since ``state`` was taken (a checkpoint that failed)."""
        self.interval, self.cost_s, self.iteration_s = (
            state.interval,
            state.cost_s,
            state.iteration_s,
        )
        del self.history[state.updates :]
