"""What the headline setting gives by default on workloads its defaults were not tuned on.

The headline setting is ``CheckpointConfig(policy="intermittent", codec="adaptive", bits=4)``
with every other field left at the library's default (the README's example; ``keep_last=1``
here, so storage held is the latest chain). Each workload of :data:`FAMILY` (8 Zipf-skewed
tables; Zipf exponent 1.0 to 1.4; 10k to 10M rows; 16 to 128 columns; 2 to 100 steps per
interval; one starting after 600 steps of training) trains the same deterministic run once per
setting, on 2 gloo ranks, with ``benchmarks/policies.py``'s worker:

* ``full``: every checkpoint full with the default's codecs: whole-row 4-bit codes, the
  restored error to match, and the full restore;
* ``default``: the headline setting as a user gets it;
* ``previous``: the same with the restore bound it had from issue 22 to issue 30 (1.2 of the
  last full's bytes, ``max_chain: 1.2``), given explicitly (``--no-previous`` skips it);
* ``candidate_NAME`` (with ``--candidate NAME=MAPPING``): the headline setting with the
  mapping's fields (to choose defaults from evidence).

Per workload: the measured touched fraction per interval; write reduction (bytes per interval
against a full fp32 checkpoint) over the whole run and after its first full
(``..._steady``: a job checkpoints for days, its first full is soon paid off); storage
reduction (keeping every fp32 full against the latest chain); the best schedule of fulls,
one-shot and incremental diffs knowing the future, under the default's restore bound
(``oracle.best_bounded_schedule``), and the default's share of it; bytes per written diff row;
restored relative L2 against whole-row 4-bit codes; and the time to restore the default's
newest checkpoint (its whole chain) against ``dcp.load`` of the same model's fp32 checkpoint
and against the ``full`` run's final full, slowest rank, best (and median) of ``--repeats``
interleaved rounds: in the training processes (``restore_vs_dcp_load``), and each load the
first of fresh ranks, as a relaunched job restores (``restore_vs_dcp_load_fresh``,
``fresh_restore.py``, which says why the two differ). The summary's write figures cover the
workloads touching at most :data:`SPARSE` of their rows per interval. Writes
``benchmarks/results/family.json``: ``{machine, results: [...], summary: {...}}``.

Run: ``python benchmarks/family.py [--quick] [--only NAME]``
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).parent))

from common import write_result  # noqa: E402
from fresh_restore import DCP, fresh_restore_times  # noqa: E402
from oracle import Pricing, best_bounded_schedule, schedule_bytes  # noqa: E402
from policies import Schedule, measure, parents_of, policy_table, schedule_string  # noqa: E402

from embckpt.config import CheckpointConfig, from_mapping  # noqa: E402
from embckpt.examples.workload import DemoConfig, WorkloadConfig  # noqa: E402
from embckpt.policy import COST_MAX_CHAIN, IntermittentPolicy, Policy, make_policy  # noqa: E402

HEADLINE: dict[str, Any] = {"policy": "intermittent", "codec": "adaptive", "bits": 4}
"""The README's headline setting; every field it does not name is the library's default."""


def chain_config() -> CheckpointConfig:
    """The headline setting's codecs with every diff incremental and no forced full: one full,
    then a chain of diffs as long as the caller saves (what restore benchmarks time)."""
    options = {**HEADLINE, "policy": "incremental", "full_every": 0}
    return from_mapping(CheckpointConfig, options, "chain_config")


PREVIOUS: dict[str, Any] = {
    "policy_options": {"max_chain": COST_MAX_CHAIN},
    "optimizer_codec": "raw",
}
"""The defaults the headline setting had from issue 22 to issue 30, where they differ from
today's: a restore bound of 1.2 of the last full's bytes, lossless optimizer state."""
SPARSE = 0.05
"""Workloads touching at most this share of their rows per interval: the 40x goal's."""
SHARES = (0.33, 0.22, 0.15, 0.1, 0.08, 0.06, 0.04, 0.02)
"""How a workload's rows split over its 8 tables (a few large tables, a tail of small ones)."""


