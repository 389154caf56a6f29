"""Many small tables: files per checkpoint and full-save time, packed rows files beside DCP.

2 gloo ranks build a DLRM with ``--tables`` tables (60) of ``--rows`` rows (1,000) and
``--dim``-dim rows (16), row-wise Adagrad fused into the embedding kernels, train a few steps,
then run ``--repeats`` rounds (5). Each round trains 2 more steps and times, on the same state,
in an order rotating by round: our full save (``policy="full"``, the default ``raw`` codec,
small blocks packed: ``pack_below_bytes`` at its default), the same without packing
(``pack_below_bytes=0``, what format 3 wrote) and ``dcp.save`` of the model, the fused
optimizer state and the dense optimizer (same writer threads, fsync on). Each operation starts
after a barrier and ends when every rank is done: its time is the slowest rank's.

Files per rank per checkpoint are counted from the manifests (each path once, dense and rank
files included) for a full and a one-shot diff, under the default codec and under
``adaptive`` (4 bits, delta diffs: delta rows and rows written whole are two schemas); DCP's
from its folder (its ``.metadata`` counted once, for rank 0).

Writes ``benchmarks/results/many_tables.json``.

Run: ``.venv/bin/python benchmarks/many_tables.py [--tables 60] [--rows 1000] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from common import build_workload, dcp_save, dcp_state, spread, write_result  # noqa: E402

from embckpt.config import CheckpointConfig  # noqa: E402
from embckpt.cores import writer_threads  # noqa: E402
from embckpt.examples.launcher import run_ranks  # noqa: E402
from embckpt.examples.workload import DemoConfig, WorkloadConfig  # noqa: E402

WORLD = 2
WARMUP_STEPS = 3
SAVES = ("ours_save", "ours_unpacked_save", "dcp_save")


def _config(tables: int, rows: int, dim: int) -> DemoConfig:
    workload = WorkloadConfig(
        cardinalities=(rows,) * tables,
        embedding_dim=dim,
        dense_arch=(32, dim),
        over_arch=(32, 1),
        num_samples=8192,
        batch_size=256,
    )
    return DemoConfig(workload=workload, checkpoint=CheckpointConfig(), world_size=WORLD)


def _files_per_rank(ckpt: Any, manifest: Any) -> dict[int, int]:
    """Files each rank wrote, from every rank's part (a save's manifest lists this rank's rows
    files only)."""
    from embckpt.storage.chain import read_manifest

    paths: dict[int, set[str]] = {}
    for entry in read_manifest(ckpt.store, manifest.step).files:
        paths.setdefault(entry.rank, set()).add(entry.path)
    return {rank: len(p) for rank, p in sorted(paths.items())}


def _dcp_files_per_rank(path: str) -> dict[int, int]:
    """DCP's data files are ``__<rank>_<n>.distcp``; ``.metadata`` is rank 0's."""
    counts: dict[int, int] = {}
    for file in Path(path).iterdir():
        if file.name.startswith("__") and file.suffix == ".distcp":
            rank = int(file.name[2:].split("_", 1)[0])
            counts[rank] = counts.get(rank, 0) + 1
        elif file.name == ".metadata":
            counts[0] = counts.get(0, 0) + 1
    return dict(sorted(counts.items()))


def _worker(rank: int, world_size: int, cfg: DemoConfig, root: str, repeats: int) -> dict:
    import torch.distributed as dist

    from embckpt import Checkpointer

    work = build_workload(rank, world_size, cfg)
    model, optimizer = work.model, work.optimizer
    for _ in range(WARMUP_STEPS):
        work.step()
    base = cfg.checkpoint
    checkpointers = {
        "ours_save": Checkpointer(
            model,
            f"{root}/full",
            optimizer=optimizer,
            config=dataclasses.replace(base, policy="full"),
        ),
        "ours_unpacked_save": Checkpointer(
            model,
            f"{root}/unpacked",
            optimizer=optimizer,
            config=dataclasses.replace(base, policy="full", pack_below_bytes=0),
        ),
    }
    seconds: dict[str, list[float]] = {name: [] for name in SAVES}
    files: dict[str, Any] = {}

    def timed(name: str, operation: Callable[[], Any]) -> Any:
        dist.barrier()
        started = time.perf_counter()
        result = operation()
        dist.barrier()
        seconds[name].append(time.perf_counter() - started)
        return result

    step = WARMUP_STEPS
    for turn in range(repeats):
        for _ in range(2):
            work.step()
        step += 2
        dcp_dir = f"{root}/dcp/step_{step}"
        saves: dict[str, Callable[[], Any]] = {
            "ours_save": lambda s=step: checkpointers["ours_save"].save(s).wait(),
            "ours_unpacked_save": lambda s=step: checkpointers["ours_unpacked_save"].save(s).wait(),
            "dcp_save": lambda d=dcp_dir: dcp_save(
                dcp_state(model, optimizer), d, writer_threads(base.io_threads)
            ),
        }
        for name in SAVES[turn % 3 :] + SAVES[: turn % 3]:
            manifest = timed(name, saves[name])
            if name != "dcp_save":
                files[f"{name}_full"] = _files_per_rank(checkpointers[name], manifest)
        files["dcp_save"] = _dcp_files_per_rank(dcp_dir)
    for ckpt in checkpointers.values():
        ckpt.close()
    # Files of a full and a one-shot diff, default codec and adaptive (not timed).
    for codec, options in (("raw", {}), ("adaptive", {"codec": "adaptive", "bits": 4})):
        for packing, pack in (("packed", {}), ("unpacked", {"pack_below_bytes": 0})):
            config = dataclasses.replace(base, policy="one_shot", full_every=0, **options, **pack)
            with Checkpointer(
                model, f"{root}/{codec}_{packing}", optimizer=optimizer, config=config
            ) as ckpt:
                step += 1
                full = ckpt.save(step).wait()
                for _ in range(2):
                    work.step()
                step += 2
                diff = ckpt.save(step).wait()
                assert full is not None and diff is not None and diff.kind == "diff"
                files[f"{codec}_{packing}_full"] = _files_per_rank(ckpt, full)
                files[f"{codec}_{packing}_diff"] = _files_per_rank(ckpt, diff)
    return {"seconds": seconds, "files": files}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", type=int, default=60)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a tmp dir)")
    parser.add_argument("--timeout", type=float, default=1200)
    args = parser.parse_args()
    cfg = _config(args.tables, args.rows, args.dim)
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        results = run_ranks(_worker, WORLD, cfg, root, args.repeats, timeout_s=args.timeout)
    # An operation's time is the slowest rank's (both ranks time between the same barriers).
    slowest = {
        name: [max(r["seconds"][name][i] for r in results) for i in range(args.repeats)]
        for name in SAVES
    }
    spreads = {name: spread(values) for name, values in slowest.items()}
    medians = {name: statistics.median(values) for name, values in slowest.items()}
    files = results[0]["files"]
    result = {
        "workload": {
            "tables": args.tables,
            "rows_per_table": args.rows,
            "dim": args.dim,
            "optimizer": "row-wise Adagrad (fused)",
            "ranks": WORLD,
            "sharding": "the planner's default",
            "repeats": args.repeats,
        },
        "save_seconds_median": medians,
        "save_seconds": spreads,
        "save_vs_dcp": medians["ours_save"] / medians["dcp_save"],
        "unpacked_save_vs_dcp": medians["ours_unpacked_save"] / medians["dcp_save"],
        "files_per_rank": files,
        "notes": "files per rank count each path once: rows files, the rank file, and on rank 0 "
        "the dense file (embckpt) or .metadata (DCP); times are the slowest rank's, fsync on",
    }
    path = write_result("many_tables", result)
    print(f"wrote {path}")
    for name, value in medians.items():
        print(f"{name:>20}: {value:.3f} s median")
    print(f"save vs dcp.save: {result['save_vs_dcp']:.2f}x")
    for name, per_rank in files.items():
        print(f"{name:>24}: files per rank {per_rank}")


if __name__ == "__main__":
    main()
