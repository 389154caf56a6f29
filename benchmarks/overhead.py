"""What checkpointing costs training: per-iteration times for each way of checkpointing.

One 2-rank run of the workload in ``configs/bench_spine.yaml`` (by default) goes through these
phases on the same model, each ``--steps`` iterations with a checkpoint every ``--interval``:

- ``none``: no checkpoints (the baseline, measured before and after the others);
- ``sync``: embckpt with ``pipeline="off"`` (save returns once committed);
- ``persist``: snapshot on the training thread, persist in the background;
- ``full``: snapshot copy and persist in the background, weight updates wait for the copy;
- ``dcp_async``: ``torch.distributed.checkpoint.async_save`` of the same state, one in flight;
- ``adaptive``: embckpt ``maybe_save`` choosing the interval for a 2% stall bound.

Phases without checkpoints run before, in the middle of and after the others; their pooled
median iteration time is the baseline.

Stall per checkpoint = (time of the phase - baseline iteration time x iterations) / checkpoints,
so it counts both the time ``save`` blocks and the slowdown of iterations that overlap a
background persist (on a 2-core machine the persist competes with training for the cores).
Writes ``benchmarks/results/overhead.json``.
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

sys.path.insert(0, str(Path(__file__).parent))

from common import build_workload, write_result  # noqa: E402

from embckpt.config import load_yaml
from embckpt.examples.launcher import run_ranks  # noqa: E402
from embckpt.examples.workload import DemoConfig  # noqa: E402


def _worker(
    rank: int,
    world_size: int,
    cfg: DemoConfig,
    root: str,
    steps: int,
    interval: int,
    adaptive_steps: int,
) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from embckpt import Checkpointer
    from embckpt.examples.model import make_batch, train_step

    work = build_workload(rank, world_size, cfg)
    model, optimizer = work.model, work.optimizer
    batches = [
        make_batch(work.dataset, next(work.sampler), cfg.workload, work.device) for _ in range(64)
    ]
    step = 0

    def run(n: int, after_step) -> list[float]:
        nonlocal step
        times = []
        dist.barrier()
        for _ in range(n):
            step += 1
            started = time.perf_counter()
            train_step(model, optimizer, batches[step % len(batches)])
            after_step(step)
            times.append(time.perf_counter() - started)
        return times

    phases: dict[str, Any] = {}
    run(60, lambda s: None)  # warm-up: the first iterations are slower (allocator, caches)
    phases["none"] = {"times": run(steps, lambda s: None), "checkpoints": 0}
    for mode in ("sync", "persist", "full"):
        pipeline = {"sync": "off", "persist": "persist", "full": "full"}[mode]
        config = dataclasses.replace(cfg.checkpoint, pipeline=pipeline, adaptive_interval=False)
        ckpt = Checkpointer(model, f"{root}/{mode}", optimizer=optimizer, config=config)
        blocked: list[float] = []

        def save(s: int, ckpt=ckpt, blocked=blocked) -> None:
            if s % interval == 0:
                blocked.append(ckpt.save(s).blocked_s)

        times = run(steps, save)
        ckpt.close()
        phases[mode] = {"times": times, "checkpoints": len(blocked), "blocked_s": blocked}

    group = dist.new_group(backend="gloo")
    pending: list[Any] = []
    blocked = []

    def dcp_save(s: int) -> None:
        if s % interval:
            return
        started = time.perf_counter()
        if pending:
            pending.pop().result()
        state = {
            "model": model.state_dict(),
            "optim": model.fused_optimizer.state_dict(),
            "dense_optim": optimizer.state_dict(),
        }
        path = f"{root}/dcp/step_{s}"
        pending.append(
            dcp.async_save(state, storage_writer=FileSystemWriter(path), process_group=group)
        )
        blocked.append(time.perf_counter() - started)

    times = run(steps, dcp_save)
    if pending:
        pending.pop().result()
    phases["dcp_async"] = {"times": times, "checkpoints": len(blocked), "blocked_s": blocked}
    phases["none_mid"] = {"times": run(steps, lambda s: None), "checkpoints": 0}

    config = dataclasses.replace(
        cfg.checkpoint, pipeline="full", adaptive_interval=True, interval=interval, stall_bound=0.02
    )
    ckpt = Checkpointer(model, f"{root}/adaptive", optimizer=optimizer, config=config)
    saved: list[int] = []

    def maybe(s: int) -> None:
        if ckpt.maybe_save(s) is not None:
            saved.append(s)

    first_step = step + 1
    times = run(adaptive_steps, maybe)
    ckpt.close()
    phases["adaptive"] = {
        "times": times,
        "checkpoints": len(saved),
        "saved_steps": saved,
        "first_step": first_step,
        "interval": ckpt.interval.interval,
        "interval_history": ckpt.interval.history,
    }
    phases["none_after"] = {"times": run(steps, lambda s: None), "checkpoints": 0}
    return phases


def _stall(phase: dict[str, Any], baseline_s: float) -> dict[str, float | None]:
    total = sum(phase["times"])
    extra = total - baseline_s * len(phase["times"])
    per_ckpt = extra / phase["checkpoints"] if phase["checkpoints"] else None
    return {
        "total_s": total,
        "stall_pct": 100 * extra / (baseline_s * len(phase["times"])),
        "stall_per_ckpt_s": per_ckpt,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/bench_spine.yaml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--adaptive-steps", type=int, default=2000)
    args = parser.parse_args()
    cfg = load_yaml(args.config, DemoConfig)
    with tempfile.TemporaryDirectory() as root:
        ranks = run_ranks(
            _worker, cfg.world_size, cfg, root, args.steps, args.interval, args.adaptive_steps
        )
    # A step is as slow as its slowest rank.
    phases = {
        name: {
            **ranks[0][name],
            "times": [max(t) for t in zip(*(r[name]["times"] for r in ranks), strict=True)],
        }
        for name in ranks[0]
    }
    # Iteration time drifts over a run on a shared machine: the baseline pools every phase
    # without checkpoints (before, between and after the others).
    baseline = statistics.median(
        phases["none"]["times"] + phases["none_mid"]["times"] + phases["none_after"]["times"]
    )
    table = {}
    for name, phase in phases.items():
        table[name] = {
            **_stall(phase, baseline),
            "checkpoints": phase["checkpoints"],
            "median_iter_s": statistics.median(phase["times"]),
        }
        print(
            f"{name:>10}: median iteration {table[name]['median_iter_s'] * 1e3:7.1f} ms, "
            f"stall {table[name]['stall_pct']:6.2f}% "
            f"({table[name]['stall_per_ckpt_s'] or 0:.3f} s per checkpoint, "
            f"{phase['checkpoints']} checkpoints)"
        )
    # The stall once the interval has adapted: from the first checkpoint taken at the chosen
    # interval to the end of the phase.
    adaptive = phases["adaptive"]
    saved = adaptive["saved_steps"]
    settled_from = saved[1] - adaptive["first_step"] if len(saved) > 1 else 0
    settled = {
        "times": adaptive["times"][settled_from:],
        "checkpoints": len(adaptive["saved_steps"]) - 1,
    }
    table["adaptive_settled"] = {
        **_stall(settled, baseline),
        "checkpoints": settled["checkpoints"],
        "median_iter_s": statistics.median(settled["times"]),
    }
    summary = {
        "baseline_iter_s": baseline,
        "interval": args.interval,
        "adaptive_interval": phases["adaptive"]["interval"],
        "adaptive_stall_pct": table["adaptive_settled"]["stall_pct"],
        "adaptive_stall_pct_including_warmup": table["adaptive"]["stall_pct"],
        "pipelined_stall_per_ckpt_s": table["full"]["stall_per_ckpt_s"],
        "persist_only_stall_per_ckpt_s": table["persist"]["stall_per_ckpt_s"],
        "sync_stall_per_ckpt_s": table["sync"]["stall_per_ckpt_s"],
        "dcp_async_stall_per_ckpt_s": table["dcp_async"]["stall_per_ckpt_s"],
    }
    path = write_result(
        "overhead",
        {
            "config": args.config,
            "args": vars(args),
            "phases": phases,
            "table": table,
            "summary": summary,
        },
    )
    print(summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
