"""Bytes and save time of embckpt's lossless policies beside torch.distributed.checkpoint.

Trains the workload of ``configs/bench_spine.yaml`` on 2 gloo ranks:

- once per policy (full, one_shot, incremental) with a checkpoint every ``checkpoint_every``
  steps: the bytes each policy writes, and where each save's time goes (the manifest's
  ``phase_seconds``, the slowest rank's);
- once more, "interleaved", for the times: one model, and at every checkpoint step our full save,
  our one-shot diff save (a second checkpointer, one_shot with no periodic full) and ``dcp.save``
  of the same state, in an order that rotates from step to step, each started after a barrier
  and timed until every rank is done (``wait()`` / DCP's return, then a barrier). DCP gets the
  same writer threads and fsync as ours. The summary's ``*_save_s`` are medians over those
  steps, with their spread.

Writes ``benchmarks/results/spine.json``.

Run: ``.venv/bin/python benchmarks/spine.py [--config configs/bench_spine.yaml]``
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

from common import (  # noqa: E402
    build_workload,
    dcp_save,
    dcp_state,
    dir_bytes,
    median_phases,
    spread,
    write_result,
)

from embckpt.config import load_yaml  # noqa: E402
from embckpt.cores import writer_threads  # noqa: E402
from embckpt.examples.launcher import run_ranks  # noqa: E402
from embckpt.examples.workload import DemoConfig  # noqa: E402

POLICIES = ("full", "one_shot", "incremental")
TIMED = ("full", "one_shot", "dcp")  # the interleaved run's saves, rotated at each step


def _record(manifest: Any, seconds: float) -> dict[str, Any]:
    return {
        "step": manifest.step,
        "kind": manifest.kind,
        "bytes": manifest.total_bytes,
        "rows": manifest.rows_written,
        "save_s": seconds,
        "dirty_fraction": manifest.stats["dirty_fraction"],
        "phases": manifest.stats["phase_seconds"],
    }


def _policy_worker(rank: int, world_size: int, cfg: DemoConfig, root: str, mode: str) -> dict:
    """One policy over the whole run: its bytes and its saves' phases."""
    import torch.distributed as dist

    from embckpt import Checkpointer

    work = build_workload(rank, world_size, cfg)
    config = dataclasses.replace(cfg.checkpoint, policy=mode)
    checkpoints: list[dict[str, Any]] = []
    step_times: list[float] = []
    with Checkpointer(work.model, f"{root}/{mode}", optimizer=work.optimizer, config=config) as ck:
        for step in range(1, cfg.steps + 1):
            started = time.perf_counter()
            work.step()
            step_times.append(time.perf_counter() - started)
            if step % cfg.checkpoint_every:
                continue
            dist.barrier()
            started = time.perf_counter()
            manifest = ck.save(step).wait()
            assert manifest is not None
            checkpoints.append(_record(manifest, time.perf_counter() - started))
    return {"checkpoints": checkpoints, "median_step_s": statistics.median(step_times)}


def _interleaved_worker(rank: int, world_size: int, cfg: DemoConfig, root: str) -> dict:
    """Our full save, our one-shot diff save and dcp.save of the same state at each step."""
    import torch.distributed as dist

    from embckpt import Checkpointer

    work = build_workload(rank, world_size, cfg)
    model, optimizer = work.model, work.optimizer
    ours = {
        "full": Checkpointer(
            model,
            f"{root}/timed_full",
            optimizer=optimizer,
            config=dataclasses.replace(cfg.checkpoint, policy="full"),
        ),
        # No periodic full: every save after the first is a diff against it.
        "one_shot": Checkpointer(
            model,
            f"{root}/timed_one_shot",
            optimizer=optimizer,
            config=dataclasses.replace(cfg.checkpoint, policy="one_shot", full_every=0),
        ),
    }
    saves: dict[str, list[dict[str, Any]]] = {name: [] for name in TIMED}
    for step in range(1, cfg.steps + 1):
        work.step()
        if step % cfg.checkpoint_every:
            continue
        turn = step // cfg.checkpoint_every
        for name in TIMED[turn % 3 :] + TIMED[: turn % 3]:
            dist.barrier()
            started = time.perf_counter()
            if name == "dcp":
                path = f"{root}/dcp/step_{step}"
                dcp_save(
                    dcp_state(model, optimizer), path, writer_threads(cfg.checkpoint.io_threads)
                )
                dist.barrier()
                entry = {
                    "step": step,
                    "kind": "dcp",
                    "save_s": time.perf_counter() - started,
                    "bytes": dir_bytes(path) if rank == 0 else None,
                }
            else:
                manifest = ours[name].save(step).wait()
                dist.barrier()
                assert manifest is not None
                entry = _record(manifest, time.perf_counter() - started)
            entry["order"] = len([s for s in saves.values() if s and s[-1]["step"] == step])
            saves[name].append(entry)
    for ckpt in ours.values():
        ckpt.close()
    return saves


