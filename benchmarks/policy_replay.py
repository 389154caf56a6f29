"""Replays the intermittent predictors on the diff sizes ``benchmarks/policies.py`` measured.

Takes the one-shot run of ``benchmarks/results/policies.json`` as the growth curve of a chain
(the size of the k-th diff after a full) and lets each rule decide over 120 intervals, assuming
every new chain regrows the same way. Compares Check-N-Run's published rule with the look-ahead
cost rule at several restore weights: bytes written per interval, fulls taken, and the bytes a
restore would read (full + latest diff), and the best schedule knowing the future under the same
growth curve (benchmarks/oracle.py). Writes ``benchmarks/results/policy_replay.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from common import RESULTS, write_result  # noqa: E402
from oracle import best_schedule  # noqa: E402

from embckpt.policy import IntermittentPolicy, Kind, Policy, PolicyInput  # noqa: E402
from embckpt.storage.manifest import HistoryEntry  # noqa: E402


def replay(
    policy: Policy, full_bytes: int, diffs: list[int], dirty: list[float], intervals: int
) -> dict[str, float]:
    history: list[HistoryEntry] = []
    written = reads = fulls = 0
    for t in range(intervals):
        i = min(len(history) - 1, len(diffs) - 1)
        kind = Kind.FULL
        if history:
            stats = PolicyInput(t, dirty[0], dirty[i], tuple(history))
            kind = policy.decide(stats).kind
        if kind is Kind.FULL:
            history = [HistoryEntry(t, "full", full_bytes, 1.0)]
            written, reads, fulls = written + full_bytes, reads + full_bytes, fulls + 1
        else:
            history.append(HistoryEntry(t, "diff", diffs[i], dirty[i]))
            written, reads = written + diffs[i], reads + full_bytes + diffs[i]
    return {
        "mb_written_per_interval": written / intervals / 1e6,
        "fulls": fulls,
        "mb_restore_read_per_interval": reads / intervals / 1e6,
    }


def replay_oracle(full_bytes: int, diffs: list[int], intervals: int) -> dict[str, float]:
    """The best full / one-shot-diff schedule when the k-th diff after any full has the size of
    the measured k-th (the last measured one beyond), as :func:`replay` assumes."""
    after = np.arange(intervals)[None, :] - np.arange(intervals)[:, None]  # [f, t]: t - f
    costs = np.asarray(diffs, dtype=np.float64)[(after - 1).clip(0, len(diffs) - 1)]
    written, kinds = best_schedule(full_bytes, costs)
    fulls = kinds.count("full")
    reads = written + (intervals - fulls) * full_bytes  # every diff's restore also reads its full
    return {
        "mb_written_per_interval": written / intervals / 1e6,
        "fulls": fulls,
        "mb_restore_read_per_interval": reads / intervals / 1e6,
    }


def main() -> None:
    measured = json.loads((RESULTS / "policies.json").read_text())
    one_shot = measured["runs"]["one_shot"]
    full_bytes = one_shot[0]["bytes"]
    diffs = [r["bytes"] for r in one_shot[1:]]
    dirty = [r["written_fraction"] for r in one_shot[1:]]
    fp32 = measured["summary"]["full_fp32_bytes"]
    rules = {
        "checknrun": IntermittentPolicy(rule="checknrun"),
        "cost, restore_weight 0": IntermittentPolicy(rule="cost", restore_weight=0.0),
        "cost, restore_weight 0.05 (default)": IntermittentPolicy(rule="cost"),
        "cost, restore_weight 0.5": IntermittentPolicy(rule="cost", restore_weight=0.5),
    }
    results = {name: replay(rule, full_bytes, diffs, dirty, 120) for name, rule in rules.items()}
    results["oracle (knows the future)"] = replay_oracle(full_bytes, diffs, 120)
    for name, r in results.items():
        r["write_reduction_x"] = fp32 / 1e6 / r["mb_written_per_interval"]
        print(
            f"{name:>36}: {r['mb_written_per_interval']:.2f} MB/interval "
            f"({r['write_reduction_x']:.1f}x below fp32), {r['fulls']} fulls, "
            f"restore reads {r['mb_restore_read_per_interval']:.1f} MB"
        )
    write_result("policy_replay", {"intervals": 120, "rules": results})


if __name__ == "__main__":
    main()
