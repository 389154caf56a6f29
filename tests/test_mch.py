"""Managed-collision (MCH / ZCH) models: a ManagedCollisionEmbeddingBagCollection (or, pooled
by the test's head, a ManagedCollisionEmbeddingCollection) whose table is remapped by an
MCHManagedCollisionModule with DistanceLFU eviction, row-wise on 2 gloo ranks.

Each configuration saves a chain (full, diff, diff) while training, is restored into a model
built from other initial values and compared bit for bit with the run that never stopped: right
after the restore, and after more steps (weights, fused and dense optimizer state, the MCH
buffers, and the eviction counters and history). The chain is also restored onto 1 rank (the
MCH buffers are rebuilt from both writers' rows, as TorchRec's own load does); a chain written
by 1 rank is refused on 2 ranks, a failed restore leaves the MCH state as it was, and a model
holding sharded state of an unknown module is refused when the Checkpointer is built.

CPU limits: an eviction resets the evicted rows' row-wise Adagrad momentum through
``fbgemm::reset_weight_momentum``, which has no CPU kernel, so evictions run here with
element-wise Adagrad (FBGEMM skips the reset for it), and row-wise Adagrad runs with an eviction
interval longer than the test.
"""

from __future__ import annotations

import tempfile
from typing import Any

import numpy as np
import torch
import toy_model as tm
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    JaggedTensor,
    KeyedJaggedTensor,
)
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.mc_modules import ManagedCollisionCollectionSharder
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from torchrec.optim.optimizers import in_backward_optimizer_filter

from embckpt.examples.launcher import run_ranks

ZCH = 48  # table rows, the MCH's slots (24 per rank)
IDS = 600  # raw ids: [0, 300) are routed to rank 0, [300, 600) to rank 1
DIM = 8
SAVES = (3, 5, 7)  # full, diff, diff; the job stops after step 7, mid eviction interval
END = 12
# name -> (pooled, fused optimizer, eviction interval): evictions at steps 3, 6, 9, 12, or never.
# Pooled: a ManagedCollisionEmbeddingBagCollection, else a ManagedCollisionEmbeddingCollection.
CONFIGS = {
    "rowwise_no_eviction": (True, EmbOptimType.EXACT_ROWWISE_ADAGRAD, 10**6),
    "adagrad_eviction": (True, EmbOptimType.EXACT_ADAGRAD, 3),
    "sequence_adagrad_eviction": (False, EmbOptimType.EXACT_ADAGRAD, 3),
}
MCH = "mc._managed_collision_collection._managed_collision_modules.m"


