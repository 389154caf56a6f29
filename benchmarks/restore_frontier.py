"""What keeping every restore within ``dcp.load``'s time would cost in writes, at best.

Issue 39's first goal asks that each family workload's newest checkpoint restore in at most
``dcp.load``'s time; the write goal asks that diffs write far less than fp32. Shorter chains
restore faster and write more, so whether both can hold at once is a question about schedules.
This script answers it from a stored family run (``benchmarks/results/family.json``), running
nothing: for each workload, the best schedule of fulls, one-shot and incremental diffs that
knows the future (``oracle.best_bounded_schedule``, priced as ``family.py`` prices its
oracle: ``oracle.pricing``, ``union_counts``) under the bound that every checkpoint restores
within ``dcp.load``'s measured time, a restore's time modelled from the same run:

- a byte of a chain takes as long as a byte of the full (``full_restore_s`` over the full's
  bytes);
- each diff a restore reads adds its bytes and a fixed cost: ``restore_s_per_extra_link``
  less a median incremental diff's bytes at that rate (its files opened, checked and parsed,
  its blocks staged and decoded one by one).

It reports that schedule's write reduction with the fixed cost as measured, halved and zero
(what cheaper links would buy), beside the default's measured one and the oracle's under the
default's byte bound. A model, not a measurement: its inputs are measured (on the run's
machine), the restore times of the schedules it finds are not.

    python benchmarks/restore_frontier.py [--family benchmarks/results/family.json]

Writes ``benchmarks/results/restore_frontier.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from oracle import Pricing, best_bounded_schedule  # noqa: E402

RESULTS = Path(__file__).parent / "results"
LINK_COST_SCALES = (1.0, 0.5, 0.0)  # the fixed cost per link as measured, halved, none


def frontier(workload: dict[str, Any]) -> dict[str, Any]:
    """One family workload's row: the model's inputs and the best schedules within
    ``dcp.load``'s time at each of :data:`LINK_COST_SCALES`."""
    pricing = Pricing(**workload["oracle"]["pricing"])
    costs = pricing.diff_costs(np.array(workload["union_counts"]))
    intervals = len(costs)
    seconds_per_byte = workload["full_restore_s"] / pricing.full_bytes
    link_bytes = float(np.median([costs[t - 1, t] for t in range(1, intervals)]))
    link_fixed_s = max(workload["restore_s_per_extra_link"] - link_bytes * seconds_per_byte, 0.0)
    bound = workload["dcp_load_s"] / seconds_per_byte  # dcp.load's time, in bytes of ours
    fp32 = workload["full_fp32_bytes"]
    rows = []
    for scale in LINK_COST_SCALES:
        fixed = link_fixed_s * scale / seconds_per_byte
        written, kinds = best_bounded_schedule(pricing.full_bytes, costs, bound, fixed)
        schedule = "".join(kinds)
        rows.append(
            {
                "link_cost_scale": scale,
                "write_reduction_x": fp32 * intervals / written,
                "schedule": schedule,
                "most_links_read": _most_links(schedule),
            }
        )
    return {
        "workload": workload["workload"],
        "model": {
            "full_bytes": pricing.full_bytes,
            "restore_s_per_byte": seconds_per_byte,
            "median_link_bytes": link_bytes,
            "link_fixed_s": link_fixed_s,
            "dcp_load_s": workload["dcp_load_s"],
        },
        "default_write_reduction_x": workload["write_reduction_x"],
        "default_chain_links": workload["chain_links"],
        "default_restore_vs_dcp_load": workload["restore_vs_dcp_load"],
        "byte_bound_oracle_write_reduction_x": workload["oracle"]["write_reduction_x"],
        "within_dcp_load": rows,
    }


def _most_links(schedule: str) -> int:
    """The most diffs a restore of a schedule's checkpoints reads (``F`` full, ``d``
    one-shot, ``i`` incremental): a one-shot diff's restore reads the full and it alone."""
    most = links = 0
    for kind in schedule:
        links = {"F": 0, "d": 1}.get(kind, links + 1)
        most = max(most, links)
    return most


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", type=Path, default=RESULTS / "family.json")
    args = parser.parse_args()
    family = json.loads(args.family.read_text())
    rows = [frontier(w) for w in family["results"]]
    sparse = set(family["summary"]["sparse_workloads"])

    def least(scale: float, names: set[str] | None = None) -> float:
        return min(
            r["write_reduction_x"]
            for row in rows
            if names is None or row["workload"] in names
            for r in row["within_dcp_load"]
            if r["link_cost_scale"] == scale
        )

    out = {
        "machine": family["machine"],
        "source": str(args.family),
        "link_cost_scales": list(LINK_COST_SCALES),
        "results": rows,
        "summary": {
            "sparse_workloads": sorted(sparse),
            "min_write_reduction_x_sparse_default": family["summary"]["min_write_reduction_x"],
            **{
                f"min_write_reduction_x_sparse_within_dcp_load_links_x{scale:g}": least(
                    scale, sparse
                )
                for scale in LINK_COST_SCALES
            },
            **{
                f"min_write_reduction_x_within_dcp_load_links_x{scale:g}": least(scale)
                for scale in LINK_COST_SCALES
            },
        },
    }
    path = RESULTS / "restore_frontier.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    for row in rows:
        best = " ".join(
            f"x{r['link_cost_scale']:g}: {r['write_reduction_x']:.1f}x"
            for r in row["within_dcp_load"]
        )
        print(
            f"{row['workload']:16s} default {row['default_write_reduction_x']:6.1f}x "
            f"({row['default_restore_vs_dcp_load']:.2f}x dcp.load); within dcp.load, "
            f"links at {best}"
        )
    print(json.dumps(out["summary"], indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
