"""Serving from checkpoints: how fresh a follower's tables are, what it reads, what signing costs.

* ``follow``: the demo's model (``embckpt/examples/demo.yaml``), 2 ranks under gloo training
  and saving every ``--every`` steps with the demo's headline setting (intermittent, adaptive
  4-bit), while this process follows the directory (``Follower.run``, ``--interval`` s). Per
  applied step: freshness (its manifest's write to its rows served), bytes read against the
  checkpoint's files, the update's seconds; beside them the bytes of a full safetensors export
  of the served tables and dense state.
* ``signing``: what signing and digesting add to a save, ours signed and unsigned interleaved
  on the same model (two Checkpointers, saving at the same steps, each save waited for): the
  demo's model on 2 ranks, then ``stall.py``'s CPU model (one rank).

    python benchmarks/follow.py            # benchmarks/results/follow.json
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
sys.path.insert(0, str(Path(__file__).parents[1]))

from common import build_workload, dir_bytes, write_result  # noqa: E402

from embckpt.examples.demo import HEADLINE, packaged_config  # noqa: E402
from embckpt.examples.launcher import run_ranks  # noqa: E402
from embckpt.examples.workload import DemoConfig  # noqa: E402


def _demo_config() -> Any:
    from embckpt import load_yaml

    cfg = load_yaml(packaged_config(), DemoConfig)
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, **HEADLINE))


def _train_and_save(rank: int, world_size: int, root: str, steps: int, every: int) -> None:
    from embckpt import Checkpointer

    cfg = _demo_config()
    work = build_workload(rank, world_size, cfg)
    with Checkpointer(work.model, root, optimizer=work.optimizer, config=cfg.checkpoint) as ckpt:
        for step in range(1, steps + 1):
            work.step()
            if step % every == 0:
                ckpt.save(step).wait()


def follow_phase(args: argparse.Namespace, root: str) -> dict[str, Any]:
    from embckpt import Follower
    from embckpt.storage.chain import read_root
    from embckpt.storage.fs import CheckpointStore

    directory = f"{root}/follow"
    follower = Follower(directory)
    updates: list[Any] = []
    follower.run(args.interval, on_update=updates.append)
    try:
        run_ranks(_train_and_save, 2, directory, args.steps, args.every)
        last = args.steps // args.every * args.every
        deadline = time.monotonic() + 30
        while follower.step != last and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        follower.close()
    store = CheckpointStore(directory)
    rows = []
    for update in updates:
        kind = read_root(store, update.step).kind
        rows.append(
            {
                "step": update.step,
                "kind": kind,
                "path": list(update.path),
                "rewound": update.rewound,
                "bytes_read": update.bytes_read,
                "checkpoint_bytes": update.checkpoint_bytes,
                "freshness_s": round(update.freshness_s, 4),
                "update_s": round(update.seconds, 4),
            }
        )
    export = Path(root) / "served.safetensors"
    with follower.view() as view:
        view.save_safetensors(export)
    diffs = [r for r in rows if r["kind"] == "diff" and len(r["path"]) == 1]
    ratios = [r["bytes_read"] / r["checkpoint_bytes"] for r in rows if len(r["path"]) == 1]
    return {
        "setting": {**HEADLINE, "every_steps": args.every, "poll_interval_s": args.interval},
        "updates": rows,
        "steps_saved": args.steps // args.every,
        "steps_applied": len(rows),
        "max_freshness_s_headline_diff": max(r["freshness_s"] for r in diffs),
        "median_freshness_s_headline_diff": statistics.median(r["freshness_s"] for r in diffs),
        "bytes_read_vs_checkpoint_files": round(max(ratios), 4),
        "median_bytes_read_headline_diff": statistics.median(r["bytes_read"] for r in diffs),
        "full_export_bytes": export.stat().st_size,
        "held_rows_at_end": follower.held_rows,
        "directory_bytes": dir_bytes(directory),
    }


def _signed_vs_unsigned(
    model: Any, optimizer: Any, train: Any, base: Any, root: str, saves: int, every: int, key: str
) -> dict[str, Any]:
    """Two Checkpointers on one model, signed and unsigned, saving at the same steps in
    alternating order; each save's wall time until durable, and its ``hash`` phase."""
    from embckpt import Checkpointer

    configs = {
        "unsigned": base,
        "signed": dataclasses.replace(base, signing_key=key),
    }
    ckpts = {
        n: Checkpointer(model, f"{root}/{n}", optimizer=optimizer, config=c)
        for n, c in configs.items()
    }
    seconds: dict[str, list[float]] = {n: [] for n in ckpts}
    hashing: dict[str, list[float]] = {n: [] for n in ckpts}
    try:
        step = 0
        for i in range(saves):
            for _ in range(every):
                step += 1
                train()
            order = list(ckpts) if i % 2 == 0 else list(ckpts)[::-1]
            for name in order:
                start = time.perf_counter()
                manifest = ckpts[name].save(step).wait()
                seconds[name].append(time.perf_counter() - start)
                hashing[name].append(manifest.stats["phase_seconds"].get("hash", 0.0))
    finally:
        for ckpt in ckpts.values():
            ckpt.close()
    median = {n: statistics.median(s[1:]) for n, s in seconds.items()}  # after the first full
    return {
        "save_s_median": median,
        "hash_s_median": {n: statistics.median(h[1:]) for n, h in hashing.items()},
        "signed_vs_unsigned": round(median["signed"] / median["unsigned"], 4),
        "saves": saves,
    }