class McModel(nn.Module):
    """One managed-collision table and a linear head over each sample's summed embeddings."""

    def __init__(self, mc: nn.Module, pooled: bool) -> None:
        super().__init__()
        self.mc = mc
        self.pooled = pooled
        self.head = nn.Linear(DIM, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        embeddings, _ = self.mc(kjt)
        if self.pooled:
            summed = embeddings["f"]
        else:  # every sample has 2 ids
            summed = embeddings["f"].values().view(-1, 2, DIM).sum(dim=1)
        return self.head(summed).squeeze(-1)


def build(world_size: int, seed: int, config: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The DMP model of ``config`` and its dense optimizer; ``seed`` sets the initial values."""
    pooled, optimizer, interval = CONFIGS[config]
    torch.manual_seed(seed)
    kind = EmbeddingBagConfig if pooled else EmbeddingConfig
    table = kind(name="m", embedding_dim=DIM, num_embeddings=ZCH, feature_names=["f"])
    meta = torch.device("meta")
    mch = MCHManagedCollisionModule(
        zch_size=ZCH,
        device=meta,
        eviction_policy=DistanceLFU_EvictionPolicy(),
        eviction_interval=interval,
        input_hash_size=IDS,
    )
    fused = {"optimizer": optimizer, "learning_rate": 0.1}
    collection = ManagedCollisionCollection({"m": mch}, [table])
    mc: nn.Module
    sharder: Any
    if pooled:
        ebc = EmbeddingBagCollection(tables=[table], device=meta)
        mc = ManagedCollisionEmbeddingBagCollection(ebc, collection)
        sharder = ManagedCollisionEmbeddingBagCollectionSharder(
            EmbeddingBagCollectionSharder(fused_params=fused), ManagedCollisionCollectionSharder()
        )
    else:
        ec = EmbeddingCollection(tables=[table], device=meta)
        mc = ManagedCollisionEmbeddingCollection(ec, collection)
        sharder = ManagedCollisionEmbeddingCollectionSharder(
            EmbeddingCollectionSharder(fused_params=fused), ManagedCollisionCollectionSharder()
        )
    module_plan = construct_module_sharding_plan(
        mc,
        {"m": row_wise(compute_kernel="fused")},
        sharder=sharder,
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
    )
    dmp = DistributedModelParallel(
        McModel(mc, pooled),
        device=torch.device("cpu"),
        plan=ShardingPlan({"mc": module_plan}),
        sharders=[sharder],
    )
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    return dmp, torch.optim.Adagrad(list(dense.values()), lr=0.05)


def train_step(dmp: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    """Batch ``step`` of ``rank``: half its ids from 40 hot ones, half from every id."""
    gen = torch.Generator().manual_seed(step * 1009 + rank)
    hot = torch.randint(0, 40, (16,), generator=gen) * (IDS // 40)
    values = torch.cat([hot, torch.randint(0, IDS, (16,), generator=gen)])
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=values, lengths=torch.full((16,), 2, dtype=torch.long)
    )
    labels = (torch.rand(16, generator=gen) < 0.3).float()
    opt.zero_grad()
    loss = nn.functional.binary_cross_entropy_with_logits(dmp(kjt), labels)
    loss.backward()
    opt.step()


def mch_module(dmp: nn.Module) -> Any:
    return dmp.module.mc._managed_collision_collection._managed_collision_modules["m"]


def snapshot(dmp: nn.Module, opt: torch.optim.Optimizer, rank: int) -> dict[str, torch.Tensor]:
    """Everything a bit-identical resume reproduces on this rank, read from TorchRec itself:
    table blocks, optimizer states, dense state, MCH buffers, eviction counters and history."""
    out = tm.snapshot_state(dmp, opt, rank)
    for key, value in dmp.state_dict().items():
        if key.startswith(MCH) and hasattr(value, "local_shards"):
            out[f"mch:{key}"] = value.local_shards()[0].tensor.clone()
    module = mch_module(dmp)
    filled = module._current_history_buffer_offset
    out["mch:counters"] = torch.tensor(
        [module._current_iter, module._last_eviction_iter, module._input_history_buffer_size]
    )
    if filled:
        out["mch:history"] = module._history_accumulator[:filled].clone()
        for name, values in module._history_metadata.items():
            out[f"mch:history:{name}"] = values[:filled].clone()
    return out


def _two_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Per configuration: a chain saved while training, restored into a model built from other
    initial values, and what differs from the run that never stopped."""
    from embckpt import CheckpointConfig, Checkpointer

    out: dict[str, Any] = {}
    for config in CONFIGS:
        directory = f"{root}/{config}"
        settings = CheckpointConfig(policy="incremental", full_every=0)
        model, opt = build(world_size, 0, config)
        pending = []
        data = {"data": Position(rank)}
        with Checkpointer(model, directory, optimizer=opt, config=settings, statefuls=data) as ckpt:
            for step in range(1, SAVES[-1] + 1):
                train_step(model, opt, step, rank)
                if step in SAVES:  # persisted in the background while training goes on
                    pending.append(ckpt.save(step))
            kinds = [p.wait().kind for p in pending]
        at_stop = snapshot(model, opt, rank)
        for step in range(SAVES[-1] + 1, END + 1):
            train_step(model, opt, step, rank)
        at_end = snapshot(model, opt, rank)

        fresh, fresh_opt = build(world_size, 1234, config)
        statefuls = {"data": Position(rank)}
        with Checkpointer(
            fresh, directory, optimizer=fresh_opt, config=settings, statefuls=statefuls
        ) as ckpt:
            result = ckpt.load()
        after_restore = tm.differences(at_stop, snapshot(fresh, fresh_opt, rank))
        for step in range(SAVES[-1] + 1, END + 1):
            train_step(fresh, fresh_opt, step, rank)
        out[config] = {
            "kinds": kinds,
            "chain": result.chain if result else None,
            "skipped": result.skipped if result else None,
            "after_restore": after_restore,
            "after_more": tm.differences(at_end, snapshot(fresh, fresh_opt, rank)),
            "slots_used": int((at_stop[f"mch:{MCH}._mch_sorted_raw_ids"] < IDS).sum()),
            "evicted_at": at_stop["mch:counters"][1].item(),
            "at_stop": _arrays(at_stop),
        }
    return out


def _one_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Restores each 2-rank chain onto 1 rank, trains on (evictions included), and saves a
    1-rank checkpoint for the refusal below."""
    from embckpt import Checkpointer

    out = {}
    for config in CONFIGS:
        model, opt = build(world_size, 99, config)
        with Checkpointer(model, f"{root}/{config}", optimizer=opt) as ckpt:
            result = ckpt.load()
        restored = snapshot(model, opt, rank)
        module = mch_module(model)
        raw_ids = restored[f"mch:{MCH}._mch_sorted_raw_ids"]
        remapped = module.remap({"f": JaggedTensor(raw_ids, lengths=torch.ones_like(raw_ids))})["f"]
        for step in range(SAVES[-1] + 1, END + 1):
            train_step(model, opt, step, rank)
        with Checkpointer(model, f"{root}/one_{config}", optimizer=opt) as ckpt:
            ckpt.save(END).wait()
        out[config] = {
            "skipped": result.skipped if result else None,
            "restored": _arrays(restored),
            "remapped": remapped.values().numpy(),
            "evicted_at": module._last_eviction_iter,
        }
    return out


def _arrays(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Tensors as numpy arrays: a rank's results reach the test by value (torch would share
    their memory through file descriptors that die with the rank)."""
    return {key: value.numpy() for key, value in state.items()}


class Position:
    """A data position that refuses to load on rank 1 when told to."""

    def __init__(self, rank: int, refuse: bool = False) -> None:
        self.rank = rank
        self.refuse = refuse

    def state_dict(self) -> dict[str, int]:
        return {"rank": self.rank}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if self.refuse and self.rank == 1:
            raise ValueError("refused on rank 1")


class UnknownSharded(nn.Module):
    """A module embckpt does not know, holding row-wise sharded state."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__()
        shard = Shard(torch.zeros(4), ShardMetadata([4 * rank], [4], f"rank:{rank}/cpu"))
        self.rows = ShardedTensor._init_from_local_shards([shard], [4 * world_size])

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        destination[f"{prefix}rows"] = self.rows


class OtherCollisionModule(nn.Module):
    """Stands for a managed-collision module type embckpt does not restore."""


def _refusals(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """A restore failing on rank 1 leaves every rank's MCH state as it was; a 1-rank chain is
    refused on 2 ranks; unknown sharded modules are refused by the constructor."""
    from embckpt import Checkpointer

    out: dict[str, Any] = {}
    model, opt = build(world_size, 5, "adagrad_eviction")
    for step in (1, 2):  # history and counters differ from the checkpoint's
        train_step(model, opt, step, rank)
    before = snapshot(model, opt, rank)
    refusing = {"data": Position(rank, refuse=True)}
    with Checkpointer(model, f"{root}/adagrad_eviction", optimizer=opt, statefuls=refusing) as ck:
        out["failed"] = tm.raised(ck.restore)
    out["rolled_back"] = tm.differences(before, snapshot(model, opt, rank))
    with Checkpointer(model, f"{root}/one_adagrad_eviction", optimizer=opt) as ckpt:
        out["more_ranks"] = tm.raised(ckpt.restore)
    model.module.extra = UnknownSharded(rank, world_size)
    out["unknown_sharded"] = tm.raised(lambda: Checkpointer(model, f"{root}/refused"))
    del model.module.extra
    collection = model.module.mc._managed_collision_collection
    collection._managed_collision_modules["m"] = OtherCollisionModule()
    out["unknown_mc"] = tm.raised(lambda: Checkpointer(model, f"{root}/refused"))
    return out


def test_mch_resume_restore_onto_one_rank_and_refusals() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_two_ranks, 2, root, timeout_s=120)
        (one,) = run_ranks(_one_rank, 1, root, timeout_s=120)
        refused = run_ranks(_refusals, 2, root, timeout_s=120)
    _check_resume(results)
    for config in CONFIGS:
        _check_one_rank(config, [r[config]["at_stop"] for r in results], one[config])
    for config in ("adagrad_eviction", "sequence_adagrad_eviction"):
        assert one[config]["evicted_at"] == 10, config  # 3 steps after the restore at step 7
    for rank, got in enumerate(refused):
        assert got["failed"] is not None and "refused on rank 1" in got["failed"], got
        assert got["rolled_back"] == [], rank
        assert got["more_ranks"] is not None, rank
        assert got["more_ranks"].startswith("ModelMismatchError"), got
        assert f"managed-collision module {MCH} (MCHManagedCollisionModule)" in got["more_ranks"]
        assert "rows [0, 24)" in got["more_ranks"] or "rows [24, 48)" in got["more_ranks"]
        assert got["unknown_sharded"] is not None, rank
        assert got["unknown_sharded"].startswith("ConfigError: module extra (UnknownSharded)")
        assert got["unknown_mc"] is not None, rank
        assert got["unknown_mc"].startswith(
            f"ConfigError: managed-collision module {MCH} (OtherCollisionModule)"
        )


def _check_one_rank(config: str, writers: list[dict], got: dict[str, Any]) -> None:
    """The 1-rank restore holds the writers' rows and optimizer state at their global rows,
    their MCH buffers concatenated and sorted by raw id, and remaps every id as they did."""
    assert got["skipped"] == (
        "RNG streams: written by 2 ranks, restoring onto 1",
        "stateful 'data': the checkpoint holds it, but statefuls= does not name it",
        f"managed-collision module {MCH} (MCHManagedCollisionModule): eviction history "
        "(written by 2 ranks; starts afresh)",
    ), config
    restored = got["restored"]
    for key in restored:
        if key.startswith(("w:", "s:")):
            blocks = [w[key.replace("r0_c0", f"r{24 * r}_c0")] for r, w in enumerate(writers)]
            assert np.array_equal(restored[key], np.concatenate(blocks)), (config, key)
        elif key.startswith(("d:", "o:")):
            assert np.array_equal(restored[key], writers[0][key]), (config, key)
    prefix = f"mch:{MCH}."
    raw_ids = np.concatenate([w[f"{prefix}_mch_sorted_raw_ids"] for w in writers])
    order = np.argsort(raw_ids, kind="stable")
    for name in ("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping", "_mch_counts"):
        expected = np.concatenate([w[prefix + name] for w in writers])[order]
        assert np.array_equal(restored[prefix + name], expected), (config, name)
    known = restored[f"{prefix}_mch_sorted_raw_ids"] < IDS
    mapping = restored[f"{prefix}_mch_remapped_ids_mapping"]
    assert np.array_equal(got["remapped"][known], mapping[known]), config


def _check_resume(results: list[dict[str, Any]]) -> None:
    for rank, per_config in enumerate(results):
        for config, got in per_config.items():
            where = f"rank {rank}, {config}"
            assert got["kinds"] == ["full", "diff", "diff"], where
            assert got["chain"] == SAVES, where
            assert got["skipped"] == (), where
            assert got["after_restore"] == [], where
            assert got["after_more"] == [], where
        for config in ("adagrad_eviction", "sequence_adagrad_eviction"):
            evicting = per_config[config]
            assert evicting["slots_used"] > 0 and evicting["evicted_at"] == 6, (rank, config)
        assert per_config["rowwise_no_eviction"]["slots_used"] == 0, rank
