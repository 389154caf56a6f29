"""Recovery from the node-local tier (issue 24): time from relaunch to the first training step,
and the bytes read per tier, beside ``dcp.load`` of the same model from the durable directory.

Two simulated nodes of 2 ranks each: two ``torchrun --nnodes 2 --nproc-per-node 2`` on this
host (``--node-rank`` 0 and 1, one static rendezvous), with ``EMBCKPT_NODE`` = n0 and n1 and
one local folder each; the durable directory on an S3 server (moto in server mode, started
here, on 127.0.0.1) and on local disk. ``local_dir``, ``replicas=1``, ``durable_every=2``;
three checkpoints (the second goes durable with its chain). Every scenario is a relaunch (both
torchruns again), after the loss it simulates:

* ``no_node_lost``            - every node has its folder;
* ``node_lost_replica_alive`` - n1's folder deleted: its files come from n0's replica;
* ``node_and_replica_lost``   - n1's folder and n0's replica of it deleted: partial recovery;
* ``durable_full_restore``    - the same loss restored whole from the durable tier alone (the
  newest durable step), what the job does without the local tier.

``restore_s``: in each worker, from building the model to the end of the first training step
after the restore (the slowest rank), split into ``build_s``, ``open_s`` (the Checkpointer),
``load_s``, ``first_step_s``; ``launch_s``: the two torchruns' wall time (process start,
imports, rendezvous included). ``restore_only_s``: opening the Checkpointer and loading alone
(slowest rank, best run), against ``dcp_load_only_s``, ``dcp.load`` alone
(``restore_only_speedup_vs_dcp``): building the model and the first step, in both spans alike,
bound the span's ratio. ``dcp_load_s``: the same span with ``dcp.load`` of the same
model from a DCP checkpoint in the durable directory's place: the moto S3 bucket (read through
pyarrow's S3 client, ``fsspec``'s ``ArrowFSWrapper`` with a 32 MiB buffered reader per file:
DCP's ``FsspecReader`` over it; ``s3fs`` itself cannot be installed beside this environment's
botocore) or disk.
Each scenario runs ``--repeats`` times, interleaved with ``dcp.load``; best and median.

    python benchmarks/recovery.py [--config configs/bench_spine.yaml] [--repeats 3]

Writes ``benchmarks/results/recovery.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_result  # noqa: E402
from embckpt.config import load_yaml  # noqa: E402
from embckpt.examples.launcher import free_port  # noqa: E402
from embckpt.examples.workload import DemoConfig  # noqa: E402

NODES = 2
RANKS_PER_NODE = 2
SAVES = (10, 20, 30)
SCENARIOS = (
    "no_node_lost",
    "node_lost_replica_alive",
    "node_and_replica_lost",
    "durable_full_restore",
)
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


# -- in each torchrun worker ------------------------------------------------------------------
DCP_READ_BUFFER = 32 << 20  # a buffered reader per file: DCP's small reads are not a GET each


def _dcp_storage(uri: str, *, write: bool) -> Any:
    """DCP's fsspec reader or writer on ``uri``: S3 through pyarrow's client (reads buffered
    by :data:`DCP_READ_BUFFER`), or a folder."""
    import pyarrow.fs as pafs
    from fsspec.implementations.arrow import ArrowFSWrapper
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    class Buffered(ArrowFSWrapper):  # type: ignore[misc]
        def _open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
            if mode != "rb":
                return super()._open(path, mode, *args, **kwargs)
            raw = self.fs.open_input_file(path)
            return io.BufferedReader(raw, buffer_size=DCP_READ_BUFFER)

    fs, path = pafs.FileSystem.from_uri(uri)
    storage = FsspecWriter("/tmp") if write else FsspecReader("/tmp")
    storage.fs.fs = Buffered(fs)  # DCP's own path handling, another client
    storage.path = path
    return storage


def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from embckpt import Checkpointer
    from embckpt.data import ResumableSampler
    from embckpt.examples.demo import load_dataset
    from embckpt.examples.launcher import rank_device
    from embckpt.examples.model import build_model, make_batch, train_step

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = load_yaml(args.config, DemoConfig)
    device = rank_device(rank)
    dataset = load_dataset(cfg)
    tiers = dataclasses.replace(
        cfg.checkpoint,
        policy="one_shot",
        full_every=4,
        pipeline="off",
        local_dir=f"{args.root}/local",
        replicas=1,
        durable_every=2,
        local_keep_last=3,
        partial_recovery=True,
    )

    def fresh() -> tuple[Any, Any, Any]:
        sampler = ResumableSampler(
            len(dataset), cfg.workload.batch_size, rank=rank, world_size=world_size, seed=0
        )
        model, optimizer = build_model(cfg.workload, device, world_size)
        return model, optimizer, sampler

    def dcp_state(model: Any) -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}

    out: dict[str, Any] = {}
    if args.phase == "train":
        model, optimizer, sampler = fresh()
        with Checkpointer(model, args.durable, optimizer=optimizer, config=tiers) as ckpt:
            for step in range(1, SAVES[-1] + 1):
                batch = make_batch(dataset, next(sampler), cfg.workload, device)
                train_step(model, optimizer, batch)
                if step in SAVES:
                    ckpt.save(step).wait()
        for uri in args.dcp:
            dcp.save(dcp_state(model), storage_writer=_dcp_storage(uri, write=True))
    elif args.phase == "dcp":
        started = time.perf_counter()
        model, optimizer, sampler = fresh()
        built = time.perf_counter()
        dcp.load(dcp_state(model), storage_reader=_dcp_storage(args.dcp[0], write=False))
        loaded = time.perf_counter()
        train_step(model, optimizer, make_batch(dataset, next(sampler), cfg.workload, device))
        done = time.perf_counter()
        out = {"dcp_load_s": done - started, "build_s": built - started, "load_s": loaded - built}
    else:
        config = tiers
        if args.phase == "durable_full_restore":
            config = dataclasses.replace(cfg.checkpoint, pipeline="off")
        started = time.perf_counter()
        model, optimizer, sampler = fresh()
        built = time.perf_counter()
        with Checkpointer(model, args.durable, optimizer=optimizer, config=config) as ckpt:
            opened = time.perf_counter()
            result = ckpt.load()
            loaded = time.perf_counter()
            train_step(model, optimizer, make_batch(dataset, next(sampler), cfg.workload, device))
            done = time.perf_counter()
        partial = result.partial
        out = {
            "restore_s": done - started,
            "build_s": built - started,
            "open_s": opened - built,
            "load_s": loaded - opened,
            "first_step_s": done - loaded,
            "phases": dict(result.phases),
            "step": result.manifest.step,
            "bytes_by_tier": dict(result.bytes_by_tier)
            or {"durable": result.cost.bytes_read + result.cost.other_bytes},
            "lost_fraction": 0.0 if partial is None else partial.lost_fraction,
            "lost_rows_fraction": 0.0 if partial is None else partial.rows_fraction,
            "older_steps": [] if partial is None else list(partial.older_steps),
        }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


# -- the driver -------------------------------------------------------------------------------
def _launch(phase: str, args: argparse.Namespace, root: str, durable: str, dcp: list[str]) -> Any:
    """Both nodes' torchrun, together; every rank's figures and the wall time."""
    out = tempfile.mkdtemp(dir=root, prefix=f"out-{phase}-")
    port = free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES)]
    torchrun += ["--nproc-per-node", str(RANKS_PER_NODE), "--master-addr", "127.0.0.1"]
    torchrun += ["--master-port", str(port)]
    worker = [__file__, "--worker", phase, "--root", root, "--durable", durable, "--out", out]
    worker += ["--config", args.config] + [f"--dcp={uri}" for uri in dcp]
    env = {**os.environ, **S3_ENV, "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    jobs = [
        subprocess.Popen(
            [*torchrun, "--node-rank", str(node), *worker],
            env={**env, "EMBCKPT_NODE": f"n{node}"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for node in range(NODES)
    ]
    logs = [job.communicate(timeout=1200)[0].decode() for job in jobs]
    wall = time.perf_counter() - started
    for job, log in zip(jobs, logs, strict=True):
        if job.returncode:
            raise RuntimeError(f"{phase}: torchrun failed:\n{log[-4000:]}")
    ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(NODES * RANKS_PER_NODE)]
    return ranks, wall


def _s3_uri(port: int) -> str:
    import pyarrow.fs as pafs

    os.environ.update(S3_ENV)
    query = f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    fs, _ = pafs.FileSystem.from_uri(f"s3://ckpts?{query}&allow_bucket_creation=true")
    fs.create_dir("ckpts")
    return f"s3://ckpts/job-{uuid.uuid4().hex[:8]}?{query}"


def _lose(scenario: str, root: Path, pristine: Path) -> None:
    """The local tier as the scenario finds it: every node's folder, less what it lost."""
    shutil.rmtree(root / "local", ignore_errors=True)
    shutil.copytree(pristine, root / "local")
    if scenario != "no_node_lost":
        shutil.rmtree(root / "local" / "n1")
    if scenario in ("node_and_replica_lost", "durable_full_restore"):
        shutil.rmtree(root / "local" / "n0" / "replicas" / "n1")


