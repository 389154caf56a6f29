"""Which kind of checkpoint to take: full, differential (and against what), or none.

Policies are pure functions of a :class:`PolicyInput`, identical on every rank because their
inputs are (global dirty fractions and the chain's history), so every rank decides alike without
talking. New policies (the intermittent predictor) subclass :class:`Policy` and register in
:data:`POLICIES`.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from embckpt.errors import ConfigError

COST_MAX_CHAIN = 1.2
"""The ``cost`` rule's floor on what a restore may read, in full checkpoints: a chain may always
read this much (as ``max_chain`` bounded it by default before issue 31)."""

COST_MAX_RESTORE_FP32 = 0.3
"""The ``cost`` rule's default bound on a restore's reads, as a share of the model's full fp32
checkpoint (weights and optimizer state, what ``dcp.save`` writes for them, and what
``dcp.load`` reads instead). Measured against ``dcp.load``'s time
(``benchmarks/restore_bound.py``): on the 2-core CPU of ``benchmarks/results/``, a 4-bit
chain's restore time grows with its links (10 to 24 ms each on models of 0.08 to 0.7 GB)
more than with its bytes, and a 4-bit full alone restores in 0.7x to 1.4x ``dcp.load``'s
time (``benchmarks/family.py``), so no share keeps long chains within ``dcp.load`` there. 0.3
is the share the write goal needs (40x below fp32 where 5% of rows change per interval,
``benchmarks/family.py``); the restores it allows are measured there against ``dcp.load``
(``restore_vs_dcp_load``)."""


class HistoryRecord(Protocol):
    """A past checkpoint of the chain, as a policy sees it (the manifest's history entries
    have this shape; policies never read storage)."""

    @property
    def step(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def bytes(self) -> int: ...
    @property
    def dirty_fraction(self) -> float: ...


def assumed_chain_bytes(history: Sequence[HistoryRecord]) -> int:
    """What a restore of the latest checkpoint of ``history`` reads when nobody recorded it:
    the chain is taken as one-shot, the full plus the latest diff (if any)."""
    return history[0].bytes + (history[-1].bytes if len(history) > 1 else 0)


class PolicySettings(Protocol):
    """The settings :func:`make_policy` reads (``CheckpointConfig`` has them)."""

    @property
    def policy(self) -> str: ...
    @property
    def full_every(self) -> int | None: ...
    @property
    def policy_options(self) -> Mapping[str, Any]: ...


class Kind(str, Enum):
    """A checkpoint's kind, as the manifest's ``kind`` field spells it."""

    FULL = "full"
    DIFF = "diff"


class DiffBase(Enum):
    """Which rows a diff holds: those changed since the last full checkpoint (a one-shot diff;
    a restore reads the full and it) or since the previous checkpoint (an incremental diff; a
    restore reads the whole chain). The saver maps it to the row tracker's view."""

    LAST_FULL = "last_full"
    PREVIOUS = "previous"


@dataclass(frozen=True)
class PolicyInput:
    """What a policy may look at.

    Attributes:
        step: the step being checkpointed.
        dirty_since_last: fraction of all table elements touched since the previous checkpoint.
        dirty_since_full: the same, since the last full checkpoint.
        history: checkpoints since (and including) the last full one, oldest first; empty when
            there is no full checkpoint to build on.
        chain_bytes: bytes a restore of the latest checkpoint reads (its full and the diffs its
            parent links pass through); None when unknown (:func:`assumed_chain_bytes`).
        fp32_full_bytes: bytes of the model's tables and their optimizer state at fp32 (a full
            fp32 checkpoint's rows); None when unknown (no bound relative to it applies).
    """

    step: int
    dirty_since_last: float
    dirty_since_full: float
    history: tuple[HistoryRecord, ...]
    chain_bytes: int | None = None
    fp32_full_bytes: int | None = None


@dataclass(frozen=True)
class Decision:
    """A policy's answer: the kind and, for a diff, which rows it holds (a diff without a
    ``base`` is incremental)."""

    kind: Kind
    base: DiffBase | None = None
    reason: str = ""

    @property
    def one_shot(self) -> bool:
        """A diff of every row changed since the last full: it sits on the full, not on the
        previous checkpoint."""
        return self.kind is Kind.DIFF and self.base is DiffBase.LAST_FULL


