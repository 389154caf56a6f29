"""The reference model: a TorchRec DLRM whose embedding tables are sharded over the process group.

Contract:

* ``build_model`` must be called on every rank of an initialised default process group, with the
  same ``cfg``; every rank starts from identical weights (seeded from ``cfg.seed``).
* Tables are sharded per ``cfg.sharding`` (see ``build_plan``). Every sharded table uses the
  fused kernel, whose optimizer (``dmp.fused_optimizer``) updates rows inside ``backward``; the
  optimizer ``build_model`` returns covers only the remaining (dense and data-parallel)
  parameters and is keyed by parameter name.
* ``train_step`` and ``evaluate`` run the sharded forward, which is collective: every rank must
  call them in the same order with batches of the same size.
"""

from __future__ import annotations

import numpy as np
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    ParameterShardingGenerator,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embckpt import ConfigError
from embckpt.examples.dataset import ClickDataset
from embckpt.examples.workload import WorkloadConfig

__all__ = [
    "EBC_MODULE_PATH",
    "build_tables",
    "build_plan",
    "build_model",
    "make_batch",
    "train_step",
    "evaluate",
]

EBC_MODULE_PATH = "sparse_arch.embedding_bag_collection"
"""Where the EmbeddingBagCollection sits inside DLRM; the key of the sharding plan."""

_FUSED = "fused"
_EMB_OPTIMIZERS = {
    "exact_rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "exact_adagrad": EmbOptimType.EXACT_ADAGRAD,
    "exact_sgd": EmbOptimType.EXACT_SGD,
    # Adam variants run on CUDA only ("not supported in CPU mode"); accepted for GPU runs.
    "adam": EmbOptimType.ADAM,
    "partial_rowwise_adam": EmbOptimType.PARTIAL_ROWWISE_ADAM,
}

Batch = tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]


def build_tables(cfg: WorkloadConfig) -> list[EmbeddingBagConfig]:
    """Returns one table per categorical feature: ``t_cat_i`` serves feature ``cat_i``."""
    return [
        EmbeddingBagConfig(
            name=table,
            embedding_dim=cfg.embedding_dim,
            num_embeddings=rows,
            feature_names=[feature],
        )
        for table, feature, rows in zip(
            cfg.table_names, cfg.feature_names, cfg.cardinalities, strict=True
        )
    ]


def build_plan(
    cfg: WorkloadConfig,
    world_size: int,
    ebc: EmbeddingBagCollection,
    *,
    device_type: str | None = None,
) -> ShardingPlan:
    """Builds the sharding plan of ``cfg.sharding`` for DLRM's embedding collection.

    ``table_wise`` tables without a rank (and tables ``cfg.sharding`` does not name) go to ranks
    round-robin; ``table_wise:R`` pins rank R; ``column_wise`` splits the columns over all ranks;
    ``table_row_wise`` splits the rows over the first host's ranks. No process group is needed.

    Args:
        cfg: the workload.
        world_size: ranks the tables are spread over.
        ebc: the unsharded collection (usually on the meta device).
        device_type: "cpu" or "cuda"; torchrec's guess from the machine if None.

    Returns:
        A plan whose only module path is ``EBC_MODULE_PATH``.

    Raises:
        ConfigError: the sharding names an unknown table, a rank outside the world, or a
            column-wise table whose dim does not divide by ``world_size``.
    """
    unknown = sorted(set(cfg.sharding) - set(cfg.table_names))
    if unknown:
        raise ConfigError(f"sharding names unknown tables {unknown}; known: {cfg.table_names}")
    generators: dict[str, ParameterShardingGenerator] = {}
    next_rank = 0
    for table in cfg.table_names:
        kind, _, rank_text = cfg.sharding.get(table, "table_wise").partition(":")
        if rank_text and kind != "table_wise":
            raise ConfigError(
                f"table {table}: only table_wise takes a rank, got {kind}:{rank_text}"
            )
        if kind == "table_wise":
            if rank_text:
                rank = _parse_rank(table, rank_text, world_size)
            else:
                rank, next_rank = next_rank, (next_rank + 1) % world_size
            generators[table] = table_wise(rank=rank, compute_kernel=_FUSED)
        elif kind == "row_wise":
            generators[table] = row_wise(compute_kernel=_FUSED)
        elif kind == "column_wise":
            if cfg.embedding_dim % world_size:
                raise ConfigError(
                    f"table {table}: column_wise needs embedding_dim={cfg.embedding_dim} to be "
                    f"divisible by world_size={world_size}"
                )
            generators[table] = column_wise(ranks=list(range(world_size)), compute_kernel=_FUSED)
        elif kind == "table_row_wise":
            generators[table] = table_row_wise(host_index=0)
        else:
            generators[table] = data_parallel()
    module_plan = construct_module_sharding_plan(
        ebc,
        generators,
        local_size=get_local_size(world_size),
        world_size=world_size,
        device_type=device_type,
    )
    for table, kind in cfg.sharding.items():
        if kind == "table_row_wise":
            # table_row_wise() takes no compute_kernel and would pick the dense one.
            module_plan[table].compute_kernel = _FUSED
    return ShardingPlan({EBC_MODULE_PATH: module_plan})


def _parse_rank(table: str, text: str, world_size: int) -> int:
    if not text.isdigit() or int(text) >= world_size:
        raise ConfigError(f"table {table}: table_wise rank {text!r} is not in [0, {world_size})")
    return int(text)