@dataclasses.dataclass(frozen=True)
class Member:
    """One workload of the family: 8 tables of ``rows`` rows in all (``largest``: the first
    table alone has this many, the others split ``rows``; ``equal``: 8 tables alike), ``dim``
    columns, ids drawn with Zipf exponent ``alpha``, ``batch`` samples per rank and step, a
    checkpoint every ``every`` steps after ``warmup`` steps of training."""

    name: str
    rows: int
    dim: int
    alpha: float
    batch: int
    every: int
    intervals: int
    warmup: int = 0
    largest: int | None = None
    equal: bool = False

    def cardinalities(self) -> tuple[int, ...]:
        if self.equal:
            return (self.rows // len(SHARES),) * len(SHARES)
        shares = SHARES[1:] if self.largest else SHARES
        split = np.maximum(np.round(np.array(shares) / sum(shares) * self.rows), 4)
        head = (self.largest,) if self.largest else ()
        return (*head, *(int(n) for n in split))

    def demo_config(self, world_size: int) -> DemoConfig:
        steps = self.warmup + self.every * self.intervals
        workload = WorkloadConfig(
            cardinalities=self.cardinalities(),
            embedding_dim=self.dim,
            zipf_alpha=self.alpha,
            batch_size=self.batch,
            # A sample is seen once where the run fits in 400k generated samples; longer runs
            # go through them again, as epochs do.
            num_samples=min(steps * self.batch * world_size, 400_000),
            dense_arch=(64, self.dim),
            over_arch=(64, 1),
        )
        return DemoConfig(workload=workload, world_size=world_size)


FAMILY = (
    Member("zipf1.0_dim32", rows=600_000, dim=32, alpha=1.0, batch=256, every=10, intervals=30),
    Member("zipf1.4_dim64", rows=1_200_000, dim=64, alpha=1.4, batch=512, every=20, intervals=30),
    Member(
        "rows10k_dim128",
        rows=80_000,
        dim=128,
        alpha=1.1,
        batch=512,
        every=10,
        intervals=16,
        equal=True,
    ),
    Member(
        "rows10M_dim16",
        rows=200_000,
        largest=10_000_000,
        dim=16,
        alpha=1.0,
        batch=1024,
        every=40,
        intervals=30,
    ),
    Member("long_interval", rows=300_000, dim=64, alpha=1.2, batch=128, every=100, intervals=10),
    Member("short_interval", rows=300_000, dim=16, alpha=1.1, batch=256, every=3, intervals=30),
    Member(
        "warm_start",
        rows=1_200_000,
        dim=64,
        alpha=1.1,
        batch=512,
        every=20,
        intervals=30,
        warmup=600,
    ),
    Member("dim128", rows=200_000, dim=128, alpha=1.05, batch=256, every=10, intervals=16),
)


def settings(candidates: list[str]) -> dict[str, CheckpointConfig]:
    """The runs' checkpoint settings; each of ``candidates`` (``NAME=MAPPING``, the mapping in
    YAML) adds run ``candidate_NAME``: the headline setting with the mapping's fields."""
    default = from_mapping(CheckpointConfig, {**HEADLINE, "keep_last": 1}, "headline")
    configs = {
        "full": dataclasses.replace(default, policy="full", policy_options={}),
        "default": default,
        "previous": dataclasses.replace(default, **PREVIOUS),
    }
    for candidate in candidates:
        name, _, mapping = candidate.partition("=")
        changed = yaml.safe_load(mapping) or {}
        configs[f"candidate_{name.strip()}"] = from_mapping(
            CheckpointConfig, {**HEADLINE, "keep_last": 1, **changed}, f"candidate {name}"
        )
    return configs


def bounded_oracle(
    runs: dict[str, list[dict[str, Any]]], counts: np.ndarray, fp32: float, policy: Policy
) -> dict[str, Any]:
    """The best schedule of fulls, one-shot and incremental diffs under ``policy``'s restore
    bound (``oracle.best_bounded_schedule``), priced from the default run's measured bytes
    (fulls: the mean of the ``full`` and ``default`` runs' fulls, which share codecs; diffs:
    the default's bytes per written row plus its per-checkpoint files), beside the default's
    own schedule priced alike."""
    records = runs["default"]
    diffs = [r for r in records if r["kind"] == "diff"]
    fulls = [r["bytes"] for name in ("full", "default") for r in runs[name] if r["kind"] == "full"]
    rows = sum(r["rows"] for r in diffs)
    pricing = Pricing(
        full_bytes=sum(fulls) / len(fulls),
        diff_row_bytes=sum(r["rows_bytes"] for r in diffs) / rows if rows else 0.0,
        diff_fixed_bytes=sum(r["non_row_bytes"] for r in diffs) / max(len(diffs), 1),
    )
    assert isinstance(policy, IntermittentPolicy)
    bound = policy.restore_limit(pricing.full_bytes, fp32) * pricing.full_bytes
    costs = pricing.diff_costs(counts)
    best, kinds = best_bounded_schedule(pricing.full_bytes, costs, bound)
    parents = parents_of(records)
    priced = schedule_bytes(parents, pricing.full_bytes, costs)
    intervals = len(records)
    # A run cut short ends the oracle's schedule there too, so a full the predictor takes for
    # intervals the run never reaches counts against it; before its last full, both cover the
    # same finished chains.
    last = max(t for t, p in enumerate(parents) if p is None)
    before = None
    if last > 0:
        best_before, _ = best_bounded_schedule(pricing.full_bytes, costs[:last, :last], bound)
        before = best_before / schedule_bytes(parents[:last], pricing.full_bytes, costs)
    return {
        "pricing": dataclasses.asdict(pricing),
        "bound_bytes": bound,
        "schedule": "".join(kinds),
        "write_reduction_x": fp32 * intervals / best,
        "default_priced_write_reduction_x": fp32 * intervals / priced,
        "default_priced_vs_oracle_before_last_full": before,
    }


def _reduction(records: list[dict[str, Any]], fp32: float, skip: int = 0) -> float:
    """Full fp32 bytes over bytes written, per interval, after the first ``skip`` checkpoints."""
    kept = records[skip:]
    return fp32 * len(kept) / sum(r["bytes"] for r in kept)


def evaluate(member: Member, configs: dict[str, CheckpointConfig], repeats: int) -> dict[str, Any]:
    """Runs every setting of ``configs`` on ``member`` and returns its row of the family."""
    cfg = member.demo_config(world_size=2)
    schedule = Schedule(member.intervals, member.every, member.warmup)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        measured = measure(cfg, root, configs, schedule, ("full", "default"), repeats)
        restored = {name: (Path(root) / name, configs[name]) for name in ("full", "default")}
        fresh = fresh_restore_times(cfg, restored, Path(root) / "dcp", repeats)
    runs, counts, rel_l2 = measured["runs"], measured["counts"], measured["rel_l2"]
    table = policy_table(runs, rel_l2)
    fp32 = runs["full"][0]["full_fp32_bytes"]
    keep_all_fp32 = fp32 * member.intervals
    oracle = bounded_oracle(runs, counts["default"], fp32, make_policy(configs["default"]))
    restore = measured["restore_s"]
    best = {name: min(times) for name, times in restore.items()}
    median = {name: statistics.median(times) for name, times in restore.items()}
    links = measured["restore_phases"]["default"][0][0]["links"]
    per_run = {
        name: {
            "write_reduction_x": table[name]["write_reduction_x"],
            "write_reduction_x_steady": _reduction(runs[name], fp32, skip=1),
            "storage_reduction_x": keep_all_fp32 / runs[name][-1]["storage_held_bytes"],
            "full_checkpoints": table[name]["full_checkpoints"],
            "bytes_per_written_row_diff": table[name]["bytes_per_written_row_diff"],
            "restored_rel_l2": table[name]["restored_rel_l2"],
            "schedule": schedule_string(parents_of(runs[name])),
            "checkpoints": [
                {k: r[k] for k in ("step", "kind", "parent_step", "bytes", "rows", "rows_bytes")}
                for r in runs[name]
            ],
        }
        for name in configs
    }
    default = per_run["default"]
    touched = [r["touched_fraction"] for r in runs["full"][1:]]
    row = {
        "workload": member.name,
        "member": dataclasses.asdict(member),
        "cardinalities": list(member.cardinalities()),
        "total_rows": sum(member.cardinalities()),
        "touched_fraction": statistics.mean(touched),
        "touched_fraction_range": [min(touched), max(touched)],
        "full_fp32_bytes": fp32,
        "write_reduction_x": default["write_reduction_x"],
        "write_reduction_x_steady": default["write_reduction_x_steady"],
        "storage_reduction_x": default["storage_reduction_x"],
        "previous_write_reduction_x": per_run.get("previous", {}).get("write_reduction_x"),
        "previous_write_reduction_x_steady": per_run.get("previous", {}).get(
            "write_reduction_x_steady"
        ),
        "oracle_write_reduction_x": oracle["write_reduction_x"],
        "predictor_vs_oracle": default["write_reduction_x"] / oracle["write_reduction_x"],
        "predictor_vs_oracle_priced": oracle["default_priced_write_reduction_x"]
        / oracle["write_reduction_x"],
        "predictor_vs_oracle_before_last_full": oracle["default_priced_vs_oracle_before_last_full"],
        "bytes_per_written_row": default["bytes_per_written_row_diff"],
        "restored_rel_l2": default["restored_rel_l2"],
        "whole_row_rel_l2": per_run["full"]["restored_rel_l2"],
        "rel_l2_vs_whole_row": default["restored_rel_l2"] / per_run["full"]["restored_rel_l2"],
        "chain_restore_s": best["default"],
        "full_restore_s": best["full"],
        "dcp_load_s": best["dcp_load"],
        "restore_vs_dcp_load": best["default"] / best["dcp_load"],
        "restore_vs_dcp_load_median": median["default"] / median["dcp_load"],
        "chain_vs_full_restore": best["default"] / best["full"],
        "chain_links": links,
        "restore_s_per_extra_link": (best["default"] - best["full"]) / max(links - 1, 1),
        "restore_s": restore,
        "fresh_restore_s": fresh,
        "restore_vs_dcp_load_fresh": min(fresh["default"]) / min(fresh[DCP]),
        "restore_vs_dcp_load_fresh_median": statistics.median(fresh["default"])
        / statistics.median(fresh[DCP]),
        "restore_phases": measured["restore_phases"],
        "byte_budget": table["default"]["byte_budget"],
        "oracle": oracle,
        "union_counts": counts["default"].tolist(),
        "runs": per_run,
        "runtime_s": time.perf_counter() - started,
    }
    print(
        f"{member.name:>15}: touched {row['touched_fraction']:.3f}, default "
        f"{row['write_reduction_x']:.1f}x, steady {row['write_reduction_x_steady']:.1f}x "
        f"({default['schedule']}), previous {row['previous_write_reduction_x'] or 0:.1f}x, "
        f"oracle {row['oracle_write_reduction_x']:.1f}x ({oracle['schedule']}, "
        f"{row['predictor_vs_oracle']:.3f}), storage {row['storage_reduction_x']:.1f}x, "
        f"{row['bytes_per_written_row'] or float('nan'):.1f} B/row, "
        f"rel l2 {row['restored_rel_l2']:.4f} vs {row['whole_row_rel_l2']:.4f}, restore "
        f"{best['default']:.3f} s vs dcp.load {best['dcp_load']:.3f} s "
        f"({row['restore_vs_dcp_load']:.2f}x), full {best['full']:.3f} s; fresh ranks "
        f"{min(fresh['default']):.3f} s vs {min(fresh[DCP]):.3f} s "
        f"({row['restore_vs_dcp_load_fresh']:.2f}x), {row['runtime_s']:.0f} s",
        flush=True,
    )
    for name, run in per_run.items():
        if name.startswith("candidate_"):
            print(
                f"{'':>17}{name}: {run['write_reduction_x']:.1f}x, steady "
                f"{run['write_reduction_x_steady']:.1f}x ({run['schedule']}), "
                f"{run['bytes_per_written_row_diff'] or 0:.1f} B/row, rel l2 "
                f"{run['restored_rel_l2']:.4f}",
                flush=True,
            )
    return row


def quick(member: Member) -> Member:
    """Half the intervals (at least 8); the warm-up stays."""
    return dataclasses.replace(member, intervals=max(8, member.intervals // 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer intervals, shorter warm-up")
    parser.add_argument("--only", action="append", default=[], help="run these workloads only")
    parser.add_argument("--repeats", type=int, default=5, help="restore rounds (best is kept)")
    parser.add_argument(
        "--no-previous", action="store_true", help="skip the previous defaults' run"
    )
    parser.add_argument(
        "--candidate",
        action="append",
        default=[],
        metavar="NAME=MAPPING",
        help="also run the headline setting with these fields (a YAML mapping), as "
        "'candidate_NAME', e.g. 'log8={optimizer_codec: log8}'",
    )
    parser.add_argument("--name", default="family", help="result file name")
    args = parser.parse_args()
    configs = settings(args.candidate)
    if args.no_previous:
        del configs["previous"]
    members = [m for m in FAMILY if not args.only or m.name in args.only]
    started = time.perf_counter()
    results = [evaluate(quick(m) if args.quick else m, configs, args.repeats) for m in members]
    sparse = [r for r in results if r["touched_fraction"] <= SPARSE] or results
    summary = {
        "sparse_workloads": [r["workload"] for r in sparse],
        "min_write_reduction_x": min(r["write_reduction_x"] for r in sparse),
        "min_write_reduction_x_steady": min(r["write_reduction_x_steady"] for r in sparse),
        "min_predictor_vs_oracle": min(r["predictor_vs_oracle"] for r in results),
        "min_predictor_vs_oracle_before_last_full": min(
            (
                r["predictor_vs_oracle_before_last_full"]
                for r in results
                if r["predictor_vs_oracle_before_last_full"] is not None
            ),
            default=None,
        ),
        "max_restore_vs_dcp_load": max(r["restore_vs_dcp_load"] for r in results),
        "max_restore_vs_dcp_load_median": max(r["restore_vs_dcp_load_median"] for r in results),
        "max_restore_vs_dcp_load_fresh": max(r["restore_vs_dcp_load_fresh"] for r in results),
        "max_restore_vs_dcp_load_fresh_median": max(
            r["restore_vs_dcp_load_fresh_median"] for r in results
        ),
        "max_rel_l2_vs_whole_row": max(r["rel_l2_vs_whole_row"] for r in results),
        "min_storage_reduction_x": min(r["storage_reduction_x"] for r in results),
        "max_chain_vs_full_restore": max(r["chain_vs_full_restore"] for r in results),
        "touched_fraction_range": [
            min(r["touched_fraction"] for r in results),
            max(r["touched_fraction"] for r in results),
        ],
        "runtime_s": time.perf_counter() - started,
    }
    path = write_result(
        args.name,
        {
            "args": vars(args),
            "default_config": dataclasses.asdict(configs["default"]),
            "settings": {k: dataclasses.asdict(v) for k, v in configs.items()},
            "results": results,
            "summary": summary,
        },
    )
    print(summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
