"""The tracker's rows are exactly the rows whose weights changed, on every sharding type."""

from __future__ import annotations

import tempfile

import torch
import toy_model as tm

from embckpt.examples.launcher import run_ranks


def _tracked_vs_changed(rank: int, world_size: int, root: str) -> dict:
    from embckpt import Checkpointer

    model, opt = tm.build(world_size, seed=0)
    out = {}
    with Checkpointer(model, root, optimizer=opt) as ckpt:
        before = {s.key: s.weight.detach().clone() for s in ckpt.sharded.shards}
        for step in range(1, 3):
            tm.train_step(model, opt, step, rank)
        ckpt.tracker.fold()
        for shard in ckpt.sharded.shards:
            changed = torch.nonzero((shard.weight != before[shard.key]).any(dim=1)).flatten()
            tracked = ckpt.tracker.dirty(shard.key, "since_last")
            out[shard.key] = (shard.sharding_type, changed.tolist(), tracked.tolist())
    return out


def test_tracked_rows_equal_changed_rows_for_every_sharding_type() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_tracked_vs_changed, 2, root)
    seen_types = set()
    for rank, blocks in enumerate(results):
        for key, (sharding_type, changed, tracked) in blocks.items():
            seen_types.add(sharding_type)
            assert changed, f"rank {rank} {key}: nothing changed, the test proves nothing"
            assert tracked == changed, f"rank {rank} {key} ({sharding_type})"
    partial = [
        k for b in results for k, (_, changed, _) in b.items() if len(changed) < tm.ROWS // 2
    ]
    assert partial, "every block changed almost entirely: the comparison cannot tell rows apart"
    assert seen_types == {
        "table_wise",
        "row_wise",
        "column_wise",
        "table_row_wise",
        "data_parallel",
    }
