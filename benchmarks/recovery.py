"""Recovery from the node-local tier (issue 24): time from relaunch to the first training step,
and the bytes read per tier, beside ``dcp.load`` of the same model.

Two simulated nodes of 2 ranks each (4 gloo ranks on this host, ``EMBCKPT_NODE`` = n0, n1), each
node with its own local folder; the durable directory on an S3 server (moto in server mode,
started here, on 127.0.0.1) and on local disk. ``local_dir``, ``replicas=1``,
``durable_every=2``; three checkpoints (the second goes durable with its chain). Scenarios, each
a fresh model and Checkpointer (a relaunch), timed from building them to the end of the first
training step after the restore (the slowest rank):

* ``no_node_lost``           - every node has its folder;
* ``node_lost_replica_alive`` - n1's folder deleted: its files come from n0's replica;
* ``node_and_replica_lost``  - n1's folder and n0's replica of it deleted: partial recovery;
* ``durable_full_restore``   - the same loss restored whole from the durable tier alone (the
  newest durable step), what the job does without partial recovery.

``dcp_load_s`` is ``dcp.load`` of the same model from a DCP checkpoint on local disk (pyarrow's
S3 client is not one DCP reads through; ``durable_full_restore`` on S3 is the S3 baseline).

    python benchmarks/recovery.py [--config configs/bench_spine.yaml]

Writes ``benchmarks/results/recovery.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_result  # noqa: E402
from embckpt.config import load_yaml  # noqa: E402
from embckpt.examples.launcher import free_port, run_ranks  # noqa: E402
from embckpt.examples.workload import DemoConfig  # noqa: E402

WORLD = 4
RANKS_PER_NODE = 2
SAVES = (10, 20, 30)
SCENARIOS = (
    "no_node_lost",
    "node_lost_replica_alive",
    "node_and_replica_lost",
    "durable_full_restore",
)


def _worker(rank: int, world_size: int, cfg: DemoConfig, root: str, durable: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from embckpt import Checkpointer
    from embckpt.data import ResumableSampler
    from embckpt.examples.demo import load_dataset
    from embckpt.examples.launcher import rank_device
    from embckpt.examples.model import build_model, make_batch, train_step

    os.environ["EMBCKPT_NODE"] = f"n{rank // RANKS_PER_NODE}"
    device = rank_device(rank)
    dataset = load_dataset(cfg)
    tiers = dataclasses.replace(
        cfg.checkpoint,
        policy="one_shot",
        full_every=4,
        pipeline="off",
        local_dir=f"{root}/local",
        replicas=1,
        durable_every=2,
        local_keep_last=3,
        partial_recovery=True,
    )
    durable_only = dataclasses.replace(cfg.checkpoint, pipeline="off")

    def fresh() -> tuple[Any, Any, Any]:
        sampler = ResumableSampler(
            len(dataset), cfg.workload.batch_size, rank=rank, world_size=world_size, seed=0
        )
        model, optimizer = build_model(cfg.workload, device, world_size)
        return model, optimizer, sampler

    model, optimizer, sampler = fresh()
    with Checkpointer(model, durable, optimizer=optimizer, config=tiers) as ckpt:
        for step in range(1, SAVES[-1] + 1):
            train_step(model, optimizer, make_batch(dataset, next(sampler), cfg.workload, device))
            if step in SAVES:
                ckpt.save(step).wait()
    dcp_dir = f"{root}/dcp"
    dcp.save(
        {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()},
        checkpoint_id=dcp_dir,
    )
    local = Path(root, "local")
    out: dict[str, Any] = {}
    for scenario in SCENARIOS:
        dist.barrier()
        if rank == 0 and scenario == "node_lost_replica_alive":
            shutil.rmtree(local / "n1")
        if rank == 0 and scenario == "node_and_replica_lost":
            shutil.rmtree(local / "n1")
            shutil.rmtree(local / "n0" / "replicas" / "n1")
        dist.barrier()
        started = time.perf_counter()
        model, optimizer, sampler = fresh()
        config = durable_only if scenario == "durable_full_restore" else tiers
        with Checkpointer(model, durable, optimizer=optimizer, config=config) as ckpt:
            result = ckpt.load()
            train_step(model, optimizer, make_batch(dataset, next(sampler), cfg.workload, device))
            elapsed = time.perf_counter() - started
        partial = result.partial
        out[scenario] = {
            "restore_s": elapsed,
            "step": result.manifest.step,
            "bytes_by_tier": dict(result.bytes_by_tier)
            or {"durable": result.cost.bytes_read + result.cost.other_bytes},
            "lost_fraction": 0.0 if partial is None else partial.lost_fraction,
            "lost_rows_fraction": 0.0 if partial is None else partial.rows_fraction,
            "older_step": None if partial is None else partial.older_step,
        }
    dist.barrier()
    started = time.perf_counter()
    model, optimizer, sampler = fresh()
    state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=dcp_dir)
    train_step(model, optimizer, make_batch(dataset, next(sampler), cfg.workload, device))
    out["dcp_load_s"] = time.perf_counter() - started
    return out


def _s3(port: int) -> str:
    import pyarrow.fs as pafs

    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ[key] = value
    query = f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    fs, _ = pafs.FileSystem.from_uri(f"s3://ckpts?{query}&allow_bucket_creation=true")
    fs.create_dir("ckpts")
    return f"s3://ckpts/job-{uuid.uuid4().hex[:8]}?{query}"


def main() -> None:
    from moto.server import ThreadedMotoServer

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/bench_spine.yaml")
    parser.add_argument("--durable", nargs="+", default=["s3", "disk"])
    args = parser.parse_args()
    cfg = load_yaml(args.config, DemoConfig)
    load_before = os.getloadavg()
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    results = []
    try:
        for durable in args.durable:
            with tempfile.TemporaryDirectory() as root:
                uri = _s3(port) if durable == "s3" else f"{root}/durable"
                ranks = run_ranks(_worker, WORLD, cfg, root, uri)
            dcp_s = max(r["dcp_load_s"] for r in ranks)
            for scenario in SCENARIOS:
                rows = [r[scenario] for r in ranks]
                tiers: dict[str, int] = {}
                for row in rows:
                    for tier, n in row["bytes_by_tier"].items():
                        tiers[tier] = tiers.get(tier, 0) + int(n)
                restore_s = max(row["restore_s"] for row in rows)
                results.append(
                    {
                        "scenario": scenario,
                        "durable": durable,
                        "restore_s": restore_s,
                        "dcp_load_s": dcp_s,
                        "bytes_by_tier": tiers,
                        "lost_fraction": rows[0]["lost_fraction"],
                        "lost_rows_fraction": rows[0]["lost_rows_fraction"],
                        "step": rows[0]["step"],
                        "older_step": rows[0]["older_step"],
                    }
                )
                print(
                    f"{durable:5} {scenario:25} restore {restore_s:6.2f} s  dcp.load "
                    f"{dcp_s:6.2f} s  step {rows[0]['step']}  bytes {tiers}"
                )
    finally:
        server.stop()
    path = write_result(
        "recovery",
        {
            "setup": (
                f"{WORLD} gloo ranks on this host as 2 simulated nodes of {RANKS_PER_NODE} "
                f"(EMBCKPT_NODE), {args.config}, checkpoints at steps {list(SAVES)}, "
                "local_dir + replicas=1 + durable_every=2; restore_s: relaunch (model and "
                "Checkpointer built) to the end of the first training step, slowest rank; "
                "dcp_load_s: the same from a DCP checkpoint on local disk"
            ),
            "load_before": load_before,
            "load_after": os.getloadavg(),
            "results": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