class Policy(abc.ABC):
    """Decides the kind of each checkpoint.

    ``full_every``: a full checkpoint at the latest once the chain since the last full holds
    this many checkpoints (0: never forced); None takes the policy's own
    :attr:`default_full_every`. It is checked before the policy decides, so it only ever forces
    a full: for a policy that decides fulls itself (``intermittent``) it is a cap on chain
    length, never the rule.

    ``mixes_diffs``: whether one-shot diffs may be followed by incremental ones (the writer
    then keeps what such a chain reconstructs, for additive codecs).
    """

    name: str
    mixes_diffs: bool = False
    default_full_every: int = 0
    """``full_every`` when the settings leave it None."""

    def __init__(self, full_every: int | None = None) -> None:
        self.full_every = self.default_full_every if full_every is None else full_every

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
    default_full_every = 4  # a one-shot diff regrows towards a full; nothing else bounds it

    def _decide_diff(self, stats: PolicyInput) -> Decision:
        return Decision(
            Kind.DIFF, base=DiffBase.LAST_FULL, reason="rows changed since the last full"
        )


class IncrementalPolicy(Policy):
    """Diffs hold the rows changed since the previous checkpoint: restore reads the chain."""

    name = "incremental"
    default_full_every = 4  # restores read the whole chain; nothing else bounds it

    def _decide_diff(self, stats: PolicyInput) -> Decision:
        return Decision(Kind.DIFF, base=DiffBase.PREVIOUS, reason="rows changed since the previous")


@dataclass(frozen=True)
class Forecast:
    """Costs of the next ``horizon`` checkpoints, in units of one full checkpoint."""

    horizon: int
    keep_write: float
    full_write: float
    keep_restore: float
    full_restore: float

    def keep_cost(self, restore_weight: float) -> float:
        return self.keep_write + restore_weight * self.keep_restore

    def full_cost(self, restore_weight: float) -> float:
        return self.full_write + restore_weight * self.full_restore


def forecast(history: tuple[HistoryRecord, ...], upcoming: float | None) -> Forecast:
    """Check-N-Run's forecast, over the next i + 1 checkpoints after i diffs.

    With ``s_j`` the bytes of the j-th diff over the full checkpoint's bytes: keeping on costs at
    least ``(i + 1) s`` (no future diff is smaller than the latest, ``s = s_i``), a full now costs
    ``1 + s_1 + ... + s_i`` (the new chain grows back as the old one did). ``upcoming`` (the size
    the next diff would have, known from the tracker before writing it) replaces ``s_i`` when
    given. A restore of a one-shot chain reads the full plus the latest diff, so restore reads
    are ``(i + 1)(1 + s)`` when keeping on and ``(i + 1) + s_1 + ... + s_i`` after a full.
    """
    full_bytes = max(history[0].bytes, 1)
    sizes = [entry.bytes / full_bytes for entry in history[1:]]
    latest = sizes[-1] if upcoming is None else upcoming
    horizon = len(sizes) + 1
    grown_back = sum(sizes)
    return Forecast(
        horizon=horizon,
        keep_write=horizon * latest,
        full_write=1.0 + grown_back,
        keep_restore=horizon * (1.0 + latest),
        full_restore=horizon + grown_back,
    )


