"""Seeded fault schedules on 2 gloo ranks (``fault_schedules.py``): no restore ever returns values
off what the writer meant its step to hold, whatever failed before it, and the ranks always
agree. A bounded set here; ``benchmarks/faults.py`` runs hundreds."""

from __future__ import annotations

import tempfile

import pytest
from fault_schedules import (
    CODECS,
    POLICIES,
    Schedule,
    disagreements,
    make_schedule,
    run_schedules,
)

from embckpt.examples.launcher import run_ranks

pytestmark = pytest.mark.slow(95)  # seconds here, on 2 cores: see conftest.py


def _covering(count: int) -> list[Schedule]:
    """The first seeds whose schedules together draw every codec and every policy, then more
    up to ``count``."""
    schedules: list[Schedule] = []
    codecs, policies = {c for c, _ in CODECS}, {p for p, _ in POLICIES}
    seed = 0
    while codecs or policies or len(schedules) < count:
        schedule = make_schedule(seed)
        seed += 1
        if schedule.codec in codecs or schedule.policy in policies or not (codecs or policies):
            schedules.append(schedule)
            codecs.discard(schedule.codec)
            policies.discard(schedule.policy)
    return schedules


def _run(schedules: list[Schedule]) -> list[str]:
    with tempfile.TemporaryDirectory() as root:
        per_rank = run_ranks(run_schedules, 2, root, schedules, timeout_s=300)
    problems = disagreements(per_rank)
    for outcomes in per_rank:
        for o in outcomes:
            problems.extend(f"seed {o.seed} ({o.codec_policy}): {p}" for p in o.silent)
    return problems, per_rank


@pytest.mark.timeout(300)
def test_fault_schedules_never_restore_a_lie() -> None:
    schedules = _covering(16)
    problems, per_rank = _run(schedules)
    assert problems == []
    ours = per_rank[0]
    # The schedules did what they are for: faults fired, saves failed and committed, and
    # restores after failures were checked.
    assert sum(o.faults for outcomes in per_rank for o in outcomes) >= len(schedules)
    assert sum(o.saves_failed for o in ours) >= 5
    assert sum(o.saves_committed for o in ours) >= 3 * len(schedules)
    assert sum(o.restores_checked for o in ours) >= 2 * len(schedules)


@pytest.mark.timeout(300)
def test_every_codec_under_every_policy_restores_what_the_writer_meant() -> None:
    schedules = [
        make_schedule(i, codec=codec, policy=policy, faults=False)
        for i, (codec, policy) in enumerate(
            (codec, policy) for codec, _ in CODECS for policy, _ in POLICIES
        )
    ]
    problems, per_rank = _run(schedules)
    assert problems == []
    assert all(o.restores_checked >= 2 and o.saves_failed == 0 for o in per_rank[0])


@pytest.mark.timeout(300)
def test_fault_schedules_through_the_writer_process() -> None:
    """Copy-on-write saves written by each rank's writer process, under the same faults plus
    the process's death mid-save: no restore lies, the ranks agree, training goes on."""
    schedules = [make_schedule(1001, writer="process")]  # raw, one-shot, 3 exits, 3 reshards
    exits = [op[1] for s in schedules for op in s.ops if op[0] == "save" and op[1]]
    assert sum(1 for fault in exits if fault.kind == "exit") >= 3
    problems, per_rank = _run(schedules)
    assert problems == []
    ours = per_rank[0]
    assert sum(o.saves_failed for o in ours) >= 3
    assert sum(o.saves_committed for o in ours) >= 3 * len(schedules)
    assert sum(o.restores_checked for o in ours) >= 2 * len(schedules)
