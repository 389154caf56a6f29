"""The two probes of "a restore never lies", as a user meets them through the public API.

2 gloo ranks train TorchRec's TestSparseNN (``--model toy``: the tests' toy DLRM), with one
table of each sharding type (table-, row-, column-, table-row-wise and data-parallel), and
checkpoint it:

1. ``filesystem``: a ``pyarrow.fs.PyFileSystem`` whose writes fail now and then with an
   ``OSError`` (``503 Slow Down``; seeded, per rank, ``--fault-rate`` of write calls),
   ``save(step).wait()`` every 2 steps, training going on after a ``SaveError``. Every
   committed step is then restored into a fresh model and compared with the live weights at
   that step: the worst relative L2 over tables and steps, clean run against faulty run.
2. ``in-process``: saves at steps 1, 2 and 3, the dense file of step 2 failing on rank 0; the
   restore of step 3, per table, against the same run without the failure.

Runs against any embckpt on ``PYTHONPATH`` that has the public API (to measure a version from
before the fix: ``PYTHONPATH=<old checkout> python benchmarks/fault_probe.py``); writes
``benchmarks/results/fault_probe.json`` (under ``"<label> (<model>)"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))  # toy_model and faultfs

RESULTS = Path(__file__).parent / "results" / "fault_probe.json"
CONFIGS = {
    "incremental adaptive4 full_every=6": {
        "policy": "incremental",
        "full_every": 6,
        "codec": "adaptive",
        "bits": 4,
    },
    "intermittent adaptive4 (defaults)": {"policy": "intermittent", "codec": "adaptive", "bits": 4},
    "incremental raw": {"policy": "incremental", "full_every": 6, "codec": "raw"},
}
STEPS = 24


class _SparseNN:
    """TorchRec's TestSparseNN with one table of each sharding type (table-, row-, column-,
    table-row-wise, data-parallel), fused row-wise Adagrad, batches from ``ModelInput``."""

    KINDS = ("tw", "rw", "cw", "twrw", "dp")

    def __init__(self, world_size: int) -> None:
        from torchrec import EmbeddingBagConfig

        self.world_size = world_size
        self.tables = [
            EmbeddingBagConfig(
                name=f"table_{k}", embedding_dim=16, num_embeddings=400, feature_names=[f"f_{k}"]
            )
            for k in self.KINDS
        ]

    def build(self, seed: int) -> tuple[Any, Any]:
        import torch
        import toy_model as tm
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec.distributed import DistributedModelParallel
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.test_utils.test_model import TestSparseNN
        from torchrec.distributed.types import ShardingPlan
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        torch.manual_seed(seed)
        model = TestSparseNN(
            tables=self.tables,
            weighted_tables=[],
            dense_device=torch.device("cpu"),
            sparse_device=torch.device("meta"),
        )
        sharder = EmbeddingBagCollectionSharder(
            fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
        )
        kinds = {f"table_{k}": k for k in self.KINDS}
        module_plan = tm.plan_tables(model.sparse.ebc, kinds, sharder, self.world_size)
        dmp = DistributedModelParallel(
            model,
            device=torch.device("cpu"),
            plan=ShardingPlan({"sparse.ebc": module_plan}),
            sharders=[sharder],
        )
        dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
        return dmp, torch.optim.Adagrad(list(dense.values()), lr=0.05)

    def train_step(self, model: Any, opt: Any, step: int, rank: int) -> None:
        from torchrec.distributed.test_utils.test_model import ModelInput

        _, local = ModelInput.generate(
            batch_size=16,
            world_size=self.world_size,
            num_float_features=10,
            tables=self.tables,
            weighted_tables=[],
            random_seed=step * 1009,
        )
        opt.zero_grad()
        loss, _ = model(local[rank])
        loss.backward()
        opt.step()


class _ToyDLRM:
    """The tests' toy DLRM (``tests/toy_model.py``): one table of each sharding type."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def build(self, seed: int) -> tuple[Any, Any]:
        import toy_model as tm

        return tm.build(self.world_size, seed=seed)

    def train_step(self, model: Any, opt: Any, step: int, rank: int) -> None:
        import toy_model as tm

        tm.train_step(model, opt, step, rank, hot=100)


MODELS = {"testsparsenn": _SparseNN, "toy": _ToyDLRM}


def _config(settings: dict[str, Any], retries: int | None) -> Any:
    from embckpt import CheckpointConfig

    names = {f.name for f in dataclasses.fields(CheckpointConfig)}
    extra = {"write_retries": retries} if retries is not None and "write_retries" in names else {}
    return CheckpointConfig(**settings, **extra)


def _table_rel_l2(model: Any, live: dict, rank: int) -> dict[str, float]:
    """Per table: ||restored - live|| / ||live|| over the whole table (all ranks' blocks)."""
    import torch
    import torch.distributed as dist

    from embckpt.sharding import discover

    sums: dict[str, list[float]] = {}
    for shard in discover(model, rank).writer_shards():
        diff = (shard.weight.detach().double() - live[shard.key]).pow(2).sum()
        acc = sums.setdefault(shard.table, [0.0, 0.0])
        acc[0] += float(diff)
        acc[1] += float(live[shard.key].pow(2).sum())
    names = sorted(discover(model, rank).table_shapes)  # every table, on every rank
    totals = torch.tensor([sums.get(n, [0.0, 0.0]) for n in names], dtype=torch.float64)
    dist.all_reduce(totals)
    return {n: float((t[0] / t[1]).sqrt()) for n, t in zip(names, totals, strict=True)}


def _live(model: Any, rank: int) -> dict:
    from embckpt.sharding import discover

    return {
        s.key: s.weight.detach().double().clone() for s in discover(model, rank).writer_shards()
    }


