"""Check-N-Run's Figures 15 and 16 on our reference workload: bytes written per checkpoint
interval and storage held over time, for full, one-shot, consecutive incremental and
intermittent differential checkpoints.

Every policy trains the same deterministic run (``configs/bench_spine.yaml``: Criteo schema,
~1M 64-dim rows, Zipf-skewed ids, 2 gloo ranks) and checkpoints every ``--every`` steps with
the same settings (:data:`BENCH_CODEC`: 4-bit adaptive rows, delta diffs, log8 optimizer state,
intermittent diffs priced both ways; the config and ``--set`` override them) and retention (the
latest checkpoint and its chain). Baselines: a full fp32 checkpoint per interval (bytes written)
and keeping every one of them (storage held). The summary adds bytes per written diff row, the
restored rows' relative l2 error against the live weights (and the whole-row codec's, from the
``full`` run), and the best full / one-shot schedule knowing the future (``oracle.py``) beside
the one-shot-only intermittent run. Writes ``benchmarks/results/policies.json`` and two PNG
plots beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).parent))

from byte_budget import checkpoint_budget, format_budget, merge_budgets  # noqa: E402
from common import RESULTS, build_workload, cold_heap, dcp_save, dcp_state, write_result  # noqa: E402
from oracle import Pricing, best_schedule, one_shot_parents, schedule_bytes, union_counts  # noqa: E402

from embckpt.config import CheckpointConfig, from_mapping, load_yaml  # noqa: E402
from embckpt.examples.launcher import run_ranks  # noqa: E402
from embckpt.examples.workload import DemoConfig  # noqa: E402

POLICIES = ("full", "one_shot", "incremental", "intermittent", "intermittent_one_shot")
"""The runs: each policy, and ``intermittent_one_shot``, the intermittent policy with its options
but Check-N-Run's one-shot diffs only (``diffs: one_shot``), for comparison."""
BENCH_CODEC = {
    "codec": "adaptive",
    "bits": 4,
    "optimizer_codec": "log8",
    "policy_options": {"diffs": "auto"},
}
"""What the runs use unless the config or the command line say otherwise: today's 4-bit adaptive
rows (as deltas in diffs: ``diff_deltas`` is on by default), the opt-in one-byte optimizer state
(its effect on AUC: benchmarks/accuracy.py) and intermittent diffs priced both ways."""
FORCED = {"policy": "intermittent", "full_every": 0, "keep_last": 1}
"""What every run shares whatever the config: fulls only when a policy asks, the latest chain.
``policy_options`` are the intermittent run's (checked against it); the other policies take none."""


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _touched_since_last(ckpt: Any) -> np.ndarray:
    """This rank's rows (every written block, in order) touched since the previous checkpoint,
    read from the checkpointer's tracker as its next save will see them (folded, with moving
    replicated rows marked; both are idempotent, so the save decides alike)."""
    from embckpt.tracking import View

    ckpt.tracker.fold()
    ckpt._saver.mark_moving_rows()
    bitmaps = []
    for shard in ckpt.sharded.writer_shards():
        bits = np.zeros(shard.num_rows, dtype=bool)
        bits[ckpt.tracker.dirty(shard.key, View.SINCE_LAST).cpu().numpy()] = True
        bitmaps.append(bits)
    return np.concatenate(bitmaps) if bitmaps else np.zeros(0, dtype=bool)


def _live_blocks(ckpt: Any) -> list[tuple[str, str, int, int, Any]]:
    """(table, state-dict key, row offset, column offset, weights) of this rank's written
    blocks, copied to the CPU."""
    return [
        (s.table, s.fqn, s.row_offset, s.col_offset, s.weight.detach().cpu().clone())
        for s in ckpt.sharded.writer_shards()
    ]


