"""A table is its collection's module path plus its name: two collections may both hold a ``t0``.

Two towers (``user`` and ``item``), each an EmbeddingBagCollection with tables ``t0`` and
``t1``, sharded differently, on 2 gloo ranks: a full and two diffs save and restore exactly,
onto the same plan, onto 1 rank and onto another plan, and training goes on from the restore
exactly as in the run that never stopped. A manifest listing one file twice is refused by the
writer and by ``verify``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import toy_model as tm
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ShardingPlan
from torchrec.optim.optimizers import in_backward_optimizer_filter

from embckpt.examples.launcher import run_ranks

TOWERS = ("user", "item")
TABLES = ("t0", "t1")
ROWS, DIM, BATCH = 96, 8, 8
SAVES = (2, 4, 6)  # a full, then incremental diffs
MORE = (7, 8)  # trained after the restore


class TwoTowers(torch.nn.Module):
    """Two collections with the same table names, and a dense head over both."""

    def __init__(self) -> None:
        super().__init__()
        for tower in TOWERS:
            tables = [
                EmbeddingBagConfig(
                    name=t, embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"{tower}_{t}"]
                )
                for t in TABLES
            ]
            setattr(self, tower, EmbeddingBagCollection(tables=tables, device=torch.device("meta")))
        self.head = torch.nn.Linear(2 * len(TABLES) * DIM, 1)

    def forward(self, kjts: dict[str, KeyedJaggedTensor]) -> torch.Tensor:
        pooled = [getattr(self, t)(kjts[t]).values() for t in TOWERS]
        return self.head(torch.cat(pooled, dim=1)).squeeze(-1)


def _build(world_size: int, kinds: dict[str, str]) -> tuple[Any, Any]:
    """``kinds``: ``"<tower>.<table>"`` -> sharding kind of ``tm.plan_tables``."""
    torch.manual_seed(3)
    model = TwoTowers()
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
    )
    plan = ShardingPlan(
        {
            tower: tm.plan_tables(
                getattr(model, tower),
                {t: kinds[f"{tower}.{t}"] for t in TABLES},
                sharder,
                world_size,
            )
            for tower in TOWERS
        }
    )
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    return dmp, torch.optim.Adagrad(list(dense.values()), lr=0.05)


def _train(dmp: Any, opt: Any, step: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(step * 7919 + rank)
    kjts = {}
    for tower in TOWERS:
        lengths = torch.randint(1, 3, (len(TABLES) * BATCH,), generator=gen)
        values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=gen)
        kjts[tower] = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"{tower}_{t}" for t in TABLES], values=values, lengths=lengths
        )
    labels = (torch.rand(BATCH, generator=gen) < 0.3).float()
    opt.zero_grad()
    torch.nn.functional.binary_cross_entropy_with_logits(dmp(kjts), labels).backward()
    opt.step()


WRITER = {"user.t0": "rw", "user.t1": "tw", "item.t0": "tw", "item.t1": "cw"}
OTHER = {"user.t0": "tw", "user.t1": "rw", "item.t0": "cw", "item.t1": "rw"}


def _write(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from embckpt import CheckpointConfig, Checkpointer

    dmp, opt = _build(world_size, WRITER)
    states = {}
    config = CheckpointConfig(policy="incremental", full_every=0)
    with Checkpointer(dmp, root, optimizer=opt, config=config) as ckpt:
        for step in range(1, SAVES[-1] + 1):
            _train(dmp, opt, step, rank)
            if step in SAVES:
                ckpt.save(step).wait()
        for step in MORE:  # the run that never stopped
            _train(dmp, opt, step, rank)
    states["continued"] = _global_tables(dmp)
    return states


def _global_tables(dmp: Any) -> dict[str, np.ndarray]:
    """Every table's weight and row-wise momentum, gathered whole from the blocks of every rank
    (so that runs on different world sizes and plans compare); numpy, to cross processes."""
    import torch.distributed as dist

    from embckpt.sharding import discover

    blocks = [
        (s.table, s.row_offset, s.col_offset, s.weight.clone(), dict(s.row_states))
        for s in discover(dmp, dist.get_rank()).shards
    ]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, blocks)
    tables: dict[str, torch.Tensor] = {}
    for rank_blocks in everyone:
        for table, row, col, weight, row_states in rank_blocks:
            whole = tables.setdefault(f"w:{table}", torch.zeros(ROWS, DIM))
            whole[row : row + weight.shape[0], col : col + weight.shape[1]] = weight
            for name, values in row_states.items():
                if col == 0:  # a row-wise state is whole in every column block
                    state = tables.setdefault(f"s:{table}:{name}", torch.zeros(ROWS))
                    state[row : row + len(values)] = values
    return {key: value.numpy().copy() for key, value in tables.items()}


def _restore(rank: int, world_size: int, root: str, kinds: dict[str, str]) -> dict[str, Any]:
    from embckpt import Checkpointer

    dmp, opt = _build(world_size, kinds)
    with Checkpointer(dmp, root, optimizer=opt) as ckpt:
        step = ckpt.restore()
    restored = _global_tables(dmp)
    for more in MORE:
        _train(dmp, opt, more, rank)
    return {"step": step, "restored": restored, "continued": _global_tables(dmp)}


def _restored_at_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """The state at the last save, from a run that trains as the writer did and stops there."""
    dmp, opt = _build(world_size, WRITER)
    for step in range(1, SAVES[-1] + 1):
        _train(dmp, opt, step, rank)
    return _global_tables(dmp)


def test_two_collections_with_the_same_table_names(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    written = run_ranks(_write, 2, root)
    from embckpt.storage.chain import read_manifest
    from embckpt.storage.fs import CheckpointStore
    from embckpt.storage.manifest_types import plain

    manifest = plain(read_manifest(CheckpointStore(root), 6))  # every rank's part read
    names = sorted(t["name"] for t in manifest["tables"])
    assert names == ["item.t0", "item.t1", "user.t0", "user.t1"]
    # One path per file, but for the blocks of a packed file (each with its own number).
    keys = [(f["path"], f.get("block")) for f in manifest["files"]]
    assert len(keys) == len(set(keys))
    assert any(
        f["table"] == "item.t0"
        and (f["block"] is not None or f["path"].startswith("tables/item.t0/"))
        for f in manifest["files"]
    )
    at_save = run_ranks(_restored_at_save, 2, root)[0]
    for world_size, kinds in ((2, WRITER), (1, WRITER), (2, OTHER)):
        results = run_ranks(_restore, world_size, root, kinds)
        where = (world_size, kinds is OTHER)
        assert {r["step"] for r in results} == {SAVES[-1]}, where
        restored = results[0]["restored"]
        assert restored.keys() == at_save.keys(), where
        resharded = world_size == 1 or kinds is OTHER
        for key in at_save:
            # Row-wise states of a column-wise table are one per column block: resharded,
            # a block spanning several gets their mean (docs/ARCHITECTURE.md), not a copy.
            if not (resharded and key.startswith("s:item.t1:")):
                assert np.array_equal(restored[key], at_save[key]), (where, key)
        if kinds is WRITER and world_size == 2:  # continuation: bit for bit, same plan
            for key, value in written[0]["continued"].items():
                assert np.array_equal(results[0]["continued"][key], value), (where, key)


def test_a_manifest_listing_one_file_twice_is_refused(run_copy: Path) -> None:
    from embckpt.errors import CheckpointCorruptError
    from embckpt.storage.chain import read_manifest
    from embckpt.storage.fs import CheckpointStore
    from embckpt.storage.manifest import _checksum
    from embckpt.storage.verify import verify

    store = CheckpointStore(run_copy / "one_shot")
    path = run_copy / "one_shot" / "step_000000000005" / "MANIFEST.json"
    # Every file in the manifest itself (no rank parts), as a merge writes it.
    whole = dataclasses.replace(read_manifest(store, 5), parts=(), loaded=None)
    body = json.loads(whole.to_json())
    files = [f for f in body["files"] if f["role"] == "rows"]
    rows = [files[0], next(f for f in files if f["path"] != files[0]["path"])]
    rows[1]["path"] = rows[0]["path"]
    body.pop("checksum")
    body["checksum"] = _checksum(body)
    path.write_text(json.dumps(body))
    with pytest.raises(CheckpointCorruptError, match="listed more than once"):
        read_manifest(store, 5)
    report = verify(store, 5)
    assert not report.ok
    assert any(
        "listed more than once" in why and rows[0]["path"] in why for _, why in report.problems
    )


def _save_with_one_name(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import embckpt.save.writer as writer
    from embckpt import CheckpointConfig, Checkpointer

    dmp, opt = _build(world_size, WRITER)
    # Unpacked: every block names its own file (packed blocks share one by design).
    config = CheckpointConfig(policy="incremental", full_every=0, pack_below_bytes=0)
    with Checkpointer(dmp, root, optimizer=opt, config=config) as ckpt:
        _train(dmp, opt, 1, rank)
        ckpt.save(1).wait()
        real = writer.rows_file
        writer.rows_file = lambda table, *args: real("same", *args)  # a naming bug
        _train(dmp, opt, 2, rank)
        error = tm.raised(lambda: ckpt.save(2).wait())
        writer.rows_file = real
        committed = ckpt.store.committed_steps()
        _train(dmp, opt, 3, rank)
        ckpt.save(3).wait()
    return {"error": error, "committed": committed}


def test_the_writer_refuses_a_checkpoint_that_lists_one_file_twice(tmp_path: Path) -> None:
    results = run_ranks(_save_with_one_name, 2, str(tmp_path / "ckpt"))
    for r in results:
        assert r["error"] is not None and "was written for two blocks" in r["error"], r
        assert r["committed"] == [1], r