def _summed(rows: list[dict]) -> dict[str, int]:
    tiers: dict[str, int] = {}
    for row in rows:
        for tier, n in row["bytes_by_tier"].items():
            tiers[tier] = tiers.get(tier, 0) + int(n)
    return tiers


def _spread(values: list[float]) -> dict[str, float]:
    return {"best": min(values), "median": statistics.median(values)}


def _run_durable(kind: str, args: argparse.Namespace, port: int) -> list[dict[str, Any]]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        durable = _s3_uri(port) if kind == "s3" else str(root / "durable")
        dcp_uri = durable.replace("?", "/dcp?", 1) if kind == "s3" else str(root / "dcp")
        _launch("train", args, tmp, durable, [dcp_uri])
        pristine = root / "pristine"
        shutil.copytree(root / "local", pristine)
        runs: dict[str, list[tuple[list[dict], float]]] = {s: [] for s in SCENARIOS}
        dcp_runs: list[float] = []
        dcp_loads: list[float] = []  # dcp.load alone, without building the model or a step
        for _ in range(args.repeats):
            for scenario in SCENARIOS:
                _lose(scenario, root, pristine)
                runs[scenario].append(_launch(scenario, args, tmp, durable, []))
            ranks, _ = _launch("dcp", args, tmp, durable, [dcp_uri])
            dcp_runs.append(max(r["dcp_load_s"] for r in ranks))
            dcp_loads.append(max(r["load_s"] for r in ranks))
            print(f"{kind}: dcp.load {dcp_runs[-1]:.2f} s", flush=True)
        for scenario in SCENARIOS:
            restore = [max(r["restore_s"] for r in ranks) for ranks, _ in runs[scenario]]
            best = min(range(len(restore)), key=restore.__getitem__)
            ranks, _ = runs[scenario][best]
            slowest = max(ranks, key=lambda r: r["restore_s"])
            row = {
                "scenario": scenario,
                "durable": kind,
                "restore_s": restore[best],
                "dcp_load_s": min(dcp_runs),
                "bytes_by_tier": _summed(ranks),
                "lost_fraction": ranks[0]["lost_fraction"],
                "lost_rows_fraction": ranks[0]["lost_rows_fraction"],
                "step": ranks[0]["step"],
                "older_steps": ranks[0]["older_steps"],
                "restore_runs_s": _spread(restore),
                "dcp_load_runs_s": _spread(dcp_runs),
                "launch_runs_s": _spread([wall for _, wall in runs[scenario]]),
                "slowest_rank": {
                    k: slowest[k] for k in ("build_s", "open_s", "load_s", "first_step_s")
                },
                "slowest_rank_phases": slowest["phases"],
            }
            row["speedup_vs_dcp"] = row["dcp_load_s"] / row["restore_s"]
            # The restore alone (opening the Checkpointer and loading), against dcp.load alone:
            # the span above also holds building the model and a training step, alike for both.
            alone = [max(r["open_s"] + r["load_s"] for r in ranks) for ranks, _ in runs[scenario]]
            row["restore_only_s"] = min(alone)
            row["dcp_load_only_s"] = min(dcp_loads)
            row["restore_only_speedup_vs_dcp"] = row["dcp_load_only_s"] / row["restore_only_s"]
            results.append(row)
            print(
                f"{kind:5} {scenario:25} restore {row['restore_s']:6.2f} s  dcp.load "
                f"{row['dcp_load_s']:6.2f} s  step {row['step']}  bytes {row['bytes_by_tier']}",
                flush=True,
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/bench_spine.yaml")
    parser.add_argument("--durable", nargs="+", default=["s3", "disk"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # the phase, in a torchrun worker
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--dcp", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.phase = args.worker
        args.durable = args.durable[0]
        _worker(args)
        return
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per S3 request otherwise
    load_before = os.getloadavg()
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        results = [row for kind in args.durable for row in _run_durable(kind, args, port)]
    finally:
        server.stop()
    path = write_result(
        "recovery",
        {
            "setup": (
                f"two torchrun --nnodes {NODES} --nproc-per-node {RANKS_PER_NODE} on this host "
                f"(gloo, EMBCKPT_NODE n0/n1), {args.config}, checkpoints at steps {list(SAVES)}, "
                "local_dir + replicas=1 + durable_every=2; restore_s: model built, Checkpointer "
                "opened, load, first training step, slowest rank, best of the repeats; "
                "dcp_load_s: the same span with dcp.load from the durable kind's place "
                "(S3: pyarrow's client under DCP's FsspecReader), best of the repeats"
            ),
            "repeats": args.repeats,
            "load_before": load_before,
            "load_after": os.getloadavg(),
            "results": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