def restored_rel_l2(
    directory: Path, live: list[tuple[str, str, int, int, Any]]
) -> dict[str, float]:
    """Per table: the mean over rows (zero rows skipped) of ||restored - live|| / ||live||, with
    the latest checkpoint of ``directory`` rebuilt offline (as an export does) and ``live`` every
    rank's blocks at that step."""
    import torch

    from embckpt.read.export import reconstruct

    tables = reconstruct(directory).tables
    err: dict[str, torch.Tensor] = {}
    norm: dict[str, torch.Tensor] = {}
    for table, fqn, row, col, weight in live:
        whole = tables[fqn]
        restored = whole[row : row + weight.shape[0], col : col + weight.shape[1]].float()
        rows = slice(row, row + weight.shape[0])
        err.setdefault(table, torch.zeros(whole.shape[0], dtype=torch.float64))[rows] += (
            (restored - weight.float()).double().square().sum(dim=1)
        )
        norm.setdefault(table, torch.zeros(whole.shape[0], dtype=torch.float64))[rows] += (
            weight.double().square().sum(dim=1)
        )
    result = {}
    for table in sorted(err):
        kept = norm[table] > 0
        ratio = (err[table][kept] / norm[table][kept]).sqrt()
        result[table] = float(ratio.mean()) if ratio.numel() else 0.0
    return result


def policy_configs(checkpoint: CheckpointConfig) -> dict[str, CheckpointConfig]:
    """The settings of each run of :data:`POLICIES`: ``checkpoint`` with the run's policy;
    ``policy_options`` go to the intermittent runs only."""
    configs = {}
    for policy in POLICIES:
        options: dict[str, Any] = {}
        if policy.startswith("intermittent"):
            options = dict(checkpoint.policy_options)
            if policy == "intermittent_one_shot":
                # The predictor alone, in the oracle's schedule space (no restore bound).
                options.update(diffs="one_shot", max_chain=math.inf)
        configs[policy] = dataclasses.replace(
            checkpoint, policy=policy.removesuffix("_one_shot"), policy_options=options
        )
    return configs


def _run(
    rank: int,
    world_size: int,
    cfg: DemoConfig,
    dataset: Any,
    directory: Path,
    config: CheckpointConfig,
    schedule: Schedule,
) -> tuple[list[dict[str, Any]], np.ndarray, list[tuple[str, str, int, int, Any]]]:
    """One run: trains ``schedule.warmup_steps`` steps unwatched, then checkpoints every
    ``schedule.every`` steps ``schedule.intervals`` times. Returns the checkpoints' records,
    this rank's rows touched in each interval and its live blocks at the end."""
    import torch.distributed as dist

    from embckpt import Checkpointer
    from embckpt.storage.chain import read_manifest
    from embckpt.storage.layout import step_dir_name
    from embckpt.storage.manifest import files_bytes

    work = build_workload(rank, world_size, cfg, dataset)
    for _ in range(schedule.warmup_steps):
        work.step()
    records = []
    touched = []
    with Checkpointer(work.model, directory, optimizer=work.optimizer, config=config) as ckpt:
        first = schedule.warmup_steps
        for step in range(first + 1, first + schedule.intervals * schedule.every + 1):
            work.step()
            if (step - first) % schedule.every:
                continue
            touched.append(_touched_since_last(ckpt))
            manifest = ckpt.save(step).wait()
            assert manifest is not None
            dist.barrier()
            step_dir = directory / step_dir_name(step)
            # Each file once: the blocks of a packed rows file share it. Every rank's files:
            # a save's manifest lists this rank's rows files only (format 5).
            whole = read_manifest(ckpt.store, step)
            rows_bytes = files_bytes(f for f in whole.files if f.role == "rows")
            records.append(
                {
                    "step": step,
                    "kind": manifest.kind,
                    "parent_step": manifest.parent_step,
                    "bytes": manifest.total_bytes,
                    "rows": manifest.rows_written,
                    "rows_bytes": rows_bytes,
                    "non_row_bytes": manifest.total_bytes - rows_bytes,
                    "touched_fraction": manifest.stats["touched_fraction"],
                    "written_fraction": manifest.stats["dirty_fraction"],
                    "full_fp32_bytes": manifest.stats["full_fp32_bytes"],
                    "storage_held_bytes": _dir_bytes(directory) if rank == 0 else None,
                    "budget": checkpoint_budget(step_dir) if rank == 0 else None,
                    "reason": manifest.stats["reason"],
                }
            )
        live = _live_blocks(ckpt)
    return records, np.stack(touched), live