def build_model(
    cfg: WorkloadConfig, device: torch.device, world_size: int
) -> tuple[DistributedModelParallel, KeyedOptimizerWrapper]:
    """Builds the sharded DLRM and the optimizer of its non-fused parameters.

    Args:
        cfg: the workload.
        device: this rank's device.
        world_size: size of the default process group.

    Returns:
        The sharded model and an Adagrad optimizer (``cfg.dense_learning_rate``) over every
        parameter the fused embedding optimizer does not own, keyed by parameter name.

    Raises:
        ConfigError: unknown embedding optimizer, or an invalid sharding (see ``build_plan``).
    """
    optimizer_type = _EMB_OPTIMIZERS.get(cfg.embedding_optimizer)
    if optimizer_type is None:
        raise ConfigError(
            f"embedding_optimizer {cfg.embedding_optimizer!r} is not one of "
            f"{sorted(_EMB_OPTIMIZERS)}"
        )
    # Seeded first so that every rank draws the same dense weights and unsharded tables.
    torch.manual_seed(cfg.seed)
    ebc = EmbeddingBagCollection(tables=build_tables(cfg), device=torch.device("meta"))
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=cfg.num_dense,
        dense_arch_layer_sizes=list(cfg.dense_arch),
        over_arch_layer_sizes=list(cfg.over_arch),
        dense_device=device,
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": optimizer_type, "learning_rate": cfg.learning_rate}
    )
    plan = build_plan(cfg, world_size, ebc, device_type=device.type)
    dmp = DistributedModelParallel(
        module=model,
        device=device,
        plan=plan,
        sharders=[sharder],  # type: ignore[list-item]
    )
    dense_params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    optimizer = KeyedOptimizerWrapper(
        dense_params, lambda params: torch.optim.Adagrad(params, lr=cfg.dense_learning_rate)
    )
    return dmp, optimizer


def make_batch(
    dataset: ClickDataset, indices: np.ndarray, cfg: WorkloadConfig, device: torch.device
) -> Batch:
    """Gathers samples ``indices`` into model inputs.

    Args:
        dataset: the samples; its features must be ``cfg.feature_names`` in order.
        indices: int64 sample indices.
        cfg: the workload (feature names).
        device: where the tensors go.

    Returns:
        Dense features ``[B, num_dense]``, a KJT keyed by ``cfg.feature_names`` whose values are
        feature-major (all samples' ids of feature 0, then feature 1, ...), and labels ``[B]``.

    Raises:
        ConfigError: the dataset's feature count differs from the config's.
    """
    names = cfg.feature_names
    if dataset.num_features != len(names):
        raise ConfigError(
            f"dataset has {dataset.num_features} categorical features, config has {len(names)}"
        )
    k = dataset.ids_per_feature
    batch_size = len(indices)
    # [B, F * k] sample-major -> [F, B, k] -> flat: the KJT wants one feature's ids contiguous.
    ids = dataset.sparse[indices].reshape(batch_size, len(names), k).transpose(1, 0, 2)
    sparse = KeyedJaggedTensor(
        keys=names,
        values=torch.from_numpy(np.ascontiguousarray(ids).reshape(-1)).to(device),
        lengths=torch.full((len(names) * batch_size,), k, dtype=torch.int32, device=device),
    )
    dense = torch.from_numpy(dataset.dense[indices]).to(device)
    labels = torch.from_numpy(dataset.labels[indices]).to(device)
    return dense, sparse, labels


def train_step(dmp: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> float:
    """Runs one forward/backward/step; the fused tables update during backward.

    Returns:
        This rank's mean binary cross-entropy of the batch.
    """
    dense, sparse, labels = batch
    optimizer.zero_grad()
    logits = dmp(dense, sparse).squeeze(-1)
    loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def evaluate(
    dmp: nn.Module,
    dataset: ClickDataset,
    indices: np.ndarray,
    cfg: WorkloadConfig,
    device: torch.device,
    batch_size: int = 4096,
) -> dict[str, float]:
    """Scores samples ``indices`` without updating the model (collective: call on every rank).

    Returns:
        ``{"auc": ..., "logloss": ...}``; AUC is NaN when the labels hold only one class.
    """
    was_training = dmp.training
    dmp.eval()
    chunks: list[torch.Tensor] = []
    try:
        with torch.no_grad():
            for start in range(0, len(indices), batch_size):
                dense, sparse, _ = make_batch(
                    dataset, indices[start : start + batch_size], cfg, device
                )
                chunks.append(dmp(dense, sparse).squeeze(-1).float().cpu())
    finally:
        dmp.train(was_training)
    logits = torch.cat(chunks) if chunks else torch.empty(0)
    labels = torch.from_numpy(dataset.labels[indices])
    logloss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
    return {"auc": _auc(logits.numpy(), labels.numpy()), "logloss": float(logloss)}


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Rank-based (Mann-Whitney) ROC AUC; tied scores share their average rank."""
    positives = labels > 0.5
    n_pos = int(positives.sum())
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    # 1-based average rank of each distinct score: its group's last rank minus half the ties.
    average_rank = np.cumsum(counts) - (counts - 1) / 2.0
    rank_sum = average_rank[inverse][positives].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))