class IntermittentPolicy(Policy):
    """Diffs, plus a new full checkpoint whenever the forecast says it is cheaper.

    ``rule="checknrun"`` is Check-N-Run's rule as published: full when ``F <= I`` with
    ``F = 1 + S_1 + ... + S_i`` and ``I = (i + 1) S_i``. ``rule="cost"`` (the default) improves
    it twice: it forecasts with the size the next diff will actually have (the tracker knows it
    before anything is written) instead of the last one, and it adds ``restore_weight`` times the
    bytes restores would read (a longer-grown diff makes every restore slower; the weight is the
    expected restores per checkpoint times the relative cost of a byte read at restore).

    ``diffs="one_shot"`` writes Check-N-Run's one-shot diffs only. ``diffs="auto"`` (the default
    with ``rule="cost"``; ``checknrun`` takes one-shot diffs only) prices both kinds for the
    next diff, as written bytes plus ``restore_weight`` times the bytes a restore of the
    resulting chain reads: a one-shot diff (every row changed since the full; restores read the
    full and it) or an incremental one (the rows changed since the previous checkpoint; restores
    read the whole chain), and takes the cheaper. Where rows keep changing (early training) a
    one-shot diff soon re-writes most of what earlier ones held, and incremental diffs write a
    fraction of it; the restore term bounds the chain, since a full then becomes the cheaper
    forecast.

    Two bounds keep what a restore reads within reach, whatever the prices: no diff is written
    that would make a restore of the chain read more than the bound (a one-shot diff is tried
    when an incremental one would cross it, then a full).

    * ``max_restore_fp32``: in shares of the model's full fp32 checkpoint, the one ``dcp.load``
      would read instead (the default under ``cost``: :data:`COST_MAX_RESTORE_FP32`, which
      says how it compares with ``dcp.load``'s time).
    * ``max_chain``: in the last full's bytes.

    Given alone, each is the bound. Neither given (the default under ``cost``), a chain may
    read the larger of the two defaults: :data:`COST_MAX_RESTORE_FP32` of the fp32 checkpoint,
    or :data:`COST_MAX_CHAIN` fulls, so that chains of lossless fulls (about the fp32
    checkpoint's size) keep the bound they had. Both given: both hold. ``checknrun``, the rule
    as published, has no bound by default; ``float("inf")`` (YAML ``.inf``) lifts either.

    Under a bound, ``diffs="auto"`` *rebases* an incremental chain on its full (a one-shot diff
    of every row changed since the full, which a restore then reads instead of the links before
    it): at the last moment a one-shot diff fits, when the next incremental one would not, and
    earlier where it frees room for less than a full would cost per unit of room. Where the
    one-shot diff would leave less room per byte than a new full, a full is taken instead.
    ``benchmarks/family.py`` measures the result against the best schedule under the same
    bound, knowing the future (``benchmarks/oracle.py``).
    """

    name = "intermittent"
    default_full_every = 0  # the predictor decides; an explicit full_every caps the chain

    def __init__(
        self,
        full_every: int | None = None,
        rule: str = "cost",
        restore_weight: float = 0.05,
        diffs: str | None = None,
        max_chain: float | None = None,
        max_restore_fp32: float | None = None,
    ) -> None:
        super().__init__(full_every)
        _check_bound("max_chain", max_chain, "above 1 (times a full's bytes)", 1.0)
        _check_bound("max_restore_fp32", max_restore_fp32, "above 0 (of the fp32 full)", 0.0)
        if rule not in ("cost", "checknrun"):
            raise ConfigError(f"intermittent rule {rule!r} is not 'cost' or 'checknrun'")
        if diffs is None:
            diffs = "auto" if rule == "cost" else "one_shot"
        if diffs not in ("one_shot", "auto") or (diffs == "auto" and rule != "cost"):
            raise ConfigError(
                f"intermittent diffs {diffs!r}: 'one_shot', or 'auto' with the 'cost' rule"
            )
        self.rule = rule
        self.restore_weight = restore_weight if rule == "cost" else 0.0
        self.diffs = diffs
        self.mixes_diffs = diffs == "auto"
        # The floor in fulls applies only when neither bound is given (see the docstring).
        defaults = rule == "cost" and max_chain is None and max_restore_fp32 is None
        self.chain_floor = COST_MAX_CHAIN if defaults else 0.0
        if max_restore_fp32 is None:
            max_restore_fp32 = COST_MAX_RESTORE_FP32 if defaults else math.inf
        self.max_chain = math.inf if max_chain is None else float(max_chain)
        self.max_restore_fp32 = float(max_restore_fp32)

    def restore_limit(self, full_bytes: float, fp32_full_bytes: float | None) -> float:
        """The most a restore may read, in fulls of ``full_bytes``; with the fp32 checkpoint's
        size unknown, the default is the floor in fulls alone."""
        limit = math.inf
        if fp32_full_bytes is not None:
            limit = self.max_restore_fp32 * fp32_full_bytes / max(full_bytes, 1)
        if self.chain_floor:
            limit = self.chain_floor if fp32_full_bytes is None else max(limit, self.chain_floor)
        return min(limit, self.max_chain)

    def _limit(self, stats: PolicyInput) -> float:
        return self.restore_limit(stats.history[0].bytes, stats.fp32_full_bytes)

    def _fits(self, chain: float, stats: PolicyInput) -> bool:
        """Whether a restore reading ``chain`` (in fulls) stays within the bounds."""
        return chain <= self._limit(stats)

    def _decide_diff(self, stats: PolicyInput) -> Decision:
        if self.diffs == "auto":
            return self._decide_mixed(stats)
        full_bytes = max(stats.history[0].bytes, 1)
        last = stats.history[-1]
        # Bytes per dirty fraction of the latest diff (the full's before any), times the
        # fraction now dirty: the size the next one-shot diff will have.
        rate = 1.0 if len(stats.history) < 2 else 0.0
        if len(stats.history) >= 2 and last.dirty_fraction > 0:
            rate = last.bytes / full_bytes / last.dirty_fraction
        upcoming = rate * stats.dirty_since_full if rate > 0 else None
        if upcoming is not None and not self._fits(1.0 + upcoming, stats):
            return Decision(
                Kind.FULL, reason=f"restore bound: a diff would read {1.0 + upcoming:.2f} fulls"
            )
        if len(stats.history) < 2:
            return Decision(Kind.DIFF, base=DiffBase.LAST_FULL, reason="first diff after a full")
        if self.rule != "cost":
            upcoming = None
        f = forecast(stats.history, upcoming)
        keep, full = f.keep_cost(self.restore_weight), f.full_cost(self.restore_weight)
        detail = f"keep {keep:.3f} vs full {full:.3f} over {f.horizon} checkpoints"
        if full <= keep:
            return Decision(Kind.FULL, reason=f"predictor: full is cheaper ({detail})")
        return Decision(Kind.DIFF, base=DiffBase.LAST_FULL, reason=f"predictor: diff ({detail})")

    def _decide_mixed(self, stats: PolicyInput) -> Decision:
        """Full, one-shot or incremental: each priced in units of the full checkpoint."""
        w = self.restore_weight
        full_bytes = max(stats.history[0].bytes, 1)
        diffs = stats.history[1:]
        # Bytes per dirty fraction: the latest diff's, or the full's before any diff.
        rate = 1.0
        if diffs and diffs[-1].dirty_fraction > 0:
            rate = diffs[-1].bytes / full_bytes / diffs[-1].dirty_fraction
        known = stats.chain_bytes
        chain = (known if known is not None else assumed_chain_bytes(stats.history)) / full_bytes
        one_shot = rate * stats.dirty_since_full
        incremental = rate * stats.dirty_since_last
        cost_one_shot = one_shot + w * (1.0 + one_shot)
        cost_incremental = incremental + w * (chain + incremental)
        priced = {DiffBase.LAST_FULL: cost_one_shot, DiffBase.PREVIOUS: cost_incremental}
        reads = {DiffBase.LAST_FULL: 1.0 + one_shot, DiffBase.PREVIOUS: chain + incremental}
        bases = (DiffBase.LAST_FULL, DiffBase.PREVIOUS)
        allowed = [b for b in bases if self._fits(reads[b], stats)]
        if not allowed:
            least = min(reads.values())
            return Decision(Kind.FULL, reason=f"restore bound: a diff would read {least:.2f} fulls")
        base = min(allowed, key=lambda b: priced[b])
        room = self._limit(stats) - 1.0  # what diffs may add to the full, in fulls
        if base is DiffBase.PREVIOUS and DiffBase.LAST_FULL in allowed and math.isfinite(room):
            if not self._fits(chain + 2.0 * incremental, stats):
                # The last moment a one-shot diff fits, if the next incremental one would not:
                # rebase the chain on its full, unless a full now buys room for less.
                if one_shot >= room / (1.0 + room):
                    return Decision(
                        Kind.FULL,
                        reason=f"rebase: a one-shot diff of {one_shot:.2f} fulls "
                        f"leaves less room per byte than a full ({room:.2f} fulls of diffs)",
                    )
                base = DiffBase.LAST_FULL
            elif (one_shot - incremental) * (1.0 + room) < chain - 1.0 - one_shot:
                base = DiffBase.LAST_FULL  # room freed for less than a full would cost
        upcoming = min(priced[b] for b in allowed)  # a rebase is paid once, not per interval
        # Check-N-Run's forecast over the next i + 1 checkpoints: keeping on costs at least the
        # next diff's price each time; a full now costs itself, then the diffs so far again
        # (priced as written, plus a restore reading the full and each).
        horizon = len(diffs) + 1
        keep = horizon * upcoming
        full = 1.0 + w + sum(d.bytes / full_bytes * (1.0 + w) + w for d in diffs)
        detail = f"keep {keep:.3f} vs full {full:.3f} over {horizon} checkpoints"
        if diffs and full <= keep:
            return Decision(Kind.FULL, reason=f"predictor: full is cheaper ({detail})")
        kind = "one-shot" if base is DiffBase.LAST_FULL else "incremental"
        return Decision(Kind.DIFF, base=base, reason=f"predictor: {kind} diff ({detail})")


