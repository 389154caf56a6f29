"""A training job shaped like a real TorchRec one, checkpointed with embckpt.

    torchrun --nproc_per_node 2 -m embckpt.examples.train_torchrun --dir /tmp/ckpts --steps 300

A sharded DLRM trains under TorchRec's ``TrainPipelineSparseDist`` with a ``CombinedOptimizer``
(the DMP's fused embedding optimizer and an Adagrad over the dense parameters); gloo on CPU,
NCCL on CUDA. On start it restores the latest checkpoint of ``--dir``, so running the same
command again after the job was killed resumes it: every batch is trained exactly once, and a
lossless resume ends bit-identical to a run that was never killed (``--digest`` writes a hash of
each rank's final state to compare).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

import embckpt
from embckpt.examples.dataset import ClickDataset
from embckpt.examples.model import EBC_MODULE_PATH, build_plan, build_tables, make_batch
from embckpt.examples.synthetic import make_synthetic_dataset
from embckpt.examples.workload import WorkloadConfig

# A small Criteo-shaped workload: quick on two CPU ranks, every sharding type used.
WORKLOAD = WorkloadConfig(
    num_dense=4,
    cardinalities=(400, 300, 200, 100),
    embedding_dim=8,
    num_samples=4096,
    batch_size=32,
    dense_arch=(16, 8),
    over_arch=(16, 1),
    sharding={
        "t_cat_0": "row_wise",
        "t_cat_1": "column_wise",
        "t_cat_2": "table_wise",
        "t_cat_3": "data_parallel",
    },
)


def build(
    cfg: WorkloadConfig, device: torch.device, world_size: int
) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    """The sharded ``DLRMTrain`` (what the pipeline calls) and its ``CombinedOptimizer``."""
    torch.manual_seed(cfg.seed)
    ebc = EmbeddingBagCollection(tables=build_tables(cfg), device=torch.device("meta"))
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=cfg.num_dense,
            dense_arch_layer_sizes=list(cfg.dense_arch),
            over_arch_layer_sizes=list(cfg.over_arch),
            dense_device=device,
        )
    )
    plan = build_plan(cfg, world_size, ebc, device_type=device.type)
    sharder = EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": cfg.learning_rate,
        }
    )
    dmp = DistributedModelParallel(
        module=model,
        device=device,
        plan=ShardingPlan({f"model.{EBC_MODULE_PATH}": plan.plan[EBC_MODULE_PATH]}),
        sharders=[sharder],  # type: ignore[list-item]
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=cfg.dense_learning_rate),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def train(
    directory: str,
    steps: int,
    *,
    interval: int = 10,
    cfg: WorkloadConfig = WORKLOAD,
    on_step: Callable[[int, np.ndarray], None] | None = None,
) -> dict[str, Any]:
    """Restores the latest checkpoint of ``directory`` (if any) and trains up to ``steps``.

    Every rank of an initialised process group calls it.

    Args:
        directory: the checkpoint directory (local path or URI).
        steps: the last step to train.
        interval: checkpoint every ``interval`` steps.
        cfg: the workload.
        on_step: called after each step with the step and the sample indices it trained on.

    Returns:
        ``{"restored": step or None, "digest": hash of this rank's final state}``.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = _device()
    dmp, optimizer = build(cfg, device, world_size)
    dataset = make_synthetic_dataset(cfg)
    # count_trained: the pipeline reads two batches ahead; the checkpoint keeps the position
    # of the batches the model has trained on.
    sampler = embckpt.ResumableSampler(
        cfg.num_samples, cfg.batch_size, rank=rank, world_size=world_size, count_trained=True
    )
    config = embckpt.CheckpointConfig(interval=interval, adaptive_interval=False)
    in_flight: deque[np.ndarray] = deque()
    with embckpt.Checkpointer(
        dmp, directory, optimizer=optimizer, config=config, statefuls={"data": sampler}
    ) as ckpt:
        restored = ckpt.restore()
        pipeline = TrainPipelineSparseDist(dmp, optimizer, device)
        batches = _batches(dataset, sampler, cfg, device, in_flight)
        for step in range((restored or 0) + 1, steps + 1):
            pipeline.progress(batches)
            sampler.mark_trained()
            trained = in_flight.popleft()
            if on_step is not None:
                on_step(step, trained)
            ckpt.maybe_save(step)
    return {"restored": restored, "digest": state_digest(dmp, optimizer, sampler)}


def _batches(
    dataset: ClickDataset,
    sampler: embckpt.ResumableSampler,
    cfg: WorkloadConfig,
    device: torch.device,
    handed_out: deque[np.ndarray],
) -> Iterator[Batch]:
    for indices in sampler:
        handed_out.append(indices)
        dense, sparse, labels = make_batch(dataset, indices, cfg, device)
        yield Batch(dense_features=dense, sparse_features=sparse, labels=labels)


def state_digest(dmp: torch.nn.Module, optimizer: Any, sampler: Any) -> str:
    """SHA-256 of this rank's model, optimizer and data position (its own table blocks)."""
    digest = hashlib.sha256()

    def add(name: str, value: Any) -> None:
        if hasattr(value, "local_shards"):
            for shard in value.local_shards():
                add(f"{name}@{shard.metadata.shard_offsets}", shard.tensor)
        elif isinstance(value, torch.Tensor):
            digest.update(name.encode())
            digest.update(value.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                add(f"{name}/{key}", value[key])
        else:
            digest.update(f"{name}={value!r}".encode())

    add("model", dmp.state_dict())
    add("optimizer", optimizer.state_dict())
    add("data", sampler.state_dict())
    return digest.hexdigest()


def _device() -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="checkpoint directory")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--interval", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--digest", help="write each rank's final state hash to this JSON file")
    args = parser.parse_args(argv)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    try:
        result = train(args.dir, args.steps, interval=args.interval)
        digests = [None] * dist.get_world_size()
        dist.all_gather_object(digests, result["digest"])
        if dist.get_rank() == 0:
            print(f"trained to step {args.steps} (restored: {result['restored']})", flush=True)
            if args.digest:
                with open(args.digest, "w") as out:
                    json.dump({"restored": result["restored"], "digests": digests}, out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
