"""The node-local tier (issue 24): every checkpoint on each node's own folder, a replica on the
peer node sent over the process group, the durable directory every K; restores read the nearest
copy, checked, and fall back per file; a lost node restores from its peer's replica; with its
replica lost too, partial recovery takes its blocks from an older step.

Two ranks, each its own simulated node (``EMBCKPT_NODE``); a "relaunch" is a fresh model and
Checkpointer in the same processes, after the test deleted or damaged files.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import toy_model as tm

from embckpt import CheckpointConfig, ConfigError
from embckpt.examples.launcher import run_ranks

SAVES = (5, 10, 15)


def _config(root: str) -> CheckpointConfig:
    return CheckpointConfig(
        policy="one_shot",
        full_every=4,
        local_dir=f"{root}/local",
        replicas=1,
        durable_every=2,
        local_keep_last=2,
        partial_recovery=True,
    )


def _restore(rank: int, world_size: int, root: str, node: str) -> tuple[object, dict, object]:
    from embckpt import Checkpointer

    os.environ["EMBCKPT_NODE"] = node
    model, opt = tm.build(world_size, seed=77)
    with Checkpointer(model, f"{root}/durable", optimizer=opt, config=_config(root)) as ckpt:
        result = ckpt.load()
    return result, tm.snapshot_state(model, opt, rank), ckpt


def _summary(result, state: dict, expected: dict) -> dict:
    return {
        "step": result.manifest.step,
        "bytes": dict(result.bytes_by_tier),
        "refused": list(result.refused_copies),
        "diff": tm.differences(expected[result.manifest.step], state),
    }


def _scenarios(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed as dist

    from embckpt import Checkpointer

    os.environ["EMBCKPT_NODE"] = f"n{rank}"
    model, opt = tm.build(world_size, seed=0)
    expected = {}
    with Checkpointer(model, f"{root}/durable", optimizer=opt, config=_config(root)) as ckpt:
        for step in range(1, SAVES[-1] + 1):
            tm.train_step(model, opt, step, rank, hot=60)
            if step in SAVES:
                ckpt.save(step).wait()
                expected[step] = tm.snapshot_state(model, opt, rank)
    local = Path(root, "local")
    out: dict = {
        "layout": {
            where: sorted(p.name for p in Path(root, where).glob("step_*"))
            for where in ("durable", "local/n0", "local/n1", "local/n0/replicas/n1")
        }
    }

    # No node lost: everything from the node's own folder.
    result, state, _ = _restore(rank, world_size, root, f"n{rank}")
    out["intact"] = _summary(result, state, expected)
    # Relaunched with the ranks numbered the other way round: files are found by node.
    result, state, _ = _restore(rank, world_size, root, f"n{1 - rank}")
    out["swapped"] = _summary(result, state, expected)

    # One local copy damaged: refused, and the peer's replica read instead.
    dist.barrier()
    victim = sorted((local / "n0" / "step_000000000015" / "tables").rglob("*.parquet"))[0]
    original = victim.read_bytes()
    if rank == 0:
        victim.write_bytes(original[:-9] + bytes([original[-9] ^ 0xFF]) + original[-8:])
    dist.barrier()
    result, state, _ = _restore(rank, world_size, root, f"n{rank}")
    out["corrupt"] = _summary(result, state, expected)
    dist.barrier()
    if rank == 0:
        victim.write_bytes(original)

    # Node n1 lost (its folder gone): its files come from n0's replica, over the process group.
    dist.barrier()
    if rank == 0:
        shutil.rmtree(local / "n1")
    dist.barrier()
    result, state, _ = _restore(rank, world_size, root, f"n{rank}")
    out["lost"] = _summary(result, state, expected)

    # Its replica lost too: partial recovery, its blocks from the newest older step (durable).
    dist.barrier()
    if rank == 0:
        shutil.rmtree(local / "n1")
        shutil.rmtree(local / "n0" / "replicas" / "n1")
    dist.barrier()
    result, state, ckpt = _restore(rank, world_size, root, f"n{rank}")
    partial = result.partial
    came_from = {key: step for key, _, _, step in partial.lost_blocks}
    lost_keys = set(came_from)
    wrong = []
    for key, value in state.items():
        block = key.split(":")[1] if key[:2] in ("w:", "s:") else None
        source = came_from.get(block, partial.step)
        if not tm.differences({key: expected[source][key]}, {key: value}) == []:
            wrong.append((key, source))
    out["partial"] = {
        "step": partial.step,
        "older": partial.older_step,
        "lost_blocks": sorted(lost_keys),
        "lost_rows": partial.lost_rows,
        "total_rows": partial.total_rows,
        "lost_fraction": partial.lost_fraction,
        "wrong": wrong,
        "newest_differs": bool(lost_keys)
        and any(
            tm.differences({k: expected[15][k]}, {k: state[k]})
            for k in state
            if k[:2] == "w:" and k.split(":")[1] in lost_keys
        ),
        "next_is_full": ckpt.head is None,
    }
    return out


def test_tiers_restore_nearest_copy_lost_node_and_partial() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_scenarios, 2, root)
    layout = results[0]["layout"]
    every = [f"step_{s:012d}" for s in SAVES]
    # Durable every 2nd checkpoint with its chain (10 and its full, 5); locally every one.
    assert layout["durable"] == ["step_000000000005", "step_000000000010"]
    assert layout["local/n0"] == layout["local/n1"] == layout["local/n0/replicas/n1"] == every
    for rank, out in enumerate(results):
        for name in ("intact", "swapped", "corrupt", "lost"):
            got = out[name]
            assert got["step"] == 15 and got["diff"] == [], (rank, name, got)
            assert got["bytes"]["durable"] == 0, (rank, name, got)
        assert out["intact"]["bytes"]["peer"] == 0 and out["intact"]["refused"] == []
        assert out["corrupt"]["refused"] if rank == 0 else True
        assert out["lost"]["bytes"]["peer"] > 0 if rank == 1 else True
        partial = out["partial"]
        assert (partial["step"], partial["older"]) == (15, 10)
        assert partial["wrong"] == [], (rank, partial["wrong"])
        assert 0 < partial["lost_rows"] < partial["total_rows"]
        assert 0 < partial["lost_fraction"] < 1
        assert partial["next_is_full"]
    assert results[0]["partial"]["lost_blocks"] == []
    assert results[1]["partial"]["lost_blocks"] and results[1]["partial"]["newest_differs"]


def test_tier_settings_need_local_dir() -> None:
    for kwargs in ({"replicas": 1}, {"durable_every": 3}, {"partial_recovery": True}):
        with pytest.raises(ConfigError, match="need local_dir"):
            CheckpointConfig(**kwargs)
    with pytest.raises(ConfigError, match="replicas must be 0 or 1"):
        CheckpointConfig(local_dir="/tmp/x", replicas=2)
