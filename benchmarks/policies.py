"""Check-N-Run's Figures 15 and 16 on our reference workload: bytes written per checkpoint
interval and storage held over time, for full, one-shot, consecutive incremental and
intermittent differential checkpoints.

Every policy trains the same deterministic run (``configs/bench_spine.yaml``: Criteo schema,
~1M 64-dim rows, Zipf-skewed ids, 2 gloo ranks) and checkpoints every ``--interval`` steps with
the same codec (4-bit adaptive by default) and retention (the latest checkpoint and its chain).
Baselines: a full fp32 checkpoint per interval (bytes written) and keeping every one of them
(storage held). Writes ``benchmarks/results/policies.json`` and two PNG plots beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from common import RESULTS, build_workload, write_result  # noqa: E402

from embckpt.config import load_yaml
from embckpt.examples.launcher import run_ranks  # noqa: E402
from embckpt.examples.workload import DemoConfig  # noqa: E402

POLICIES = ("full", "one_shot", "incremental", "intermittent")


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _worker(
    rank: int, world_size: int, cfg: DemoConfig, root: str, intervals: int, every: int
) -> dict[str, Any]:
    import torch.distributed as dist

    from embckpt import Checkpointer
    from embckpt.examples.demo import load_dataset

    dataset = load_dataset(cfg)
    runs: dict[str, Any] = {}
    for policy in POLICIES:
        work = build_workload(rank, world_size, cfg, dataset)
        config = dataclasses.replace(cfg.checkpoint, policy=policy)
        directory = Path(root) / policy
        records = []
        with Checkpointer(work.model, directory, optimizer=work.optimizer, config=config) as ckpt:
            for step in range(1, intervals * every + 1):
                work.step()
                if step % every:
                    continue
                manifest = ckpt.save(step).wait()
                assert manifest is not None
                dist.barrier()
                records.append(
                    {
                        "step": step,
                        "kind": manifest.kind,
                        "bytes": manifest.total_bytes,
                        "rows": manifest.rows_written,
                        "touched_fraction": manifest.stats["touched_fraction"],
                        "written_fraction": manifest.stats["dirty_fraction"],
                        "full_fp32_bytes": manifest.stats["full_fp32_bytes"],
                        "storage_held_bytes": _dir_bytes(directory) if rank == 0 else None,
                        "reason": manifest.stats["reason"],
                    }
                )
        runs[policy] = records
    return runs


def _plots(runs: dict[str, list[dict[str, Any]]], codec: str, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "full": "#1f4e9c",
        "one_shot": "#f08c2e",
        "incremental": "#3a9d5d",
        "intermittent": "#b33a3a",
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/bench_spine.yaml")
    parser.add_argument("--intervals", type=int, default=24)
    parser.add_argument("--every", type=int, default=10, help="steps per checkpoint interval")
    parser.add_argument("--codec", default="adaptive")
    parser.add_argument("--bits", type=int, default=4)
    args = parser.parse_args()
    cfg = load_yaml(args.config, DemoConfig)
    checkpoint = dataclasses.replace(
        cfg.checkpoint, codec=args.codec, bits=args.bits, full_every=0, keep_last=1
    )
    cfg = dataclasses.replace(cfg, checkpoint=checkpoint)
    with tempfile.TemporaryDirectory() as root:
        runs = run_ranks(
            _worker, cfg.world_size, cfg, root, args.intervals, args.every, timeout_s=3600
        )[0]
    fp32 = runs["full"][0]["full_fp32_bytes"]
    codec = f"{args.bits}-bit {args.codec}"
    table = {}
    for policy, records in runs.items():
        mean_bytes = sum(r["bytes"] for r in records) / len(records)
        table[policy] = {
            "mean_bytes_per_interval": mean_bytes,
            "write_reduction_x": fp32 / mean_bytes,
            "storage_held_end_bytes": records[-1]["storage_held_bytes"],
            "full_checkpoints": sum(r["kind"] == "full" for r in records),
        }
        print(
            f"{policy:>13}: {mean_bytes / 1e6:8.2f} MB per interval "
            f"({table[policy]['write_reduction_x']:5.1f}x below fp32), "
            f"{table[policy]['full_checkpoints']} fulls, held at the end "
            f"{records[-1]['storage_held_bytes'] / 1e6:8.2f} MB"
        )
    keep_all_fp32 = fp32 * len(runs["full"])
    summary = {
        "codec": codec,
        "full_fp32_bytes": fp32,
        "mean_touched_fraction": sum(r["touched_fraction"] for r in runs["full"][1:])
        / max(len(runs["full"]) - 1, 1),
        "write_reduction_x": table["intermittent"]["write_reduction_x"],
        "storage_reduction_x": keep_all_fp32 / runs["intermittent"][-1]["storage_held_bytes"],
    }
    plots = _plots(runs, codec, RESULTS)
    path = write_result(
        "policies",
        {
            "args": vars(args),
            "runs": runs,
            "table": table,
            "summary": summary,
            "plots": [p.name for p in plots],
        },
    )
    print(summary)
    print(f"wrote {path} and {', '.join(str(p) for p in plots)}")


if __name__ == "__main__":
    main()
