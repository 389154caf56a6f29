"""Which kind of checkpoint to take: full, differential (and against what), or none.

Policies are pure functions of a :class:`PolicyInput`, identical on every rank because their
inputs are (global dirty fractions and the chain's history), so every rank decides alike without
talking. New policies (the intermittent predictor) subclass :class:`Policy` and register in
:data:`POLICIES`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from enum import Enum

from embckpt.config import CheckpointConfig
from embckpt.errors import ConfigError
from embckpt.storage.manifest import HistoryEntry


class Kind(str, Enum):
    FULL = "full"
    DIFF = "diff"
    SKIP = "skip"


@dataclass(frozen=True)
class PolicyInput:
    """What a policy may look at.

    Attributes:
        step: the step being checkpointed.
        dirty_since_last: fraction of all table elements touched since the previous checkpoint.
        dirty_since_full: the same, since the last full checkpoint.
        history: checkpoints since (and including) the last full one, oldest first; empty when
            there is no full checkpoint to build on.
    """

    step: int
    dirty_since_last: float
    dirty_since_full: float
    history: tuple[HistoryEntry, ...]


@dataclass(frozen=True)
class Decision:
    """A policy's answer: the kind and, for a diff, the tracker view whose rows it writes."""

    kind: Kind
    view: str | None = None
    reason: str = ""


class Policy(abc.ABC):
    """Decides the kind of each checkpoint."""

    name: str

    def __init__(self, full_every: int = 0) -> None:
        self.full_every = full_every

    def decide(self, stats: PolicyInput) -> Decision:
        if not stats.history:
            return Decision(Kind.FULL, reason="no full checkpoint to build on")
        if self.full_every and len(stats.history) >= self.full_every:
            return Decision(Kind.FULL, reason=f"full_every={self.full_every} reached")
        return self._decide_diff(stats)

    @abc.abstractmethod
    def _decide_diff(self, stats: PolicyInput) -> Decision:
        """Decides when a full checkpoint exists and ``full_every`` does not force one."""


class FullPolicy(Policy):
    """Every checkpoint is full (the baseline)."""

    name = "full"

    def _decide_diff(self, stats: PolicyInput) -> Decision:
        return Decision(Kind.FULL, reason="policy full")


class OneShotPolicy(Policy):
    """Diffs hold every row changed since the last full checkpoint: restore reads two."""

    name = "one_shot"

    def _decide_diff(self, stats: PolicyInput) -> Decision:
        return Decision(Kind.DIFF, view="since_full", reason="rows changed since the last full")


class IncrementalPolicy(Policy):
    """Diffs hold the rows changed since the previous checkpoint: restore reads the chain."""

    name = "incremental"

    def _decide_diff(self, stats: PolicyInput) -> Decision:
        return Decision(Kind.DIFF, view="since_last", reason="rows changed since the previous")


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (FullPolicy, OneShotPolicy, IncrementalPolicy)
}


def make_policy(config: CheckpointConfig) -> Policy:
    """The policy ``config.policy`` names.

    Raises:
        ConfigError: no such policy.
    """
    try:
        return POLICIES[config.policy](full_every=config.full_every)
    except KeyError:
        raise ConfigError(f"unknown policy {config.policy!r}; known: {sorted(POLICIES)}") from None