def _check_bound(name: str, value: object, what: str, above: float) -> None:
    """A bound option is None or a number above ``above``."""
    if value is None:
        return
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > above):
        raise ConfigError(f"intermittent {name} must be a number {what}, got {value!r}")


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (FullPolicy, OneShotPolicy, IncrementalPolicy, IntermittentPolicy)
}


def make_policy(config: PolicySettings) -> Policy:
    """The policy ``config.policy`` names, with ``config.full_every`` and
    ``config.policy_options``; policies registered in :data:`POLICIES` after import count.

    Raises:
        ConfigError: no such policy, or options it does not take.
    """
    cls = POLICIES.get(config.policy)
    if cls is None:
        raise ConfigError(f"unknown policy {config.policy!r}; known: {sorted(POLICIES)}")
    try:
        return cls(full_every=config.full_every, **dict(config.policy_options))
    except TypeError as exc:
        raise ConfigError(f"policy {config.policy}: bad policy_options: {exc}") from None


BIT_TIERS = ((1, 2), (3, 3), (20, 4))


def bits_for_restores(expected_restores: int, restores_done: int = 0) -> int:
    """Check-N-Run's bit width for a number of restores: 2 bits for 1, 3 for up to 3, 4 for up
    to 20, 8 beyond. Once more restores happened than planned, the plan is the restores done
    plus one more, so codes widen as failures accumulate."""
    planned = max(expected_restores, restores_done + 1)
    return next((bits for limit, bits in BIT_TIERS if planned <= limit), 8)
