"""The intermittent predictor on hand-made histories, bits from expected restores, retention
that never deletes what a kept checkpoint needs, and merged checkpoints that restore exactly."""

from __future__ import annotations

import math
import random
import tempfile

import pytest
import toy_model as tm

from embckpt.config import CheckpointConfig
from embckpt.errors import ConfigError
from embckpt.examples.launcher import run_ranks
from embckpt.policy import (
    COST_MAX_RESTORE_FP32,
    DiffBase,
    IntermittentPolicy,
    Kind,
    PolicyInput,
    bits_for_restores,
    make_policy,
)
from embckpt.storage.chain import needed_steps
from embckpt.storage.manifest import HistoryEntry, Manifest


def _history(diff_sizes: list[float], dirty: list[float] | None = None):
    full = HistoryEntry(step=0, kind="full", bytes=1000, dirty_fraction=1.0)
    dirty = dirty or diff_sizes
    diffs = [
        HistoryEntry(step=10 * (i + 1), kind="diff", bytes=int(1000 * s), dirty_fraction=d)
        for i, (s, d) in enumerate(zip(diff_sizes, dirty, strict=True))
    ]
    return (full, *diffs)


def _decide(policy, sizes: list[float], dirty_now: float) -> Kind:
    stats = PolicyInput(
        step=99, dirty_since_last=0.1, dirty_since_full=dirty_now, history=_history(sizes)
    )
    return policy.decide(stats).kind


def test_checknrun_rule_takes_a_full_when_f_le_i() -> None:
    rule = IntermittentPolicy(rule="checknrun")
    # i=3, S=(.1,.2,.3): F = 1.6 > I = 4 * .3 = 1.2: keep diffing.
    assert _decide(rule, [0.1, 0.2, 0.3], dirty_now=0.9) is Kind.DIFF
    # i=4, S=(.1,.2,.3,.4): F = 2.0 <= I = 5 * .4 = 2.0: a full is cheaper.
    assert _decide(rule, [0.1, 0.2, 0.3, 0.4], dirty_now=0.9) is Kind.FULL
    # The published rule ignores what the tracker already knows about the next diff.
    assert _decide(rule, [0.1, 0.2, 0.3], dirty_now=0.95) is Kind.DIFF


def test_cost_rule_looks_ahead_and_weighs_restores() -> None:
    # The prices alone: no bound on what a restore reads (test_max_chain_bounds_...).
    unbounded = {"max_chain": math.inf, "diffs": "one_shot"}
    writes_only = IntermittentPolicy(rule="cost", restore_weight=0.0, **unbounded)
    # The tracker says the next diff will be 0.45 of the model: I = 4 * .45 = 1.8 > F = 1.6.
    assert _decide(writes_only, [0.1, 0.2, 0.3], dirty_now=0.45) is Kind.FULL
    # A next diff of .35 keeps the chain going (I = 1.4 < 1.6) ...
    assert _decide(writes_only, [0.1, 0.2, 0.3], dirty_now=0.35) is Kind.DIFF
    # ... unless restores matter: keep reads 4 * 1.35 = 5.4, full 4 + .6 = 4.6 per restore.
    restores_matter = IntermittentPolicy(rule="cost", restore_weight=0.5, **unbounded)
    assert _decide(restores_matter, [0.1, 0.2, 0.3], dirty_now=0.35) is Kind.FULL


def test_intermittent_starts_with_a_full_then_a_diff() -> None:
    policy = IntermittentPolicy()
    assert policy.decide(PolicyInput(1, 1.0, 1.0, ())).kind is Kind.FULL
    assert _decide(policy, [], dirty_now=0.2) is Kind.DIFF