def _slowest(results: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rank 0's records with each save's time the slowest rank's: a checkpoint is done when
    every rank is."""
    merged = results[0]
    for i, entry in enumerate(merged):
        entry["save_s"] = max(r[i]["save_s"] for r in results)
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/bench_spine.yaml")
    args = parser.parse_args()
    cfg = load_yaml(args.config, DemoConfig)
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as root:
        for mode in POLICIES:
            results = run_ranks(_policy_worker, cfg.world_size, cfg, root, mode)
            per_ckpt = _slowest([r["checkpoints"] for r in results])
            runs[mode] = {
                "checkpoints": per_ckpt,
                "bytes_written": sum(c["bytes"] for c in per_ckpt),
                "mean_save_s": sum(c["save_s"] for c in per_ckpt) / len(per_ckpt),
                "median_step_s": results[0]["median_step_s"],
                "phase_seconds_median": {
                    kind: median_phases([c["phases"] for c in per_ckpt if c["kind"] == kind])
                    for kind in ("full", "diff")
                    if any(c["kind"] == kind for c in per_ckpt)
                },
            }
            print(
                f"{mode:>12}: {runs[mode]['bytes_written'] / 1e6:9.1f} MB written, "
                f"mean save {runs[mode]['mean_save_s']:.3f} s"
            )
        results = run_ranks(_interleaved_worker, cfg.world_size, cfg, root)
    timed = {name: _slowest([r[name] for r in results]) for name in TIMED}
    # The one-shot checkpointer's first save is its base full: only its diffs are timed.
    timed_s = {
        "full": [c["save_s"] for c in timed["full"]],
        "one_shot": [c["save_s"] for c in timed["one_shot"] if c["kind"] == "diff"],
        "dcp": [c["save_s"] for c in timed["dcp"]],
    }
    spreads = {name: spread(values) for name, values in timed_s.items()}
    runs["interleaved"] = {
        "saves": timed,
        "save_s": spreads,
        "phase_seconds_median": {
            "full": median_phases([c["phases"] for c in timed["full"]]),
            "one_shot": median_phases(
                [c["phases"] for c in timed["one_shot"] if c["kind"] == "diff"]
            ),
        },
    }
    runs["dcp"] = {
        "checkpoints": timed["dcp"],
        "bytes_written": sum(c["bytes"] for c in timed["dcp"]),
        "mean_save_s": sum(timed_s["dcp"]) / len(timed_s["dcp"]),
    }
    full_bytes = runs["full"]["checkpoints"][0]["bytes"]
    dcp_bytes = runs["dcp"]["checkpoints"][0]["bytes"]
    full_s = spreads["full"]["median"]
    dcp_s = spreads["dcp"]["median"]
    one_shot_s = spreads["one_shot"]["median"] if spreads["one_shot"] else None
    summary = {
        "full_checkpoint_bytes": full_bytes,
        "dcp_checkpoint_bytes": dcp_bytes,
        "full_vs_dcp_bytes": full_bytes / dcp_bytes,
        "one_shot_write_reduction_x": runs["full"]["bytes_written"]
        / runs["one_shot"]["bytes_written"],
        "incremental_write_reduction_x": runs["full"]["bytes_written"]
        / runs["incremental"]["bytes_written"],
        "full_save_s": full_s,
        "one_shot_save_s": one_shot_s,
        "dcp_save_s": dcp_s,
        "full_vs_dcp_save": full_s / dcp_s,
        "one_shot_vs_dcp_save": None if one_shot_s is None else one_shot_s / dcp_s,
        "full_phase_seconds": runs["interleaved"]["phase_seconds_median"]["full"],
        "one_shot_phase_seconds": runs["interleaved"]["phase_seconds_median"]["one_shot"],
    }
    path = write_result(
        "spine",
        {
            "config": args.config,
            "method": (
                "Bytes: one run per policy. Times: one interleaved run (one model; at every "
                "checkpoint step our full save, our one-shot diff save and dcp.save of the same "
                "state, in an order rotating by step, each after a barrier and timed until every "
                "rank is done; DCP with the same writer threads and fsync). *_save_s: medians of "
                "the slowest rank's wall seconds, spread in runs.interleaved.save_s. "
                "phase_seconds: the slowest rank's thread-seconds per phase, from the manifests."
            ),
            "workload": dataclasses.asdict(cfg),
            "runs": runs,
            "summary": summary,
        },
    )
    print(summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
