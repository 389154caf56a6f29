"""The best full / one-shot-diff schedule knowing the future: a lower bound for any predictor.

Input: which rows each checkpoint interval touched (one bitmap per interval). A one-shot diff
at interval ``t`` after a full at ``f`` writes every row touched in intervals ``f+1..t``; a full
writes every row. With checkpoints priced from measured bytes (a full: its mean size; a diff:
rows times bytes per diff row plus the fixed per-checkpoint files), dynamic programming over
where the fulls go finds the cheapest schedule (the first checkpoint has nothing to diff
against, so it is full).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def union_counts(touched: np.ndarray) -> np.ndarray:
    """``counts[f, t]`` = rows touched in any of the intervals ``f+1..t`` (for ``t > f``; 0
    elsewhere), from ``touched`` [intervals, rows] (bool). Rows of several bitmaps (shards,
    ranks) are simply more columns; counts of separate parts add."""
    intervals = len(touched)
    counts = np.zeros((intervals, intervals), dtype=np.int64)
    for first in range(intervals - 1):
        grown = np.logical_or.accumulate(touched[first + 1 :], axis=0)
        counts[first, first + 1 :] = np.count_nonzero(grown, axis=1)
    return counts


@dataclass(frozen=True)
class Pricing:
    """Bytes of a checkpoint: ``full_bytes`` for a full, ``diff_fixed_bytes`` plus
    ``diff_row_bytes`` per written row for a diff."""

    full_bytes: float
    diff_row_bytes: float
    diff_fixed_bytes: float

    def diff_costs(self, counts: np.ndarray) -> np.ndarray:
        """``cost[f, t]`` of a diff at ``t`` after a full at ``f`` (0 where ``t <= f``)."""
        cost = counts * self.diff_row_bytes + self.diff_fixed_bytes
        return np.triu(cost, k=1)


def schedule_bytes(parents: list[int | None], full_bytes: float, diff_costs: np.ndarray) -> float:
    """Bytes written by a schedule: ``parents[t]`` is None for a full at ``t``, else the
    interval the diff at ``t`` applies on (its full for a one-shot diff, the previous checkpoint
    for an incremental one), with ``diff_costs[p, t]`` the bytes of a diff at ``t`` on ``p``."""
    return sum(full_bytes if p is None else float(diff_costs[p, t]) for t, p in enumerate(parents))


def one_shot_parents(kinds: list[str]) -> list[int | None]:
    """The parents of ``kinds`` (``full`` / ``diff`` per interval) when every diff is one-shot."""
    fulls = np.maximum.accumulate(np.where(np.array(kinds) == "full", np.arange(len(kinds)), 0))
    return [None if kind == "full" else int(f) for kind, f in zip(kinds, fulls, strict=True)]


def best_schedule(full_bytes: float, diff_costs: np.ndarray) -> tuple[float, list[str]]:
    """The cheapest schedule: (bytes written, ``full`` / ``diff`` per interval), with
    ``diff_costs[f, t]`` the bytes of a diff at ``t`` after a full at ``f`` (upper triangle).

    ``best[g]`` is the cheapest way to cover intervals ``0..g-1`` ending a chain at ``g - 1``;
    a chain from a full at ``f`` to ``g - 1`` costs the full plus its diffs ``f+1..g-1``.
    """
    intervals = len(diff_costs)
    chain = np.cumsum(np.triu(diff_costs, k=1), axis=1)  # chain[f, t]: diffs f+1..t
    best = np.zeros(intervals + 1)
    start = np.zeros(intervals + 1, dtype=np.int64)
    for end in range(1, intervals + 1):
        options = best[:end] + full_bytes + chain[:end, end - 1]
        start[end] = int(np.argmin(options))
        best[end] = options[start[end]]
    kinds = ["diff"] * intervals
    end = intervals
    while end > 0:
        kinds[start[end]] = "full"
        end = int(start[end])
    return float(best[intervals]), kinds


def best_bounded_schedule(
    full_bytes: float, diff_costs: np.ndarray, bound: float, link_bytes: float = 0.0
) -> tuple[float, list[str]]:
    """The cheapest schedule of fulls, one-shot and incremental diffs whose every checkpoint
    restores reading at most ``bound`` bytes (a full alone always may): (bytes written, per
    interval ``F`` full / ``d`` one-shot / ``i`` incremental). ``link_bytes``: what each diff a
    restore reads costs beyond its bytes, in bytes that take as long to restore (its files'
    fixed work), counted against ``bound`` too.

    ``diff_costs[p, t]`` prices a diff at ``t`` on checkpoint ``p``: one-shot on the full ``f``
    (``diff_costs[f, t]``), incremental on ``t - 1``. After a full at ``f`` and the latest
    one-shot diff (or the full) at ``o``, a restore at ``t`` reads the full, that one-shot diff
    and the incremental diffs ``o+1..t``: the state ``(f, o)`` fixes it, so dynamic programming
    over the states at each interval is exact (a few hundred states per interval here).
    """
    intervals = len(diff_costs)
    step = np.array([diff_costs[t - 1, t] if t else 0.0 for t in range(intervals)])
    increments = np.cumsum(step)  # increments[t] - increments[o]: incremental diffs o+1..t

    def reads(f: int, o: int, t: int) -> float:
        one_shot = diff_costs[f, o] if o > f else 0.0
        links = (o > f) + (t - o)
        return full_bytes + one_shot + increments[t] - increments[o] + link_bytes * links

    # states[(f, o)] = (bytes written so far, the previous interval's state, this kind)
    states: dict[tuple[int, int], tuple[float, tuple[int, int] | None, str]] = {
        (0, 0): (full_bytes, None, "F")
    }
    history = [states]
    for t in range(1, intervals):
        cheapest = min(states, key=lambda s: states[s][0])
        nxt: dict[tuple[int, int], tuple[float, tuple[int, int] | None, str]] = {
            (t, t): (states[cheapest][0] + full_bytes, cheapest, "F")
        }
        for (f, o), (written, _, _) in states.items():
            options = (((f, t), diff_costs[f, t], "d"), ((f, o), step[t], "i"))
            for state, cost, kind in options:
                if reads(state[0], state[1], t) > bound:
                    continue
                total = written + cost
                if state not in nxt or total < nxt[state][0]:
                    nxt[state] = (total, (f, o), kind)
        states = nxt
        history.append(states)
    state: tuple[int, int] | None = min(states, key=lambda s: states[s][0])
    best = states[state][0]
    kinds = []
    for t in range(intervals - 1, -1, -1):
        assert state is not None
        _, previous, kind = history[t][state]
        kinds.append(kind)
        state = previous
    return float(best), kinds[::-1]