def test_auto_diffs_go_incremental_while_one_shot_diffs_regrow_then_a_full() -> None:
    # The prices alone: no bound on what a restore reads (test_max_chain_bounds_...).
    auto = IntermittentPolicy(restore_weight=0.05, diffs="auto", max_chain=math.inf)
    assert auto.mixes_diffs and not IntermittentPolicy(diffs="one_shot").mixes_diffs

    def decide(n_diffs: int, since_full: float, chain: float):
        # Incremental diffs of 0.05 each (0.05 of the rows), one-shot ones would hold since_full.
        history = _history([0.05] * n_diffs)
        stats = PolicyInput(99, 0.05, since_full, history, int(1000 * chain))
        return auto.decide(stats)

    # Early in a chain: the rows changed since the full are 4x those since the last: incremental.
    early = decide(3, since_full=0.2, chain=1.15)
    assert (early.kind, early.base) == (Kind.DIFF, DiffBase.PREVIOUS)
    # Little changed beyond the last interval's rows: the one-shot diff costs no more to write
    # and restores from the full alone.
    settled = decide(3, since_full=0.05, chain=1.15)
    assert (settled.kind, settled.base) == (Kind.DIFF, DiffBase.LAST_FULL)
    # A long chain: restores would read it all; the forecast takes a full.
    assert decide(30, since_full=0.6, chain=2.5).kind is Kind.FULL
    # With restores weightless, keep-on writes less than a full for as long as in the replay.
    writes_only = IntermittentPolicy(restore_weight=0.0, diffs="auto", max_chain=math.inf)
    stats = PolicyInput(99, 0.05, 0.6, _history([0.05] * 30), 2500)
    assert writes_only.decide(stats).kind is Kind.DIFF


def test_max_chain_bounds_what_a_restore_reads_whatever_the_prices() -> None:
    """Under the cost rule, with the fp32 checkpoint's size unknown, no diff makes a restore
    read more than 1.2 fulls by default: an incremental diff that would cross it gives way to
    a one-shot one that fits, then to a full; Check-N-Run's published rule has no bound."""
    policy = IntermittentPolicy(restore_weight=0.0)
    assert policy.chain_floor == 1.2 and policy.max_chain == math.inf
    published = IntermittentPolicy(rule="checknrun")
    assert published.max_chain == published.max_restore_fp32 == math.inf

    def decide(policy: IntermittentPolicy, since_full: float, chain: float):
        # Three incremental diffs of 0.05 (of the rows, and of the full's bytes) so far.
        stats = PolicyInput(99, 0.05, since_full, _history([0.05] * 3), int(1000 * chain))
        return policy.decide(stats)

    # The chain reads 1.05 fulls: another incremental diff (1.10) fits, and so would the next.
    assert decide(policy, 0.15, chain=1.05).base is DiffBase.PREVIOUS
    # At 1.15 one more (1.20) still fits, but the next would not: the last moment a one-shot
    # diff (1 + 0.15) fits, and it reads less, so the chain rebases on the full ...
    rebase = decide(policy, 0.15, chain=1.15)
    assert (rebase.kind, rebase.base) == (Kind.DIFF, DiffBase.LAST_FULL)
    # ... but a one-shot diff that would leave less room per byte than a full (0.19 of the
    # 0.2 fulls diffs may add: more than 0.2 / 1.2) gives way to a full at once ...
    full_now = decide(policy, 0.19, chain=1.13)
    assert full_now.kind is Kind.FULL and "rebase" in full_now.reason
    # ... and a one-shot diff that frees room for less than a full would cost is taken early:
    # with 0.08 fulls of diffs in the chain, one of 0.08 frees nothing; one of 0.06 writes
    # 0.01 more than the incremental diff (times 1 + 0.2: a full's price per unit of room) to
    # free 0.02.
    assert decide(policy, 0.08, chain=1.08).base is DiffBase.PREVIOUS
    assert decide(policy, 0.06, chain=1.08).base is DiffBase.LAST_FULL
    # ... at 1.18 it would not (1.23): a one-shot diff of the rows changed since the full
    # (1 + 0.15) is written instead, though it writes more ...
    bounded = decide(policy, 0.15, chain=1.18)
    assert (bounded.kind, bounded.base) == (Kind.DIFF, DiffBase.LAST_FULL)
    assert decide(IntermittentPolicy(restore_weight=0.0, max_chain=2.0), 0.15, 1.18).base is (
        DiffBase.PREVIOUS
    )
    # ... and when the one-shot diff would not fit either (1 + 0.25), a full.
    full = decide(policy, 0.25, chain=1.18)
    assert full.kind is Kind.FULL and "restore bound" in full.reason
    # One-shot diffs only: the bound applies to the full plus the next diff.
    one_shot = IntermittentPolicy(restore_weight=0.0, diffs="one_shot")
    assert _decide(one_shot, [0.05, 0.1], dirty_now=0.15) is Kind.DIFF
    assert _decide(one_shot, [0.05, 0.1], dirty_now=0.3) is Kind.FULL
    with pytest.raises(ConfigError, match="max_chain must be a number above 1"):
        IntermittentPolicy(max_chain=0.5)


