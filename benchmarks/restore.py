"""Restore time and bytes read: embckpt beside ``dcp.load`` of the same model, same plan and
resharded.

For each world size W in ``--worlds`` (default 1, 2, 4), W gloo ranks train the workload of
``configs/bench_spine.yaml`` (row-wise Adagrad; the spine plan made valid for W), write a full
checkpoint and then 5 incremental diffs (a chain of 6, lossless), and save the same model,
fused optimizer and dense optimizer state with ``dcp.save``. Then, into the live model, they
time (slowest rank; median, min and max of ``--repeats`` rounds, each round running the three
in turn so that their ratios come from one run; restores also per phase):

* ``full``  - restoring the full checkpoint;
* ``chain`` - restoring the last diff (full + 5 diffs applied in order);
* ``dcp``   - ``dcp.load`` of the DCP checkpoint (model, fused and dense optimizer state).

Resharded: the chain written by 2 ranks is restored onto W ranks with another plan (every
specially sharded table changes type: row-wise -> column-wise, table-wise -> row-wise,
column-wise -> row-wise, table-row-wise -> table-wise), beside the same-plan chain restore of
the W-rank job's own chain. Bytes: ``bytes_read`` counts the rows files' bytes a rank fetched
(footers and row groups), ``bytes_needed`` the bytes of exactly the rows and columns its
blocks take from those files; ``rchar`` is the rank's read-syscall bytes (``/proc/self/io``):
DCP's reads, but not embckpt's (it memory-maps local files, so only manifests and dense files
show there). Files are read from the page cache (written just before) in both cases. Writes
``benchmarks/results/restore.json``.

Run: ``.venv/bin/python benchmarks/restore.py [--config configs/bench_spine.yaml]``
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from common import write_result  # noqa: E402

from embckpt.config import load_yaml
from embckpt.examples.launcher import run_ranks  # noqa: E402
from embckpt.examples.workload import DemoConfig  # noqa: E402

EVERY = 4  # training steps between checkpoints
DIFFS = 5
ROW_GROUP_ROWS = 8192  # finer than the default so that resharded reads stay near their rows


def _sharding(world_size: int, resharded: bool) -> dict[str, str]:
    """The spine plan, valid for ``world_size``; ``resharded`` changes every special table."""
    if resharded:
        return {
            "t_cat_0": "column_wise",
            "t_cat_1": "row_wise",
            "t_cat_2": "row_wise",
            "t_cat_3": f"table_wise:{world_size // 2}",
            "t_cat_5": "data_parallel",
        }
    return {
        "t_cat_0": "row_wise",
        "t_cat_1": f"table_wise:{world_size - 1}",
        "t_cat_2": "column_wise",
        "t_cat_3": "table_row_wise",
        "t_cat_5": "data_parallel",
    }


def _rchar() -> int:
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _interleaved(
    fns: dict[str, Callable[[], Any]], repeats: int
) -> dict[str, list[dict[str, Any]]]:
    """Runs each of ``fns`` once per round, ``repeats`` rounds (full, chain, dcp, full, ...),
    between barriers, so that their ratios come from the same moments of one run; seconds and
    read bytes of each run."""
    import torch.distributed as dist

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            dist.barrier()
            chars, started = _rchar(), time.perf_counter()
            value = fn()
            seconds = time.perf_counter() - started
            runs[name].append({"seconds": seconds, "rchar": _rchar() - chars, "value": value})
            dist.barrier()
    return runs


def _restore_stats(result: Any) -> dict[str, Any]:
    cost = result.cost
    return {
        "chain": list(result.chain),
        "bytes_read": cost.bytes_read,
        "bytes_needed": cost.bytes_needed,
        "ratio": cost.ratio,
        "row_groups": cost.row_groups,
        "files": cost.files,
        "other_bytes": cost.other_bytes,
        "stage_s": result.stage_seconds,
        "phases": dict(result.phases),
    }


def _worker(
    rank: int, world_size: int, cfg: DemoConfig, root: str, repeats: int, threads: int | None
) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from embckpt import Checkpointer
    from embckpt.data import ResumableSampler
    from embckpt.examples.demo import load_dataset
    from embckpt.examples.launcher import rank_device
    from embckpt.examples.model import build_model, make_batch, train_step
    from embckpt.storage.fs import CheckpointStore

    device = rank_device(rank)
    own = dataclasses.replace(cfg.workload, sharding=_sharding(world_size, False))
    dataset = load_dataset(cfg)
    sampler = ResumableSampler(
        len(dataset), own.batch_size, rank=rank, world_size=world_size, seed=0
    )
    model, optimizer = build_model(own, device, world_size)
    config = dataclasses.replace(
        cfg.checkpoint,
        policy="incremental",
        full_every=0,
        pipeline="off",
        row_group_rows=ROW_GROUP_ROWS,
    )
    directory = f"{root}/w{world_size}"
    steps = []
    with Checkpointer(model, directory, optimizer=optimizer, config=config) as ckpt:
        for step in range(1, EVERY * (DIFFS + 1) + 1):
            train_step(model, optimizer, make_batch(dataset, next(sampler), own, device))
            if step % EVERY == 0:
                ckpt.save(step).wait()
                steps.append(step)
        full, last = steps[0], steps[-1]

        def dcp_state() -> dict[str, Any]:
            return {
                "model": model.state_dict(),
                "optim": model.fused_optimizer.state_dict(),
                "dense_optim": optimizer.state_dict(),
            }

        dcp_dir = f"{root}/dcp_w{world_size}"
        dcp.save(dcp_state(), checkpoint_id=dcp_dir)
        dist.barrier()

        def dcp_load() -> None:
            state = dcp_state()
            dcp.load(state, checkpoint_id=dcp_dir)
            optimizer.load_state_dict(state["dense_optim"])

        out: dict[str, Any] = dict(
            _interleaved(
                {
                    "full": lambda: _restore_stats(ckpt.load(full, threads=threads)),
                    "chain": lambda: _restore_stats(ckpt.load(last, threads=threads)),
                    "dcp": dcp_load,
                },
                repeats,
            )
        )
    if rank == 0:
        out["embckpt_chain_bytes"] = _dir_bytes(Path(directory))
        out["embckpt_full_bytes"] = _dir_bytes(Path(directory) / f"step_{full:012d}")
        out["dcp_bytes"] = _dir_bytes(Path(dcp_dir))
    del model, optimizer
    # Resharded: the chain the 2-rank job wrote, onto this world size under another plan.
    source = f"{root}/w2"
    steps = CheckpointStore(source).committed_steps()
    if steps:
        other = dataclasses.replace(cfg.workload, sharding=_sharding(world_size, True))
        model, optimizer = build_model(other, device, world_size)
        with Checkpointer(model, source, optimizer=optimizer, config=config) as ckpt:
            resharded = _interleaved(
                {
                    "resharded_chain": lambda: _restore_stats(
                        ckpt.load(steps[-1], threads=threads)
                    ),
                    "resharded_full": lambda: _restore_stats(ckpt.load(steps[0], threads=threads)),
                },
                repeats,
            )
            out.update(resharded)
    return out


def _summarise(results: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Median and spread over repeats of the slowest rank; bytes of each rank; restores: the
    median over repeats of each phase's slowest rank."""
    repeats = len(results[0][key])
    seconds = [max(r[key][i]["seconds"] for r in results) for i in range(repeats)]
    summary: dict[str, Any] = {
        "seconds": statistics.median(seconds),
        "seconds_min_max": [min(seconds), max(seconds)],
        "seconds_each_repeat": seconds,
        "rchar_per_rank": [r[key][0]["rchar"] for r in results],
    }
    value = results[0][key][0]["value"]
    if value is not None:
        per_rank = [r[key][0]["value"] for r in results]
        summary["phases"] = {
            phase: statistics.median(
                max(r[key][i]["value"]["phases"].get(phase, 0.0) for r in results)
                for i in range(repeats)
            )
            for phase in value["phases"]
        }
        summary.update(
            chain=value["chain"],
            bytes_read_per_rank=[v["bytes_read"] for v in per_rank],
            bytes_needed_per_rank=[round(v["bytes_needed"]) for v in per_rank],
            max_ratio=max(v["ratio"] for v in per_rank),
            row_groups_per_rank=[v["row_groups"] for v in per_rank],
        )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/bench_spine.yaml")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 1, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=None, help="reader threads per rank (default: a share)"
    )
    args = parser.parse_args()
    cfg = load_yaml(args.config, DemoConfig)
    worlds = sorted(set(args.worlds), key=lambda w: (w != 2, w))  # 2 first: the others reshard it
    load_before = os.getloadavg()
    runs: dict[str, Any] = {}
    resharded: dict[str, Any] = {}
    table = []
    with tempfile.TemporaryDirectory() as root:
        for world_size in worlds:
            started = time.perf_counter()
            results = run_ranks(_worker, world_size, cfg, root, args.repeats, args.threads)
            run: dict[str, Any] = {k: _summarise(results, k) for k in ("full", "chain", "dcp")}
            run.update(
                embckpt_full_bytes=results[0]["embckpt_full_bytes"],
                embckpt_chain_bytes=results[0]["embckpt_chain_bytes"],
                dcp_bytes=results[0]["dcp_bytes"],
                wall_s=time.perf_counter() - started,
            )
            runs[f"w{world_size}"] = run
            if "resharded_chain" in results[0]:
                resharded[f"2->{world_size}"] = {
                    "chain": _summarise(results, "resharded_chain"),
                    "full": _summarise(results, "resharded_full"),
                    "same_plan_chain_s": run["chain"]["seconds"],
                }
            table.append(
                {
                    "ranks": world_size,
                    "full_restore_s": run["full"]["seconds"],
                    "chain_restore_s": run["chain"]["seconds"],
                    "dcp_load_s": run["dcp"]["seconds"],
                    "max_bytes_read_ratio": max(
                        run["full"]["max_ratio"], run["chain"]["max_ratio"]
                    ),
                    "resharded_from_2_chain_s": resharded.get(f"2->{world_size}", {})
                    .get("chain", {})
                    .get("seconds"),
                    "resharded_max_bytes_read_ratio": resharded.get(f"2->{world_size}", {})
                    .get("chain", {})
                    .get("max_ratio"),
                }
            )
            print(table[-1])
    main_run = runs.get("w2") or next(iter(runs.values()))
    same_plan_ratios = [runs[w][k]["max_ratio"] for w in runs for k in ("full", "chain")]
    summary = {
        "ranks": 2 if "w2" in runs else worlds[0],
        "full_restore_s": main_run["full"]["seconds"],
        "chain_restore_s": main_run["chain"]["seconds"],
        "dcp_load_s": main_run["dcp"]["seconds"],
        "bytes_read_ratio": max(same_plan_ratios),
        "bytes_read_ratio_resharded": max(
            (r["chain"]["max_ratio"] for r in resharded.values()), default=None
        ),
        "full_at_or_below_dcp": all(
            r["full"]["seconds"] <= r["dcp"]["seconds"] for r in runs.values()
        ),
        "chain_at_or_below_dcp": all(
            r["chain"]["seconds"] <= r["dcp"]["seconds"] for r in runs.values()
        ),
        "resharded_vs_same_plan_chain": {
            k: r["chain"]["seconds"] / r["same_plan_chain_s"] for k, r in resharded.items()
        },
        "full_vs_dcp": main_run["full"]["seconds"] / main_run["dcp"]["seconds"],
        "chain_vs_dcp": main_run["chain"]["seconds"] / main_run["dcp"]["seconds"],
        "full_phases_s": main_run["full"]["phases"],
        "chain_phases_s": main_run["chain"]["phases"],
    }
    path = write_result(
        "restore",
        {
            "config": args.config,
            "method": {
                "checkpoints": f"full + {DIFFS} incremental diffs, every {EVERY} steps, raw",
                "row_group_rows": ROW_GROUP_ROWS,
                "threads_per_rank": args.threads or "default: cores / local ranks, 1 to 8",
                "repeats": args.repeats,
                "seconds": "median (and min, max) over repeats of the slowest rank, barrier "
                "to barrier; repeats interleaved (full, chain, dcp, full, ...)",
                "phases": "RestoreResult.phases: busy seconds of plan, fetch, verify, decode, "
                "apply summed over a rank's threads; median over repeats of the slowest rank",
                "cache": "warm page cache for both embckpt and DCP (files written just before)",
                "rchar": "read-syscall bytes; embckpt memory-maps rows files, so its rchar "
                "leaves them out: see bytes_read_per_rank",
                "integrity": "embckpt checks the SHA-256 of every byte it decodes; dcp.load "
                "checks none",
                "load_average_before_after": [load_before[0], os.getloadavg()[0]],
            },
            "workload": dataclasses.asdict(cfg.workload),
            "table": table,
            "runs": runs,
            "resharded": resharded,
            "summary": summary,
        },
    )
    print(summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
