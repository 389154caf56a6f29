"""What a chain's link costs per table: the same rows split into more tables, restored.

Why: a restore's link costs far more than its bytes (``restore_bound.py``), and the work that
does not scale with bytes is done per file and per block: each table of a rank is a delta block
and a whole-row block in every diff, each staged, masked, decoded and written on its own. This
measures how a link's cost grows with the tables alone: ``--rows`` rows of ``--dim`` columns in
all, split into each of ``--tables`` counts of equal tables, 2 gloo ranks (the planner's
sharding), the headline codecs under ``policy: incremental`` (a full, then ``--links - 1``
incremental diffs, ``--steps`` training steps apart). In one process per count, ``--rounds``
times: the newest checkpoint (the chain), then the full alone, each from a trimmed heap
(``common.cold_heap``); a time is the slowest rank's. ``per_link_s`` = (chain - full) /
(links - 1), from the best of each; ``summary.per_table_per_link_s``: the slope of a line
through those against the table count.

    python benchmarks/tables_per_link.py [--tables 4,16,32] [--links 10] [--rounds 12]

Writes ``benchmarks/results/tables_per_link.json``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from common import build_workload, timed_load, write_result  # noqa: E402
from family import chain_config  # noqa: E402

from embckpt.examples.launcher import run_ranks  # noqa: E402
from embckpt.examples.workload import DemoConfig, WorkloadConfig  # noqa: E402

WORLD_SIZE = 2


def _worker(
    rank: int, world_size: int, tables: int, args: argparse.Namespace, root: str
) -> dict[str, list[float]]:
    from embckpt import Checkpointer

    workload = WorkloadConfig(
        cardinalities=(args.rows // tables,) * tables,
        embedding_dim=args.dim,
        zipf_alpha=1.1,
        batch_size=128,
        num_samples=60_000,
        dense_arch=(64, args.dim),
        over_arch=(64, 1),
    )
    work = build_workload(rank, world_size, DemoConfig(workload=workload, world_size=world_size))
    config = chain_config()
    times: dict[str, list[float]] = {"chain": [], "full": []}
    with Checkpointer(work.model, root, optimizer=work.optimizer, config=config) as ck:
        steps = []
        for link in range(args.links):
            for _ in range(args.steps):
                work.step()
            steps.append((link + 1) * args.steps)
            ck.save(steps[-1]).wait()
        ck.load()  # warm: the first restore of a process loads what later ones reuse
        for _ in range(args.rounds):
            for what, step in (("chain", steps[-1]), ("full", steps[0])):
                times[what].append(timed_load(functools.partial(ck.load, step)))
    return times


def measure(tables: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as root:
        ranks = run_ranks(_worker, WORLD_SIZE, tables, args, root, timeout_s=1800)
    seconds = {
        what: np.max([r[what] for r in ranks], axis=0).tolist() for what in ("chain", "full")
    }
    best = {what: min(values) for what, values in seconds.items()}
    median = {what: statistics.median(values) for what, values in seconds.items()}
    row = {
        "tables": tables,
        "chain_s_best": best["chain"],
        "full_s_best": best["full"],
        "per_link_s": (best["chain"] - best["full"]) / (args.links - 1),
        "per_link_s_median": (median["chain"] - median["full"]) / (args.links - 1),
        "seconds": seconds,
    }
    print(
        f"{tables:3} tables: chain {best['chain'] * 1e3:6.1f} ms, full {best['full'] * 1e3:5.1f} "
        f"ms, per link {row['per_link_s'] * 1e3:5.2f} ms "
        f"(median {row['per_link_s_median'] * 1e3:.2f})",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tables", default="4,16,32")
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--links", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5, help="training steps between saves")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    results = [measure(int(n), args) for n in args.tables.split(",")]
    counts = [r["tables"] for r in results]
    slope, intercept = np.polyfit(counts, [r["per_link_s"] for r in results], 1)
    summary = {"per_table_per_link_s": float(slope), "per_link_intercept_s": float(intercept)}
    path = write_result(
        "tables_per_link", {"args": vars(args), "results": results, "summary": summary}
    )
    print(summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
