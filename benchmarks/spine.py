"""Bytes and save time of embckpt's lossless policies beside torch.distributed.checkpoint.

Trains the workload of ``configs/bench_spine.yaml`` on 2 gloo ranks once per policy (full,
one_shot, incremental) with a checkpoint every ``checkpoint_every`` steps, and once more saving
the same model and optimizer state with ``dcp.save`` at the same steps. Writes
``benchmarks/results/spine.json``.

Run: ``.venv/bin/python benchmarks/spine.py [--config configs/bench_spine.yaml]``
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from common import build_workload, write_result  # noqa: E402

from embckpt.config import load_yaml
from embckpt.examples.launcher import run_ranks  # noqa: E402
from embckpt.examples.workload import DemoConfig  # noqa: E402


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _worker(rank: int, world_size: int, cfg: DemoConfig, root: str, mode: str) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from embckpt import Checkpointer

    work = build_workload(rank, world_size, cfg)
    model, optimizer = work.model, work.optimizer
    checkpoints: list[dict[str, Any]] = []
    step_times: list[float] = []
    ckpt = None
    if mode != "dcp":
        config = dataclasses.replace(cfg.checkpoint, policy=mode)
        ckpt = Checkpointer(model, f"{root}/{mode}", optimizer=optimizer, config=config)
    for step in range(1, cfg.steps + 1):
        started = time.perf_counter()
        work.step()
        step_times.append(time.perf_counter() - started)
        if step % cfg.checkpoint_every:
            continue
        dist.barrier()
        started = time.perf_counter()
        if ckpt is not None:
            manifest = ckpt.save(step).wait()
            seconds = time.perf_counter() - started
            assert manifest is not None
            checkpoints.append(
                {
                    "step": step,
                    "kind": manifest.kind,
                    "bytes": manifest.total_bytes,
                    "rows": manifest.rows_written,
                    "save_s": seconds,
                    "dirty_fraction": manifest.stats["dirty_fraction"],
                }
            )
        else:
            state = {
                "model": model.state_dict(),
                "optim": model.fused_optimizer.state_dict(),
                "dense_optim": optimizer.state_dict(),
            }
            path = Path(root) / "dcp" / f"step_{step}"
            dcp.save(state, checkpoint_id=str(path))
            dist.barrier()
            seconds = time.perf_counter() - started
            checkpoints.append(
                {
                    "step": step,
                    "kind": "dcp",
                    "save_s": seconds,
                    "bytes": _dir_bytes(path) if rank == 0 else None,
                }
            )
    if ckpt is not None:
        ckpt.close()
    return {"checkpoints": checkpoints, "median_step_s": sorted(step_times)[len(step_times) // 2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/bench_spine.yaml")
    args = parser.parse_args()
    cfg = load_yaml(args.config, DemoConfig)
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as root:
        for mode in ("full", "one_shot", "incremental", "dcp"):
            results = run_ranks(_worker, cfg.world_size, cfg, root, mode)
            # Save time is the slowest rank's: a checkpoint is done when every rank is.
            per_ckpt = results[0]["checkpoints"]
            for i, entry in enumerate(per_ckpt):
                entry["save_s"] = max(r["checkpoints"][i]["save_s"] for r in results)
            runs[mode] = {
                "checkpoints": per_ckpt,
                "bytes_written": sum(c["bytes"] for c in per_ckpt),
                "mean_save_s": sum(c["save_s"] for c in per_ckpt) / len(per_ckpt),
                "median_step_s": results[0]["median_step_s"],
            }
            print(
                f"{mode:>12}: {runs[mode]['bytes_written'] / 1e6:9.1f} MB written, "
                f"mean save {runs[mode]['mean_save_s']:.3f} s"
            )
    full_bytes = runs["full"]["checkpoints"][0]["bytes"]
    dcp_bytes = runs["dcp"]["checkpoints"][0]["bytes"]
    summary = {
        "full_checkpoint_bytes": full_bytes,
        "dcp_checkpoint_bytes": dcp_bytes,
        "full_vs_dcp_bytes": full_bytes / dcp_bytes,
        "one_shot_write_reduction_x": runs["full"]["bytes_written"]
        / runs["one_shot"]["bytes_written"],
        "incremental_write_reduction_x": runs["full"]["bytes_written"]
        / runs["incremental"]["bytes_written"],
        "full_save_s": runs["full"]["mean_save_s"],
        "one_shot_save_s": runs["one_shot"]["mean_save_s"],
        "dcp_save_s": runs["dcp"]["mean_save_s"],
    }
    path = write_result(
        "spine",
        {
            "config": args.config,
            "workload": dataclasses.asdict(cfg),
            "runs": runs,
            "summary": summary,
        },
    )
    print(summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
