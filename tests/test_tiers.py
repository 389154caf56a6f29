"""The node-local tier (issue 24): every checkpoint on each node's own folder, a replica on the
peer node sent over the process group, the durable directory every K; restores read the nearest
copy, checked, and fall back per file; a lost node restores from its peer's replica; with its
replica lost too, partial recovery takes its blocks from an older step.

Two ranks, each its own simulated node (``EMBCKPT_NODE``); a "relaunch" is a fresh model and
Checkpointer, in the same processes after the test damaged files, or in fresh ones after a
node's worker was SIGKILLed and its folder deleted. One test runs four ranks, two nodes of two:
which rank of a node serves which rank of a lost one needs two ranks on each.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch
import toy_model as tm

from embckpt import CheckpointConfig, ConfigError
from embckpt.examples.launcher import RankFailed, run_ranks

SAVES = (5, 10, 15)
KILL_AT = 17  # after the last save


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


def _restore(
    rank: int, world_size: int, root: str, node: str, **load: object
) -> tuple[object, dict, object]:
    from embckpt import Checkpointer

    os.environ["EMBCKPT_NODE"] = node
    model, opt = tm.build(world_size, seed=77)
    with Checkpointer(model, f"{root}/durable", optimizer=opt, config=_config(root)) as ckpt:
        result = ckpt.load(**load)
    return result, tm.snapshot_state(model, opt, rank), ckpt


def _summary(result, state: dict, expected: dict) -> dict:
    return {
        "step": result.manifest.step,
        "bytes": dict(result.bytes_by_tier),
        "refused": list(result.refused_copies),
        "diff": tm.differences(expected[result.manifest.step], state),
    }


def _save_tiered(rank: int, world_size: int, root: str) -> dict[int, dict]:
    """Trains and saves ``SAVES`` as this process's node; the state at each save, by step."""
    from embckpt import Checkpointer

    model, opt = tm.build(world_size, seed=0)
    expected = {}
    with Checkpointer(model, f"{root}/durable", optimizer=opt, config=_config(root)) as ckpt:
        for step in range(1, SAVES[-1] + 1):
            tm.train_step(model, opt, step, rank, hot=60)
            if step in SAVES:
                ckpt.save(step).wait()
                expected[step] = tm.snapshot_state(model, opt, rank)
    return expected


def _scenarios(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed as dist

    os.environ["EMBCKPT_NODE"] = f"n{rank}"
    expected = _save_tiered(rank, world_size, root)
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

    # Back to step 10, dropping what came after: from every node's folders too.
    result, state, _ = _restore(rank, world_size, root, f"n{rank}", step=10, discard_newer=True)
    out["back_to_10"] = _summary(result, state, expected)
    dist.barrier()
    out["after_discard"] = {
        where: sorted(p.name for p in Path(root, where).glob("step_*"))
        for where in ("durable", "local/n0", "local/n1", "local/n0/replicas/n1")
    }
    return out


def test_tiers_restore_the_nearest_checked_copy() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_scenarios, 2, root)
    layout = results[0]["layout"]
    every = [f"step_{s:012d}" for s in SAVES]
    # Durable every 2nd checkpoint with its chain (10 and its full, 5); locally every one.
    assert layout["durable"] == ["step_000000000005", "step_000000000010"]
    assert layout["local/n0"] == layout["local/n1"] == layout["local/n0/replicas/n1"] == every
    for rank, out in enumerate(results):
        for name in ("intact", "swapped", "corrupt"):
            got = out[name]
            assert got["step"] == 15 and got["diff"] == [], (rank, name, got)
            assert got["bytes"]["durable"] == 0, (rank, name, got)
        assert out["intact"]["bytes"]["peer"] == 0 and out["intact"]["refused"] == []
    for rank, out in enumerate(results):
        assert out["back_to_10"]["step"] == 10 and out["back_to_10"]["diff"] == [], rank
    kept = ["step_000000000005", "step_000000000010"]
    assert all(steps == kept for steps in results[0]["after_discard"].values())
    # Rank 0's copy refused: the restore ran again with n1's replica of it, sent over the group.
    assert results[0]["corrupt"]["refused"] and results[0]["corrupt"]["bytes"]["peer"] > 0