def _signing_demo(rank: int, world_size: int, root: str, key: str, saves: int) -> dict:
    cfg = _demo_config()
    work = build_workload(rank, world_size, cfg)
    return _signed_vs_unsigned(
        work.model, work.optimizer, work.step, cfg.checkpoint, root, saves, 10, key
    )


def _signing_stall_cpu(rank: int, world_size: int, root: str, key: str, saves: int) -> dict:
    import torch
    from stall import Trainer, batches, build, parser

    from embckpt import CheckpointConfig

    args = parser().parse_args(
        ["--device", "cpu", "--rows", "200000", "--dim", "64", "--batch", "2048"]
    )
    device = torch.device("cpu")
    model, opt = build(args, device)
    trainer = Trainer(model, opt, batches(args, device), device)
    return _signed_vs_unsigned(model, opt, trainer.step, CheckpointConfig(), root, saves, 10, key)


def signing_phase(args: argparse.Namespace, root: str) -> dict[str, Any]:
    from embckpt import generate_key_pair

    key = f"{root}/signing.pem"
    generate_key_pair(key, f"{root}/signing.pub")
    demo = run_ranks(_signing_demo, 2, f"{root}/sign_demo", key, args.signing_saves)
    stall = run_ranks(_signing_stall_cpu, 1, f"{root}/sign_stall", key, args.signing_saves)
    return {"demo_model_rank0": demo[0], "stall_cpu_model": stall[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120, help="training steps (demo: 120)")
    p.add_argument("--every", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--interval", type=float, default=0.1, help="the follower's polling interval")
    p.add_argument("--signing-saves", type=int, default=7, help="saves per setting (signing)")
    p.add_argument("--phases", nargs="*", default=["follow", "signing"])
    args = p.parse_args()
    result: dict[str, Any] = {"command": " ".join(sys.argv)}
    with tempfile.TemporaryDirectory(prefix="embckpt-follow-") as root:
        if "follow" in args.phases:
            result["follow"] = follow_phase(args, root)
            print({k: v for k, v in result["follow"].items() if k != "updates"}, flush=True)
        if "signing" in args.phases:
            result["signing"] = signing_phase(args, root)
            print(result["signing"], flush=True)
    follow, signing = result.get("follow", {}), result.get("signing", {})
    result["summary"] = {
        "max_freshness_s_headline_diff": follow.get("max_freshness_s_headline_diff"),
        "bytes_read_vs_checkpoint_files": follow.get("bytes_read_vs_checkpoint_files"),
        "full_export_bytes": follow.get("full_export_bytes"),
        "poll_interval_s": args.interval,
        "signed_vs_unsigned_save_demo": signing.get("demo_model_rank0", {}).get(
            "signed_vs_unsigned"
        ),
        "signed_vs_unsigned_save_stall_cpu": signing.get("stall_cpu_model", {}).get(
            "signed_vs_unsigned"
        ),
    }
    print(write_result("follow", result))


if __name__ == "__main__":
    main()