def test_intermittent_diffs_default_to_auto_under_the_cost_rule_only() -> None:
    """Both kinds priced by default (issue 22: one-shot diffs only cannot beat the one-shot
    oracle); Check-N-Run's published rule keeps its one-shot diffs."""
    assert IntermittentPolicy().diffs == "auto" and IntermittentPolicy().mixes_diffs
    checknrun = make_policy(
        CheckpointConfig(policy="intermittent", policy_options={"rule": "checknrun"})
    )
    assert checknrun.diffs == "one_shot" and not checknrun.mixes_diffs
    explicit = make_policy(
        CheckpointConfig(policy="intermittent", policy_options={"diffs": "one_shot"})
    )
    assert explicit.diffs == "one_shot"


def test_policy_options_are_checked() -> None:
    config = CheckpointConfig(policy="intermittent", policy_options={"rule": "checknrun"})
    assert make_policy(config).rule == "checknrun"
    with pytest.raises(ConfigError, match="bad policy_options"):
        make_policy(CheckpointConfig(policy="one_shot", policy_options={"rule": "cost"}))
    with pytest.raises(ConfigError, match="rule"):
        make_policy(CheckpointConfig(policy="intermittent", policy_options={"rule": "magic"}))
    with pytest.raises(ConfigError, match="diffs"):
        make_policy(
            CheckpointConfig(
                policy="intermittent", policy_options={"rule": "checknrun", "diffs": "auto"}
            )
        )


@pytest.mark.parametrize(
    ("expected", "done", "bits"),
    [(1, 0, 2), (3, 0, 3), (3, 2, 3), (20, 0, 4), (21, 0, 8), (1, 1, 3), (3, 3, 4), (20, 20, 8)],
)
def test_bits_follow_expected_restores_and_widen_after_more_failures(expected, done, bits) -> None:
    assert bits_for_restores(expected, done) == bits


def _manifest(step: int, parent: int | None, base: int) -> Manifest:
    return Manifest(
        step=step,
        kind="full" if parent is None else "diff",
        policy="x",
        base_step=base,
        parent_step=parent,
        world_size=1,
        codec={},
        tables=(),
        files=(),
    )


def test_retention_keeps_every_link_a_kept_checkpoint_needs() -> None:
    rng = random.Random(0)
    for _ in range(200):
        manifests: dict[int, Manifest] = {}
        base, previous = None, None
        for step in range(1, rng.randint(2, 30)):
            kind = rng.choice(["full", "one_shot", "incremental"]) if base else "full"
            if kind == "full":
                manifests[step] = _manifest(step, None, step)
                base = step
            else:
                parent = base if kind == "one_shot" else previous
                manifests[step] = _manifest(step, parent, base)
            previous = step
        keep_last = rng.randint(1, 4)
        kept = needed_steps(manifests, sorted(manifests)[-keep_last:])
        for step in kept:
            parent = manifests[step].parent_step
            assert parent is None or parent in kept


def _retention_and_merge(rank: int, world_size: int, root: str) -> dict:
    from embckpt import Checkpointer
    from embckpt.read.merge import merge
    from embckpt.storage.verify import verify

    out: dict = {}
    # Retention: one-shot chains with a full every 3, keep the last 2 checkpoints.
    config = CheckpointConfig(policy="one_shot", full_every=3, keep_last=2)
    model, opt = tm.build(world_size, seed=0)
    with Checkpointer(model, f"{root}/kept", optimizer=opt, config=config) as ckpt:
        for step in range(1, 15):
            tm.train_step(model, opt, step, rank, hot=100)
            if step % 2 == 0:
                ckpt.save(step).wait()
        expected = tm.snapshot_state(model, opt, rank)
        out["committed"] = ckpt.store.committed_steps()
        out["verify_ok"] = verify(ckpt.store).ok
    fresh, fresh_opt = tm.build(world_size, seed=1)
    with Checkpointer(fresh, f"{root}/kept", optimizer=fresh_opt, config=config) as ckpt:
        out["restored"] = ckpt.restore()
    out["kept_diff"] = tm.differences(expected, tm.snapshot_state(fresh, fresh_opt, rank))

    # Merge: an incremental chain folded into one full checkpoint restores the same state.
    config = CheckpointConfig(policy="incremental", full_every=0)
    with Checkpointer(model, f"{root}/chain", optimizer=opt, config=config) as ckpt:
        for step in range(15, 21):
            tm.train_step(model, opt, step, rank, hot=100)
            ckpt.save(step).wait()
    chain_state = tm.snapshot_state(model, opt, rank)
    import torch.distributed as dist

    if rank == 0:
        merged = merge(ckpt.store, 19)
        out["merged_kind"] = merged.kind
        out["merged_from"] = merged.stats["merged_from"]
    dist.barrier()
    fresh, fresh_opt = tm.build(world_size, seed=2)
    with Checkpointer(fresh, f"{root}/chain", optimizer=fresh_opt, config=config) as ckpt:
        out["after_merge"] = ckpt.restore(19)
        at_19 = tm.snapshot_state(fresh, fresh_opt, rank)
        out["latest"] = ckpt.restore()  # step 20's chain now ends at the merged step 19
    out["merge_vs_20"] = tm.differences(chain_state, tm.snapshot_state(fresh, fresh_opt, rank))
    out["merged_verify_ok"] = verify(ckpt.store).ok
    out["n_diff_19_vs_20"] = len(tm.differences(at_19, chain_state))
    return out