def _train_until_killed(rank: int, world_size: int, root: str) -> None:
    """Trains and saves as node ``n<rank>``; node n1's worker SIGKILLs itself after the last
    save (run_ranks then kills node n0's)."""
    from embckpt import Checkpointer

    os.environ["EMBCKPT_NODE"] = f"n{rank}"
    model, opt = tm.build(world_size, seed=0)
    with Checkpointer(model, f"{root}/durable", optimizer=opt, config=_config(root)) as ckpt:
        for step in range(1, KILL_AT + 1):
            tm.train_step(model, opt, step, rank, hot=60)
            if step in SAVES:
                ckpt.save(step).wait()
                torch.save(tm.snapshot_state(model, opt, rank), f"{root}/expected.{step}.{rank}")
            if step == KILL_AT and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)  # node n0's worker: killed by run_ranks once n1's died


def _relaunched(rank: int, world_size: int, root: str) -> dict:
    result, state, ckpt = _restore(rank, world_size, root, f"n{rank}")
    expected = {s: torch.load(f"{root}/expected.{s}.{rank}") for s in SAVES}
    out = _summary(result, state, expected)
    partial = result.partial
    if partial is None:
        return out
    came_from = {key: step for key, _, _, step in partial.lost_blocks}
    wrong, newest_differs = [], False
    for key, value in state.items():
        block = key.split(":")[1] if key[:2] in ("w:", "s:") else None
        source = came_from.get(block, partial.step)
        if tm.differences({key: expected[source][key]}, {key: value}):
            wrong.append((key, source))
        if block in came_from and key[:2] == "w:":
            newest_differs |= bool(tm.differences({key: expected[partial.step][key]}, {key: value}))
    out["partial"] = {
        "step": partial.step,
        "older_steps": list(partial.older_steps),
        "came_from": came_from,
        "lost_rows": partial.lost_rows,
        "total_rows": partial.total_rows,
        "lost_fraction": partial.lost_fraction,
        "wrong": wrong,
        "newest_differs": newest_differs,
        "next_is_full": ckpt.head is None,
    }
    return out


def test_killed_node_restores_from_its_replica_then_partially() -> None:
    """Node n1's worker SIGKILLed mid-training and its folder deleted: the relaunch restores it
    bit-exact from n0's replica, sent over the process group. With that replica gone too, the
    partial recovery takes n1's blocks from the newest older step holding them (the durable
    step 10) and everything else from step 15, as its report says."""
    with tempfile.TemporaryDirectory() as root:
        with pytest.raises(RankFailed, match="died"):
            run_ranks(_train_until_killed, 2, root)
        shutil.rmtree(Path(root, "local", "n1"))
        lost = run_ranks(_relaunched, 2, root)
        shutil.rmtree(Path(root, "local", "n1"), ignore_errors=True)
        shutil.rmtree(Path(root, "local", "n0", "replicas", "n1"))
        partial = run_ranks(_relaunched, 2, root)
    for rank, out in enumerate(lost):
        assert out["step"] == 15 and out["diff"] == [], (rank, out)
        assert out["bytes"]["durable"] == 0 and out["refused"] == [], (rank, out)
        assert (out["bytes"]["peer"] > 0) == (rank == 1), (rank, out)
    for rank, out in enumerate(partial):
        got = out["partial"]
        assert out["step"] == 15 and got["wrong"] == [], (rank, got["wrong"])
        assert got["older_steps"] == [10] and 0 < got["lost_rows"] < got["total_rows"]
        assert 0 < got["lost_fraction"] < got["lost_rows"] / got["total_rows"]
        assert got["next_is_full"]
    assert partial[0]["partial"]["came_from"] == {}
    assert set(partial[1]["partial"]["came_from"].values()) == {10}
    assert partial[1]["partial"]["newest_differs"]


def _files_for(src: int, dst: int) -> list[tuple[tuple[int, int], bytes]]:
    """What rank ``src`` sends rank ``dst``: files of mixed sizes, empty ones among them."""
    sizes = [0, 1, 7, 3 << 20, 0, 12_345, 1 << 20]
    return [((src, i), bytes([src * 16 + dst * 4 + i]) * n) for i, n in enumerate(sizes)]


def _exchange_mixed(rank: int, world_size: int) -> bool:
    from embckpt.collective import Collective
    from embckpt.tiers.transfer import exchange

    outgoing = {dst: _files_for(rank, dst) for dst in range(world_size)}
    received = exchange(Collective(), outgoing)
    return all(
        [(key, bytes(memoryview(data))) for key, data in received[src]] == _files_for(src, rank)
        for src in range(world_size)
    )


