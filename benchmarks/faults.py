"""Fault schedules at scale: many seeded schedules of train / save / fault / restore /
reshard-restore / merge / retention steps on 2 gloo ranks, every restore checked against what
the writer meant its step to hold (``tests/fault_schedules.py`` says what is checked).

Writes ``benchmarks/results/faults.json``: ``summary`` (``schedules``, ``faults_injected``,
``saves_failed``, ``saves_committed``, ``restores_checked``, ``silent_errors``, ``hangs``), the
machine, the schedules by codec and policy, and every problem with the seed that reproduces it
(``python benchmarks/faults.py --seeds N``).

Schedules run in batches, each batch in a fresh pair of processes with a time limit: a batch
that does not finish in time counts one hang per schedule it did not finish.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))  # the schedules and faultfs

from common import machine  # noqa: E402
from fault_schedules import disagreements, make_schedule, run_schedules  # noqa: E402

from embckpt.examples.launcher import RankFailed, run_ranks  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "faults.json"


def run(seeds: list[int], batch: int, batch_timeout_s: float) -> dict:
    totals = Counter()
    problems: list[str] = []
    hangs = 0
    started = time.perf_counter()
    for first in range(0, len(seeds), batch):
        chunk = seeds[first : first + batch]
        with tempfile.TemporaryDirectory() as root:
            try:
                schedules = [make_schedule(seed) for seed in chunk]
                per_rank = run_ranks(run_schedules, 2, root, schedules, timeout_s=batch_timeout_s)
            except RankFailed as exc:
                hung = "timed out" in str(exc)
                hangs += len(chunk) if hung else 0
                problems.append(f"seeds {chunk}: {'hang' if hung else 'rank failed'}: {exc}")
                continue
        problems.extend(disagreements(per_rank))
        for outcomes in per_rank:
            for o in outcomes:
                totals["faults_injected"] += o.faults
                problems.extend(f"seed {o.seed} ({o.codec_policy}): {p}" for p in o.silent)
        for o in per_rank[0]:  # saves and restores are collective: count them once
            schedule = make_schedule(o.seed)
            totals["schedules"] += 1
            totals["saves_failed"] += o.saves_failed
            totals["saves_committed"] += o.saves_committed
            totals["restores_checked"] += o.restores_checked
            totals[f"codec:{schedule.codec}"] += 1
            totals[f"policy:{schedule.policy}"] += 1
        print(
            f"{first + len(chunk)}/{len(seeds)} schedules, {time.perf_counter() - started:.0f} s,"
            f" {len(problems)} problems",
            flush=True,
        )
    silent = sum(1 for p in problems if "hang" not in p)
    return {
        "summary": {
            "schedules": totals["schedules"],
            "faults_injected": totals["faults_injected"],
            "saves_failed": totals["saves_failed"],
            "saves_committed": totals["saves_committed"],
            "restores_checked": totals["restores_checked"],
            "silent_errors": silent,
            "hangs": hangs,
        },
        "by_codec": {k[6:]: v for k, v in sorted(totals.items()) if k.startswith("codec:")},
        "by_policy": {k[7:]: v for k, v in sorted(totals.items()) if k.startswith("policy:")},
        "problems": problems,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=240)
    parser.add_argument("--first-seed", type=int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="*", help="run exactly these seeds")
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--batch-timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    seeds = args.seeds or list(range(args.first_seed, args.first_seed + args.schedules))
    result = run(seeds, args.batch, args.batch_timeout)
    result["machine"] = machine()
    result["command"] = " ".join(["python", *sys.argv])
    print(json.dumps(result["summary"], indent=2))
    for problem in result["problems"][:20]:
        print("PROBLEM", problem)
    if not args.seeds:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