def test_retention_and_merge_on_two_ranks() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_retention_and_merge, 2, root)
    for rank, out in enumerate(results):
        where = f"rank {rank}"
        # Checkpoints 2..14; fulls at 2, 8, 14; keep the last 2 (12, 14) and their chain (8).
        assert out["committed"] == [8, 12, 14], where
        assert out["verify_ok"] and out["restored"] == 14 and out["kept_diff"] == [], where
        assert out["after_merge"] == 19 and out["latest"] == 20, where
        assert out["merge_vs_20"] == [] and out["merged_verify_ok"], where
        assert out["n_diff_19_vs_20"] > 0, where  # 19 and 20 differ: the check can fail
    assert results[0]["merged_kind"] == "full" and results[0]["merged_from"] == [15, 16, 17, 18, 19]


def test_restore_bound_is_a_share_of_the_fp32_checkpoint() -> None:
    """By default a chain may read COST_MAX_RESTORE_FP32 of the fp32 checkpoint, or 1.2 fulls
    where that is more (lossless fulls); a bound given alone is the bound, both given both
    hold."""
    fp32 = int(1000 / 0.18)  # a full of 1000 bytes is 0.18 of the fp32 checkpoint
    limit = COST_MAX_RESTORE_FP32 * fp32 / 1000  # in fulls

    def decide(policy: IntermittentPolicy, chain: float, fp32_bytes: int | None = fp32):
        stats = PolicyInput(99, 0.01, 0.9, _history([0.01] * 3), int(1000 * chain), fp32_bytes)
        return policy.decide(stats)

    default = IntermittentPolicy(restore_weight=0.0)
    assert limit > 1.3
    assert decide(default, chain=limit - 0.02).base is DiffBase.PREVIOUS
    assert decide(default, chain=limit + 0.01).kind is Kind.FULL
    # Without the fp32 size: the floor of 1.2 fulls.
    assert decide(default, chain=1.25, fp32_bytes=None).kind is Kind.FULL
    # Lossless fulls (the fp32 checkpoint's size): the floor rules.
    assert decide(default, chain=1.15, fp32_bytes=1000).base is DiffBase.PREVIOUS
    assert decide(default, chain=1.25, fp32_bytes=1000).kind is Kind.FULL
    # max_chain given alone: the old meaning, no fp32 bound.
    chain_only = IntermittentPolicy(restore_weight=0.0, max_chain=1.5)
    assert decide(chain_only, chain=1.45).base is DiffBase.PREVIOUS
    assert decide(chain_only, chain=1.55).kind is Kind.FULL
    # max_restore_fp32 given alone: no floor, so lossless fulls get no diff.
    fp32_only = IntermittentPolicy(restore_weight=0.0, max_restore_fp32=0.5)
    assert decide(fp32_only, chain=2.7).base is DiffBase.PREVIOUS  # 2.71 = 0.5 / 0.18 + 0.01
    assert decide(fp32_only, chain=1.05, fp32_bytes=1000).kind is Kind.FULL
    both = IntermittentPolicy(restore_weight=0.0, max_restore_fp32=0.5, max_chain=2.0)
    assert decide(both, chain=2.05).kind is Kind.FULL
    with pytest.raises(ConfigError, match="max_restore_fp32 must be a number above 0"):
        IntermittentPolicy(max_restore_fp32=0)