def test_files_sent_between_ranks_arrive_whole_and_in_order() -> None:
    """Each file moves as its own message: every one arrives, in order, byte for byte, whatever
    its size (empty too), to a peer and to the rank itself."""
    assert run_ranks(_exchange_mixed, 2) == [True, True]


def test_a_lost_nodes_ranks_are_served_by_as_many_ranks_of_the_holder() -> None:
    """Each asking rank is served by the holder node's rank at its own place among its node's
    ranks (round the holder's), not every one by the holder's leader."""
    from embckpt.tiers.nodes import Nodes

    nodes = Nodes(("n0", "n1", "n0", "n1", "n2"), rank=0)
    assert [nodes.server("n0", asker) for asker in (1, 3)] == [0, 2]
    assert [nodes.server("n2", asker) for asker in (0, 1, 2, 3)] == [4, 4, 4, 4]
    assert [nodes.server("n1", asker) for asker in (0, 2, 4)] == [1, 3, 1]


def _two_nodes_of_two(rank: int, world_size: int, root: str) -> dict:
    """Saves as node ``n<rank // 2>``; node n1's folder lost, restores from n0's replica."""
    import torch.distributed as dist

    node = f"n{rank // 2}"
    os.environ["EMBCKPT_NODE"] = node
    expected = _save_tiered(rank, world_size, root)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(Path(root, "local", "n1"))
    dist.barrier()
    result, state, _ = _restore(rank, world_size, root, node)
    return _summary(result, state, expected)


def test_a_lost_node_of_two_ranks_restores_exactly_from_both_ranks_of_its_peer() -> None:
    """Two nodes of two ranks: node n1's folder lost, each of its ranks gets its files from a
    different rank of n0 (``Nodes.server``), and every rank restores its step exactly."""
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_two_nodes_of_two, 4, root)
    for rank, out in enumerate(results):
        assert out["step"] == 15 and out["diff"] == [], (rank, out)
        assert out["bytes"]["durable"] == 0 and out["refused"] == [], (rank, out)
        assert (out["bytes"]["peer"] > 0) == (rank >= 2), (rank, out)


def test_tier_settings_need_local_dir() -> None:
    for kwargs in ({"replicas": 1}, {"durable_every": 3}, {"partial_recovery": True}):
        with pytest.raises(ConfigError, match="need local_dir"):
            CheckpointConfig(**kwargs)
    with pytest.raises(ConfigError, match="replicas must be 0 or 1"):
        CheckpointConfig(local_dir="/tmp/x", replicas=2)


def _save_tiered_and_plain(rank: int, world_size: int, root: str) -> None:
    from embckpt import Checkpointer

    os.environ["EMBCKPT_NODE"] = f"n{rank}"
    model, opt = tm.build(world_size, seed=0)
    plain = CheckpointConfig(policy="full")
    with (
        Checkpointer(model, f"{root}/durable", optimizer=opt, config=_config(root)) as tiered,
        Checkpointer(model, f"{root}/plain", optimizer=opt, config=plain) as reference,
    ):
        for step in range(1, SAVES[-1] + 1):
            tm.train_step(model, opt, step, rank, hot=60)
            if step in SAVES:
                tiered.save(step).wait()
        reference.save(SAVES[-1]).wait()


def _restore_on_one_rank(rank: int, world_size: int, root: str) -> dict:
    from embckpt import Checkpointer

    os.environ["EMBCKPT_NODE"] = "n0"
    model, opt = tm.build(world_size, seed=77)
    with Checkpointer(model, f"{root}/durable", optimizer=opt, config=_config(root)) as ckpt:
        result = ckpt.load()
    tiered = tm.snapshot_state(model, opt, rank)
    model, opt = tm.build(world_size, seed=78)
    with Checkpointer(model, f"{root}/plain", optimizer=opt) as ckpt:
        ckpt.load()
    return {
        "step": result.manifest.step,
        "bytes": dict(result.bytes_by_tier),
        "diff": tm.differences(tiered, tm.snapshot_state(model, opt, rank)),
    }


def test_a_tiered_checkpoint_restores_onto_another_world_size() -> None:
    """Written by 2 ranks on 2 nodes, restored by 1 rank on node n0, which holds its own files
    and n1's replica: the same model as a plain restore of the same step, nothing durable."""
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_save_tiered_and_plain, 2, root)
        (out,) = run_ranks(_restore_on_one_rank, 1, root)
    assert out["step"] == SAVES[-1] and out["diff"] == [], out
    assert out["bytes"]["durable"] == 0 and out["bytes"]["local"] > 0, out
