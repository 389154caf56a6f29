"""Soak: hundreds of checkpoints with restores in between, every one verified.

Trains a small Criteo-schema workload (``configs/bench_small.yaml``) on 2 gloo ranks and
checkpoints at every step (one-shot diffs, a full every 10, keeping the last 3 chains' worth).
Every ``--restore-every`` checkpoints it verifies the whole directory (sizes, SHA-256,
manifests, chains), restores the latest checkpoint into the live model and checks that every
weight and optimizer value equals what the model held when that checkpoint was taken.
Writes ``benchmarks/results/soak.json``.
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


def _state(model: Any, optimizer: Any, rank: int) -> dict[str, Any]:
    from embckpt.sharding import discover

    out = {}
    for shard in discover(model, rank).shards:
        out[shard.key] = shard.weight.detach().clone()
        for name, tensor in {**shard.row_states, **shard.elem_states}.items():
            out[f"{shard.key}:{name}"] = tensor.detach().clone()
    return out


def _worker(
    rank: int, world_size: int, cfg: DemoConfig, root: str, checkpoints: int, restore_every: int
) -> dict[str, Any]:
    import torch

    from embckpt import Checkpointer
    from embckpt.storage.verify import verify

    work = build_workload(rank, world_size, cfg)
    model, optimizer, sampler = work.model, work.optimizer, work.sampler
    ckpt = Checkpointer(
        model, root, optimizer=optimizer, config=cfg.checkpoint, statefuls={"data": sampler}
    )
    saves: list[dict[str, Any]] = []
    restores: list[dict[str, Any]] = []
    for step in range(1, checkpoints + 1):
        work.step()
        started = time.perf_counter()
        manifest = ckpt.save(step).wait()
        assert manifest is not None
        saves.append(
            {
                "step": step,
                "kind": manifest.kind,
                "bytes": manifest.total_bytes,
                "save_s": time.perf_counter() - started,
            }
        )
        if step % restore_every:
            continue
        expected = _state(model, optimizer, rank)
        started = time.perf_counter()
        report = verify(ckpt.store)
        verify_s = time.perf_counter() - started
        with torch.no_grad():  # scramble the tables so the restore has to bring them back
            for shard in ckpt.sharded.shards:
                shard.weight.add_(1.0)
        started = time.perf_counter()
        restored = ckpt.restore()
        restore_s = time.perf_counter() - started
        got = _state(model, optimizer, rank)
        exact = all(torch.equal(expected[k], got[k]) for k in expected)
        restores.append(
            {
                "step": step,
                "restored": restored,
                "exact": exact,
                "verify_ok": report.ok,
                "checked": len(report.checked),
                "files": report.files_checked,
                "verify_s": verify_s,
                "restore_s": restore_s,
            }
        )
    ckpt.close()
    return {"saves": saves, "restores": restores}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/bench_small.yaml")
    parser.add_argument("--checkpoints", type=int, default=300)
    parser.add_argument("--restore-every", type=int, default=20)
    args = parser.parse_args()
    cfg = load_yaml(args.config, DemoConfig)
    cfg = dataclasses.replace(
        cfg,
        checkpoint=dataclasses.replace(
            cfg.checkpoint, policy="one_shot", full_every=10, keep_last=3
        ),
    )
    with tempfile.TemporaryDirectory() as root:
        started = time.perf_counter()
        ranks = run_ranks(
            _worker, cfg.world_size, cfg, root, args.checkpoints, args.restore_every, timeout_s=3600
        )
        wall = time.perf_counter() - started
    saves, restores = ranks[0]["saves"], [r for rank in ranks for r in rank["restores"]]
    save_s = [s["save_s"] for s in saves]
    summary = {
        "checkpoints": len(saves),
        "full": sum(s["kind"] == "full" for s in saves),
        "diff": sum(s["kind"] == "diff" for s in saves),
        "restores": len(ranks[0]["restores"]),
        "all_restores_exact": all(r["exact"] and r["restored"] == r["step"] for r in restores),
        "all_verified": all(r["verify_ok"] for r in restores),
        "bytes_written": sum(s["bytes"] for s in saves),
        "save_s_median": statistics.median(save_s),
        "save_s_max": max(save_s),
        "restore_s_median": statistics.median(r["restore_s"] for r in restores),
        "verify_s_median": statistics.median(r["verify_s"] for r in restores),
        "wall_s": wall,
    }
    path = write_result(
        "soak",
        {
            "config": args.config,
            "args": vars(args),
            "summary": summary,
            "saves": saves,
            "restores": ranks[0]["restores"],
        },
    )
    print(summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