def _probe_filesystem(
    rank: int,
    world_size: int,
    root: str,
    model_name: str,
    settings: dict,
    rate: float,
    seed: int,
    retries: Any,
) -> dict:
    import pyarrow.fs as pafs
    from faultfs import FaultPlan, FaultyHandler

    from embckpt import Checkpointer, EmbckptError

    job = MODELS[model_name](world_size)
    model, opt = job.build(seed=0)
    handler = FaultyHandler(FaultPlan(write_probability=rate, seed=seed * 10 + rank))
    fs = pafs.PyFileSystem(handler)
    config = _config(settings, retries)
    live: dict[int, dict] = {}
    failed = []
    with Checkpointer(model, f"{root}/run", optimizer=opt, config=config, filesystem=fs) as ckpt:
        for step in range(1, STEPS + 1):
            job.train_step(model, opt, step, rank)
            if step % 2:
                continue
            try:
                ckpt.save(step).wait()
                live[step] = _live(model, rank)
            except EmbckptError:
                failed.append(step)
        committed = ckpt.store.committed_steps()
    fresh, fresh_opt = job.build(seed=7)
    worst: dict[str, float] = {}
    with Checkpointer(fresh, f"{root}/run", optimizer=fresh_opt, config=config) as reader:
        for step in committed:
            reader.restore(step)
            for table, value in _table_rel_l2(fresh, live[step], rank).items():
                worst[table] = max(worst.get(table, 0.0), value)
    return {
        "failed_saves": failed,
        "committed": committed,
        "write_faults": handler.write_faults,
        "worst_rel_l2": max(worst.values()),
        "worst_rel_l2_by_table": worst,
    }


def _probe_in_process(rank: int, world_size: int, root: str, model_name: str, fail: bool) -> dict:
    from embckpt import Checkpointer, EmbckptError

    job = MODELS[model_name](world_size)
    model, opt = job.build(seed=0)
    config = _config(CONFIGS["incremental adaptive4 full_every=6"], None)
    outcome = []
    with Checkpointer(model, f"{root}/run", optimizer=opt, config=config) as ckpt:
        real = ckpt.store.write_file

        def failing(step: int, relative: str, *args: Any, **timing: Any) -> Any:
            if fail and rank == 0 and step == 2 and relative.startswith("dense/model"):
                raise OSError(f"injected: cannot write {relative} of step {step}")
            return real(step, relative, *args, **timing)

        ckpt.store.write_file = failing
        for step in (1, 2, 3):
            job.train_step(model, opt, step, rank)
            try:
                ckpt.save(step).wait()
                outcome.append("committed")
            except EmbckptError:
                outcome.append("failed")
        live = _live(model, rank)
    fresh, fresh_opt = job.build(seed=7)
    with Checkpointer(fresh, f"{root}/run", optimizer=fresh_opt, config=config) as reader:
        reader.restore(3)
        by_table = _table_rel_l2(fresh, live, rank)
    return {"saves": outcome, "rel_l2_by_table": by_table}


def main() -> None:
    from common import machine

    from embckpt.examples.launcher import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="after")
    parser.add_argument("--model", choices=sorted(MODELS), default="testsparsenn")
    parser.add_argument("--fault-rate", type=float, default=0.1)
    parser.add_argument("--seeds", type=int, default=3, help="faulty runs per config")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    import embckpt

    package = Path(embckpt.__file__).parent
    commit = subprocess.run(
        ["git", "-C", str(package), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result: dict[str, Any] = {
        "embckpt": str(package),
        "commit": commit or None,
        "model": args.model,
    }
    probe1: dict[str, Any] = {}
    for name, settings in CONFIGS.items():
        runs: dict[str, Any] = {}
        variants = [("clean", 0.0, 0, None)]
        variants += [(f"faulty seed {s}", args.fault_rate, s, None) for s in range(args.seeds)]
        variants += [
            (f"faulty seed {s}, write_retries=0", args.fault_rate, s, 0) for s in range(args.seeds)
        ]
        for label, rate, seed, retries in variants:
            with tempfile.TemporaryDirectory() as root:
                per_rank = run_ranks(
                    _probe_filesystem,
                    2,
                    root,
                    args.model,
                    settings,
                    rate,
                    seed,
                    retries,
                    timeout_s=600,
                )
            runs[label] = {
                **per_rank[0],
                "write_faults": [r["write_faults"] for r in per_rank],
            }
            print(name, label, runs[label]["failed_saves"], runs[label]["worst_rel_l2"], flush=True)
        faulty = [r for k, r in runs.items() if k != "clean"]
        probe1[name] = {
            "clean_worst_rel_l2": runs["clean"]["worst_rel_l2"],
            "faulty_worst_rel_l2": max(r["worst_rel_l2"] for r in faulty),
            "runs": runs,
        }
    result["probe_filesystem"] = probe1
    probe2 = {}
    for label, fail in (("clean", False), ("dense file of step 2 fails", True)):
        with tempfile.TemporaryDirectory() as root:
            probe2[label] = run_ranks(_probe_in_process, 2, root, args.model, fail, timeout_s=600)[
                0
            ]
        print("in-process", label, probe2[label], flush=True)
    result["probe_in_process"] = probe2
    result["machine"] = machine()
    result["command"] = " ".join(["python", *sys.argv])
    existing = json.loads(args.out.read_text()) if args.out.exists() else {}
    existing[f"{args.label} ({args.model})"] = result
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(existing, indent=2) + "\n")
    print(f"wrote {args.label} to {args.out}")


if __name__ == "__main__":
    main()
