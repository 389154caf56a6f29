"""A small DLRM with one table of each sharding type, for the multi-rank tests.

Deterministic batches come from (step, rank) alone, so an interrupted run and a run that never
stopped see exactly the same data; ``snapshot_state`` captures everything a bit-identical resume
must reproduce.
"""

from __future__ import annotations

from typing import Any

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM
from torchrec.optim.optimizers import in_backward_optimizer_filter

from embckpt.sharding import discover

COLLECTION = "sparse_arch.embedding_bag_collection"  # the module path the tables live under
ROWS = 240
DIM = 8
NUM_DENSE = 4
BATCH = 16
KINDS = ("tw", "rw", "cw", "twrw", "dp")


def table(kind: str) -> str:
    """Table ``t_<kind>``'s identity in a checkpoint: its collection's path and its name."""
    return f"{COLLECTION}.t_{kind}"


def build(
    world_size: int,
    seed: int,
    *,
    kinds: tuple[str, ...] = KINDS,
    rows: int = ROWS,
    optimizer: EmbOptimType = EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    sharding: dict[str, str] | None = None,
    fused: dict[str, Any] | None = None,
    device: str = "cpu",
):
    """A DMP model and its dense optimizer; ``seed`` sets every initial value. ``sharding``
    shards table ``t_<kind>`` as another kind instead (``{"tw": "rw"}``: a resharded job);
    ``fused`` adds FBGEMM options to the fused optimizer's (weight decay, EMA); ``device``:
    where the model runs (``cuda``: one rank per GPU)."""
    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(
            name=f"t_{k}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f"f_{k}"]
        )
        for k in kinds
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[16, DIM],
        over_arch_layer_sizes=[16, 1],
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": optimizer, "learning_rate": 0.1, **(fused or {})}
    )
    module_plan = plan_tables(
        model.sparse_arch.embedding_bag_collection,
        {f"t_{k}": (sharding or {}).get(k, k) for k in kinds},
        sharder,
        world_size,
        device,
    )
    plan = ShardingPlan({"sparse_arch.embedding_bag_collection": module_plan})
    dmp = DistributedModelParallel(
        model, device=torch.device(device), plan=plan, sharders=[sharder]
    )
    dense_params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    dense_opt = torch.optim.Adagrad(list(dense_params.values()), lr=0.05)
    return dmp, dense_opt


def plan_tables(
    ebc: Any, kinds: dict[str, str], sharder: Any, world_size: int, device_type: str = "cpu"
) -> Any:
    """The module sharding plan of ``ebc`` that shards each table as its kind says: ``tw``
    (on the last rank), ``rw``, ``cw`` (over every rank), ``twrw`` or ``dp``; fused kernels."""
    generators = {
        "tw": table_wise(rank=world_size - 1, compute_kernel="fused"),
        "rw": row_wise(compute_kernel="fused"),
        "cw": column_wise(ranks=list(range(world_size)), compute_kernel="fused"),
        "twrw": table_row_wise(host_index=0),
        "dp": data_parallel(),
    }
    module_plan = construct_module_sharding_plan(
        ebc,
        {name: generators[kind] for name, kind in kinds.items()},
        sharder=sharder,
        local_size=world_size,
        world_size=world_size,
        device_type=device_type,
    )
    for name, kind in kinds.items():
        if kind == "twrw":
            module_plan[name].compute_kernel = "fused"
    return module_plan


def batch(
    step: int, rank: int, kinds: tuple[str, ...] = KINDS, rows: int = ROWS, hot: int | None = None
) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    """Batch ``step`` of ``rank``: ids drawn from the first ``hot`` rows (all rows if None)."""
    gen = torch.Generator().manual_seed(step * 1009 + rank)
    high = hot or rows
    lengths = torch.randint(1, 3, (len(kinds) * BATCH,), generator=gen)
    values = torch.randint(0, high, (int(lengths.sum()),), generator=gen)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f_{k}" for k in kinds], values=values, lengths=lengths
    )
    dense = torch.rand(BATCH, NUM_DENSE, generator=gen)
    labels = (torch.rand(BATCH, generator=gen) < 0.3).float()
    return dense, kjt, labels


def train_step(dmp, opt, step: int, rank: int, **batch_kwargs) -> None:
    dense, kjt, labels = batch(step, rank, **batch_kwargs)
    opt.zero_grad()
    logits = dmp(dense, kjt).squeeze(-1)
    torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()
    opt.step()


def snapshot_state(dmp, opt, rank: int) -> dict[str, Any]:
    """Copies of every table block, optimizer state and dense tensor this rank holds."""
    out: dict[str, Any] = {}
    for shard in discover(dmp, rank).shards:
        out[f"w:{shard.key}"] = shard.weight.detach().clone()
        for name, t in {**shard.row_states, **shard.elem_states}.items():
            out[f"s:{shard.key}:{name}"] = t.detach().clone()
    for key, value in dmp.state_dict().items():
        if not hasattr(value, "local_shards"):
            out[f"d:{key}"] = value.detach().clone()
    for pid, state in opt.state_dict()["state"].items():
        for name, value in state.items():
            out[f"o:{pid}:{name}"] = torch.as_tensor(value).clone()
    return out


def writer_blocks(dmp, rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's writer blocks as ``Checkpointer.reconstruction()`` spells them: fp32 CPU
    copies of each block's ``weight``, ``row:<state>`` and ``elem:<state>``."""
    blocks = {}
    for shard in discover(dmp, rank).writer_shards():
        values = {"weight": shard.weight.detach().float().cpu().clone()}
        values.update({f"row:{n}": t.float().cpu().clone() for n, t in shard.row_states.items()})
        values.update({f"elem:{n}": t.float().cpu().clone() for n, t in shard.elem_states.items()})
        blocks[shard.key] = values
    return blocks


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Keys whose tensors are not bit-identical (or exist on one side only)."""
    keys = set(a) | set(b)
    return sorted(k for k in keys if k not in a or k not in b or not torch.equal(a[k], b[k]))


def raised(fn) -> str | None:
    """What ``fn()`` raised, as ``Type: message`` (None if it returned): scenarios on ranks
    report their errors to the test in the parent process."""
    try:
        fn()
    except Exception as exc:  # the scenario reports what was raised
        return f"{type(exc).__name__}: {exc}"
    return None