def _restore_times(
    rank: int,
    world_size: int,
    cfg: DemoConfig,
    directories: dict[str, tuple[Path, CheckpointConfig]],
    repeats: int,
    dcp_dir: Path | None = None,
) -> dict[str, dict[str, Any]]:
    """Seconds to load the latest checkpoint of each of ``directories`` into a fresh model,
    ``repeats`` rounds, the directories in turn in each round (so that their ratios come from
    the same moments), between barriers; the slowest rank's time is the caller's to take.
    ``phases``: each load's links and busy seconds per restore phase. With ``dcp_dir``, the
    model's full fp32 checkpoint is written there with ``dcp.save`` first (untimed) and each
    round also times its ``dcp.load`` (``dcp_load``), what a DCP user would wait for."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from embckpt import Checkpointer

    work = build_workload(rank, world_size, cfg)
    seconds: dict[str, list[float]] = {name: [] for name in directories}
    phases: dict[str, list[dict[str, float]]] = {name: [] for name in directories}
    if dcp_dir is not None:
        dcp_save(dcp_state(work.model, work.optimizer), str(dcp_dir), threads=2)
        seconds["dcp_load"] = []
    for _ in range(repeats):
        for name, (directory, config) in directories.items():
            with Checkpointer(
                work.model, directory, optimizer=work.optimizer, config=config
            ) as ckpt:
                cold_heap()
                dist.barrier()
                started = time.perf_counter()
                result = ckpt.load()
                seconds[name].append(time.perf_counter() - started)
                phases[name].append({"links": len(result.chain), **result.phases})
                dist.barrier()
        if dcp_dir is not None:
            cold_heap()
            dist.barrier()
            started = time.perf_counter()
            dcp.load(dcp_state(work.model, work.optimizer), checkpoint_id=str(dcp_dir))
            dist.barrier()
            seconds["dcp_load"].append(time.perf_counter() - started)
    return {"seconds": seconds, "phases": phases}


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When a run checkpoints: ``intervals`` checkpoints, one every ``every`` steps, after
    ``warmup_steps`` steps of training without checkpoints (a job that starts checkpointing
    late, or resumes into a new directory)."""

    intervals: int
    every: int
    warmup_steps: int = 0


