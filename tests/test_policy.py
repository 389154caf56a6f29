"""Policies are pure: the same inputs give the same decision."""

from __future__ import annotations

import pytest

from embckpt.config import CheckpointConfig
from embckpt.errors import ConfigError, UnknownCodecError
from embckpt.policy import DiffBase, Kind, PolicyInput, make_policy
from embckpt.storage.manifest import HistoryEntry


def _history(n: int) -> tuple[HistoryEntry, ...]:
    """A full checkpoint and n - 1 diffs after it (nothing when n is 0)."""
    if n == 0:
        return ()
    full = HistoryEntry(step=10, kind="full", bytes=1000, dirty_fraction=1.0)
    diffs = tuple(HistoryEntry(10 + 10 * i, "diff", 100 * i, 0.1 * i) for i in range(1, n))
    return (full, *diffs)


def _decide(policy: str, full_every: int, history_len: int):
    config = CheckpointConfig(policy=policy, full_every=full_every)
    return make_policy(config).decide(PolicyInput(100, 0.2, 0.4, _history(history_len)))


@pytest.mark.parametrize("policy", ["full", "one_shot", "incremental"])
def test_first_checkpoint_is_full(policy: str) -> None:
    assert _decide(policy, 0, 0).kind is Kind.FULL


def test_one_shot_diffs_against_the_full_and_incremental_against_the_last() -> None:
    assert _decide("one_shot", 0, 3).kind is Kind.DIFF
    assert _decide("one_shot", 0, 3).base is DiffBase.LAST_FULL
    assert _decide("one_shot", 0, 3).one_shot
    assert _decide("incremental", 0, 3).base is DiffBase.PREVIOUS
    assert not _decide("incremental", 0, 3).one_shot
    assert _decide("full", 0, 3).kind is Kind.FULL


def test_kinds_are_the_manifest_kinds() -> None:
    """A policy decides a full or a diff: the two ``kind`` values a manifest holds."""
    assert [k.value for k in Kind] == ["full", "diff"]


@pytest.mark.parametrize("policy", ["one_shot", "incremental"])
def test_full_every_k(policy: str) -> None:
    # After a full checkpoint, K-1 diffs, then a full one again.
    kinds = [_decide(policy, 3, n).kind for n in (1, 2, 3)]
    assert kinds == [Kind.DIFF, Kind.DIFF, Kind.FULL]


def _kinds(config: CheckpointConfig, chain_lengths: range) -> list[Kind]:
    """The decisions of ``config``'s policy after a full and ``n - 1`` small diffs, for each
    ``n``: diffs so small that the intermittent predictor never wants a full."""
    policy = make_policy(config)
    history = (HistoryEntry(step=0, kind="full", bytes=10**6, dirty_fraction=1.0),)
    kinds = []
    for n in chain_lengths:
        diffs = tuple(HistoryEntry(10 * i, "diff", 100, 0.0001) for i in range(1, n))
        kinds.append(policy.decide(PolicyInput(100, 0.0001, 0.0001, history + diffs)).kind)
    return kinds


def test_the_intermittent_predictor_decides_by_default() -> None:
    """``full_every`` left unset forces no full under ``intermittent`` (before issue 22 it was
    4, so every 4th checkpoint was full whatever the predictor said); one-shot and incremental
    policies keep their 4."""
    config = CheckpointConfig(policy="intermittent")
    assert config.full_every is None and make_policy(config).full_every == 0
    assert _kinds(config, range(1, 30)) == [Kind.DIFF] * 29
    for policy in ("one_shot", "incremental"):
        assert make_policy(CheckpointConfig(policy=policy)).full_every == 4
        assert _kinds(CheckpointConfig(policy=policy), range(1, 6)) == [
            Kind.DIFF,
            Kind.DIFF,
            Kind.DIFF,
            Kind.FULL,
            Kind.FULL,
        ]


def test_an_explicit_full_every_caps_the_intermittent_chain() -> None:
    config = CheckpointConfig(policy="intermittent", full_every=6)
    assert _kinds(config, range(1, 8)) == [Kind.DIFF] * 5 + [Kind.FULL] * 2
    # 0 is off for every policy.
    assert _kinds(CheckpointConfig(policy="one_shot", full_every=0), range(1, 9)) == [Kind.DIFF] * 8


def test_full_every_none_and_negative_values() -> None:
    with pytest.raises(ConfigError, match="full_every must be >= 0"):
        CheckpointConfig(full_every=-1)
    with pytest.raises(ConfigError, match="full_every: expected an integer"):
        CheckpointConfig(full_every="4")  # type: ignore[arg-type]


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ConfigError, match="policy 'nope'"):
        CheckpointConfig(policy="nope")


def test_a_newly_registered_policy_is_accepted_by_the_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from embckpt.policy import POLICIES, Decision, Policy, PolicyInput

    class AlwaysFull(Policy):
        name = "always_full"

        def _decide_diff(self, stats: PolicyInput) -> Decision:
            return Decision(Kind.FULL, reason="always")

    monkeypatch.setitem(POLICIES, AlwaysFull.name, AlwaysFull)
    config = CheckpointConfig(policy="always_full", full_every=0)
    decision = make_policy(config).decide(PolicyInput(100, 0.2, 0.4, _history(3)))
    assert decision.kind is Kind.FULL and decision.reason == "always"


def test_codec_names_and_widths_are_checked_by_the_codec_registry() -> None:
    with pytest.raises(ConfigError, match="bits must be one of"):
        CheckpointConfig(codec="asymmetric", bits=5)
    with pytest.raises(ConfigError, match="entropy must be one of"):
        CheckpointConfig(codec="asymmetric", entropy="gzip")
    with pytest.raises(UnknownCodecError):
        CheckpointConfig(optimizer_codec="nope")