def _worker(
    rank: int,
    world_size: int,
    cfg: DemoConfig,
    root: str,
    configs: dict[str, CheckpointConfig],
    schedule: Schedule,
    restore_pairs: tuple[str, ...],
    repeats: int,
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from embckpt.examples.demo import load_dataset

    dataset = load_dataset(cfg)
    out: dict[str, Any] = {"runs": {}, "union_counts": {}, "rel_l2": {}}
    for name, config in configs.items():
        directory = Path(root) / name
        records, touched, live = _run(rank, world_size, cfg, dataset, directory, config, schedule)
        out["runs"][name] = records
        out["union_counts"][name] = union_counts(touched).tolist()
        # Rank 0 rebuilds the tables from the files; every rank's live blocks go through disk.
        torch.save(live, Path(root) / f"live_{name}_{rank}.pt")
        dist.barrier()
        if rank == 0:
            every_block = [
                block
                for r in range(world_size)
                for block in torch.load(Path(root) / f"live_{name}_{r}.pt")
            ]
            out["rel_l2"][name] = restored_rel_l2(directory, every_block)
        dist.barrier()
    if restore_pairs:
        directories = {name: (Path(root) / name, configs[name]) for name in restore_pairs}
        out["restore_s"] = _restore_times(
            rank, world_size, cfg, directories, repeats, Path(root) / "dcp"
        )
    return out


def measure(
    cfg: DemoConfig,
    root: str,
    configs: dict[str, CheckpointConfig],
    schedule: Schedule,
    restore_runs: tuple[str, ...] = (),
    repeats: int = 3,
) -> dict[str, Any]:
    """Trains ``cfg``'s workload once per entry of ``configs`` (the same deterministic run each
    time) on ``cfg.world_size`` ranks, checkpointing under that entry's settings into
    ``root/<name>``. Returns ``runs`` (each run's checkpoint records), ``counts`` (per run:
    rows touched in the union of intervals ``f+1..t``, every rank's rows, see
    :func:`oracle.union_counts`), ``rel_l2`` (per run and table) and, when ``restore_runs``
    names runs, ``restore_s``: per run, the slowest rank's seconds to load its latest checkpoint
    into a fresh model, one per round, and ``dcp_load``: ``dcp.load`` of the model's fp32
    checkpoint in the same rounds (``restore_phases``: per run and rank, each load's links and
    phase seconds)."""
    ranks = run_ranks(
        _worker,
        cfg.world_size,
        cfg,
        root,
        configs,
        schedule,
        restore_runs,
        repeats,
        timeout_s=3600,
    )
    result: dict[str, Any] = {
        "runs": ranks[0]["runs"],
        "counts": {
            name: np.sum([r["union_counts"][name] for r in ranks], axis=0) for name in configs
        },
        "rel_l2": ranks[0]["rel_l2"],
    }
    if restore_runs:
        result["restore_s"] = {
            name: np.max([r["restore_s"]["seconds"][name] for r in ranks], axis=0).tolist()
            for name in (*restore_runs, "dcp_load")
        }
        result["restore_phases"] = {
            name: [r["restore_s"]["phases"][name] for r in ranks] for name in restore_runs
        }
    return result


def _plots(runs: dict[str, list[dict[str, Any]]], codec: str, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "full": "#1f4e9c",
        "one_shot": "#f08c2e",
        "incremental": "#3a9d5d",
        "intermittent": "#b33a3a",
        "intermittent_one_shot": "#8a5fb3",
    }
    steps = [r["step"] for r in runs["full"]]
    fp32 = runs["full"][0]["full_fp32_bytes"]
    paths = []
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for policy, records in runs.items():
        ax.plot(
            steps,
            [r["bytes"] / 1e6 for r in records],
            marker="o",
            ms=3,
            color=colors[policy],
            label=f"{policy} ({codec})",
        )
    ax.axhline(fp32 / 1e6, color="black", ls="--", label="full fp32 checkpoint")
    ax.set_yscale("log")
    ax.set_xlabel("training step (one checkpoint per interval)")
    ax.set_ylabel("MB written by the checkpoint (log scale)")
    ax.set_title("Bytes written per checkpoint interval (Check-N-Run Fig. 15)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "policies_bytes_written.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4.8))
    for policy, records in runs.items():
        ax.step(
            steps,
            [r["storage_held_bytes"] / 1e6 for r in records],
            where="post",
            color=colors[policy],
            label=f"{policy} ({codec}, latest chain kept)",
        )
    ax.step(
        steps,
        [fp32 * (i + 1) / 1e6 for i in range(len(steps))],
        where="post",
        color="black",
        ls="--",
        label="every full fp32 checkpoint kept",
    )
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("MB held on storage (log scale)")
    ax.set_title("Storage held over time (Check-N-Run Fig. 16)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "policies_storage_held.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def checkpoint_config(path: str, codec: str | None, bits: int | None, sets: list[str]) -> Any:
    """The runs' checkpoint settings: :data:`BENCH_CODEC`, then the config's ``checkpoint:``
    section, then ``--codec`` / ``--bits`` and every ``--set KEY=VALUE`` (a YAML value), then
    :data:`FORCED`."""
    section = (yaml.safe_load(Path(path).read_text()) or {}).get("checkpoint") or {}
    values: dict[str, Any] = {**BENCH_CODEC, **section}
    values.update({k: v for k, v in (("codec", codec), ("bits", bits)) if v is not None})
    for item in sets:
        key, _, value = item.partition("=")
        values[key.strip()] = yaml.safe_load(value)
    return from_mapping(CheckpointConfig, {**values, **FORCED}, f"{path} checkpoint")


def _kind_budget(records: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    budgets = [r["budget"] for r in records if r["kind"] == kind]
    return merge_budgets(budgets) if budgets else None


def _rows_bytes_per_row(records: list[dict[str, Any]], kind: str | None = None) -> float | None:
    chosen = [r for r in records if kind is None or r["kind"] == kind]
    rows = sum(r["rows"] for r in chosen)
    return sum(r["rows_bytes"] for r in chosen) / rows if rows else None


def parents_of(records: list[dict[str, Any]]) -> list[int | None]:
    """Each checkpoint's parent as an index into ``records`` (None for a full)."""
    index = {r["step"]: t for t, r in enumerate(records)}
    return [None if r["kind"] == "full" else index[r["parent_step"]] for r in records]


def schedule_string(parents: list[int | None]) -> str:
    """F: full, d: one-shot diff (on a full), i: incremental diff (on a diff)."""
    return "".join("F" if p is None else "d" if parents[p] is None else "i" for p in parents)


def oracle_of(
    runs: dict[str, list[dict[str, Any]]], counts: np.ndarray, fp32: float, run: str
) -> dict[str, Any]:
    """The best full / one-shot-diff schedule for run ``run``'s intervals, priced from the
    measured checkpoints (fulls of every run in ``runs``, which must share ``run``'s codecs;
    diffs of ``run``), beside that run's actual schedule (``intermittent_*`` keys)."""
    records = runs[run]
    diffs = [r for r in records if r["kind"] == "diff"]
    fulls = [r["bytes"] for run in runs.values() for r in run if r["kind"] == "full"]
    pricing = Pricing(
        full_bytes=sum(fulls) / len(fulls),
        diff_row_bytes=_rows_bytes_per_row(diffs) or 0.0,
        diff_fixed_bytes=sum(r["non_row_bytes"] for r in diffs) / max(len(diffs), 1),
    )
    costs = pricing.diff_costs(counts)
    oracle_bytes, oracle_kinds = best_schedule(pricing.full_bytes, costs)
    parents = parents_of(records)
    priced = schedule_bytes(parents, pricing.full_bytes, costs)
    actual = sum(r["bytes"] for r in records)
    intervals = len(records)
    result = {
        "pricing": dataclasses.asdict(pricing),
        "schedule": schedule_string(one_shot_parents(oracle_kinds)),
        "fulls": oracle_kinds.count("full"),
        "mean_bytes_per_interval": oracle_bytes / intervals,
        "write_reduction_x": fp32 * intervals / oracle_bytes,
        "intermittent_schedule": schedule_string(parents),
        "intermittent_priced_bytes_per_interval": priced / intervals,
        "intermittent_priced_write_reduction_x": fp32 * intervals / priced,
        "intermittent_actual_write_reduction_x": fp32 * intervals / actual,
    }
    if "one_shot" in runs:  # the rows model checked on the one-shot run's diffs
        predicted = counts[0, 1:]
        measured = np.array([r["rows"] for r in runs["one_shot"][1:]])
        result["one_shot_rows_model_max_rel_error"] = float(
            np.max(np.abs(predicted - measured) / measured.clip(min=1))
        )
    return result


def policy_table(
    runs: dict[str, list[dict[str, Any]]], rel_l2: dict[str, dict[str, float]]
) -> dict[str, dict[str, Any]]:
    """Per run: bytes per interval and their reduction below a full fp32 checkpoint (the
    ``full`` run's ``full_fp32_bytes``), fulls taken, bytes per written row, restored error."""
    fp32 = runs["full"][0]["full_fp32_bytes"]
    table = {}
    for policy, records in runs.items():
        mean_bytes = sum(r["bytes"] for r in records) / len(records)
        table[policy] = {
            "mean_bytes_per_interval": mean_bytes,
            "write_reduction_x": fp32 / mean_bytes,
            "storage_held_end_bytes": records[-1]["storage_held_bytes"],
            "full_checkpoints": sum(r["kind"] == "full" for r in records),
            "bytes_per_written_row": _rows_bytes_per_row(records),
            "bytes_per_written_row_full": _rows_bytes_per_row(records, "full"),
            "bytes_per_written_row_diff": _rows_bytes_per_row(records, "diff"),
            "restored_rel_l2": sum(rel_l2[policy].values()) / len(rel_l2[policy]),
            "restored_rel_l2_per_table": rel_l2[policy],
            "byte_budget": {k: _kind_budget(records, k) for k in ("full", "diff")},
        }
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/bench_spine.yaml")
    parser.add_argument("--intervals", type=int, default=24)
    parser.add_argument("--every", type=int, default=10, help="steps per checkpoint interval")
    parser.add_argument("--codec", default=None, help="row codec (default: config, else adaptive)")
    parser.add_argument(
        "--bits", type=int, default=None, help="code width (default: config, else 4)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any checkpoint setting, e.g. --set optimizer_codec=log8 (YAML value)",
    )
    parser.add_argument(
        "--keep",
        default=None,
        help="write the checkpoints here and keep them (default: a temp dir)",
    )
    args = parser.parse_args()
    cfg = load_yaml(args.config, DemoConfig)
    checkpoint = checkpoint_config(args.config, args.codec, args.bits, args.set)
    cfg = dataclasses.replace(cfg, checkpoint=checkpoint)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        measured = measure(
            cfg,
            args.keep or scratch,
            policy_configs(checkpoint),
            Schedule(args.intervals, args.every),
        )
    runtime_s = time.perf_counter() - started
    runs, counts, rel_l2 = measured["runs"], measured["counts"], measured["rel_l2"]
    fp32 = runs["full"][0]["full_fp32_bytes"]
    codec = f"{checkpoint.bits}-bit {checkpoint.codec}"
    table = policy_table(runs, rel_l2)
    for policy, records in runs.items():
        print(
            f"{policy:>13}: {table[policy]['mean_bytes_per_interval'] / 1e6:8.2f} MB per interval "
            f"({table[policy]['write_reduction_x']:5.1f}x below fp32), "
            f"{table[policy]['full_checkpoints']} fulls, held at the end "
            f"{records[-1]['storage_held_bytes'] / 1e6:8.2f} MB, "
            f"restored rel l2 {table[policy]['restored_rel_l2']:.4f}"
        )
    keep_all_fp32 = fp32 * len(runs["full"])
    # The oracle searches fulls and one-shot diffs: Check-N-Run's schedule space, which the
    # one-shot-only intermittent run shares (with incremental diffs allowed, one full and then
    # only incremental diffs would write least, whatever restores cost).
    oracle = oracle_of(runs, counts["intermittent_one_shot"], fp32, "intermittent_one_shot")
    intermittent = table["intermittent"]
    summary = {
        "codec": codec,
        "checkpoint_config": {
            k: v for k, v in dataclasses.asdict(checkpoint).items() if k != "policy"
        },
        "full_fp32_bytes": fp32,
        "mean_touched_fraction": sum(r["touched_fraction"] for r in runs["full"][1:])
        / max(len(runs["full"]) - 1, 1),
        "write_reduction_x": intermittent["write_reduction_x"],
        "storage_reduction_x": keep_all_fp32 / runs["intermittent"][-1]["storage_held_bytes"],
        "bytes_per_written_row": intermittent["bytes_per_written_row_diff"],
        "restored_rel_l2": intermittent["restored_rel_l2"],
        "whole_row_rel_l2": table["full"]["restored_rel_l2"],
        "rel_l2_no_worse": intermittent["restored_rel_l2"] <= table["full"]["restored_rel_l2"],
        "oracle_write_reduction_x": oracle["write_reduction_x"],
        "one_shot_intermittent_write_reduction_x": table["intermittent_one_shot"][
            "write_reduction_x"
        ],
        "intermittent_schedule": schedule_string(parents_of(runs["intermittent"])),
        "runtime_s": runtime_s,
    }
    byte_budget = {k: intermittent["byte_budget"][k] for k in ("full", "diff")}
    plots = _plots(runs, codec, RESULTS)
    path = write_result(
        "policies",
        {
            "args": vars(args),
            "runs": runs,
            "table": table,
            "byte_budget": byte_budget,
            "oracle": oracle,
            "summary": summary,
            "plots": [p.name for p in plots],
        },
    )
    print(format_budget({k: v for k, v in byte_budget.items() if v is not None}))
    print(
        f"oracle {oracle['schedule']} {oracle['write_reduction_x']:.1f}x; one-shot intermittent "
        f"{oracle['intermittent_schedule']} {oracle['intermittent_actual_write_reduction_x']:.1f}x "
        f"(priced alike: {oracle['intermittent_priced_write_reduction_x']:.1f}x)"
    )
    print(summary)
    print(f"wrote {path} and {', '.join(str(p) for p in plots)}")


if __name__ == "__main__":
    main()
