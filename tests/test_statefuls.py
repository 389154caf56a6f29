"""Statefuls (2 gloo ranks): state a checkpoint cannot hold is refused by ``save()`` on every
rank, naming the stateful and the key, and changes nothing; a restore not given a stateful the
checkpoint holds warns and lists it, onto the same and another world size."""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

import pytest
import toy_model as tm

from embckpt.examples.launcher import run_ranks

KINDS = ("tw", "rw")  # enough tables to shard over both ranks; keeps the test short


class Bag:
    """A stateful holding whatever its test puts in it."""

    def __init__(self, **state: Any) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)


class _Warnings(logging.Handler):
    """The warnings a restore logs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _refused(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from embckpt import CheckpointConfig, Checkpointer

    out: dict[str, Any] = {}
    model, opt = tm.build(world_size, seed=0, kinds=KINDS)
    bag = Bag(seen=[0, rank])
    config = CheckpointConfig(policy="one_shot", full_every=0)
    # (a) A set on rank 1 alone: save() itself raises on both ranks, after a committed full,
    # and the diff saved once the state is fixed holds the rows the failed save would have.
    with Checkpointer(
        model, f"{root}/a", optimizer=opt, config=config, statefuls={"bag": bag}
    ) as ckpt:
        tm.train_step(model, opt, 1, rank, kinds=KINDS)
        ckpt.save(1).wait()
        tm.train_step(model, opt, 2, rank, kinds=KINDS)
        if rank == 1:
            bag.state["seen"] = [0, 1, {3, 4}]
        out["set"] = tm.raised(lambda: ckpt.save(2))
        out["set_folder"] = os.path.exists(f"{root}/a/step_000000000002")
        out["set_committed"] = ckpt.store.committed_steps()
        bag.state["seen"] = [0, rank, 3, 4]
        out["fixed"] = ckpt.save(2).wait().kind
        expected = tm.snapshot_state(model, opt, rank)
    fresh, fresh_opt = tm.build(world_size, seed=5, kinds=KINDS)
    restored = Bag()
    with Checkpointer(
        fresh, f"{root}/a", optimizer=fresh_opt, config=config, statefuls={"bag": restored}
    ) as ckpt:
        out["restored_step"] = ckpt.restore()
    out["restored_diff"] = tm.differences(expected, tm.snapshot_state(fresh, fresh_opt, rank))
    out["restored_bag"] = restored.state

    # (b) bytes on rank 0 alone, through maybe_save: raised when it saves, tried again at the
    # next step once fixed.
    config = CheckpointConfig(policy="full", interval=2, adaptive_interval=False)
    with Checkpointer(
        model, f"{root}/b", optimizer=opt, config=config, statefuls={"bag": bag}
    ) as ckpt:
        if rank == 0:
            bag.state["token"] = b"\x00\x01"
        saved: list[Any] = []
        for step in range(1, 5):
            if step == 3:
                bag.state["token"] = [0, 1]
            try:
                pending = ckpt.maybe_save(step)
                saved.append(None if pending is None else pending.wait().step)
            except Exception as exc:  # the test checks both ranks' messages
                saved.append(f"{type(exc).__name__}: {exc}")
        out["maybe_save"] = saved
        out["bytes_committed"] = ckpt.store.committed_steps()
    return out


def test_unsavable_state_is_refused_at_save_on_every_rank() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_refused, 2, root, timeout_s=300)
    for rank, out in enumerate(results):
        where = f"rank {rank}"
        own = "SaveError: step 2: rank 1: cannot save the statefuls: statefuls['bag']['seen'][2]"
        assert out["set"] is not None, where
        if rank == 1:
            assert out["set"].startswith(own), (where, out["set"])
        else:
            assert out["set"].startswith("SaveRankError: deciding step 2 failed"), out["set"]
            assert own in out["set"], (where, out["set"])
        assert "a checkpoint cannot hold a value of type set" in out["set"], out["set"]
        assert "convert it to a sorted list" in out["set"], out["set"]
        assert not out["set_folder"] and out["set_committed"] == [1], where
        assert out["fixed"] == "diff" and out["restored_step"] == 2, where
        assert out["restored_diff"] == [], (where, out["restored_diff"])
        assert out["restored_bag"] == {"seen": [0, rank, 3, 4]}, where

        first, second, third, fourth = out["maybe_save"]
        assert first is None and third == 3 and fourth is None, (where, out["maybe_save"])
        own = "SaveError: step 2: rank 0: cannot save the statefuls: statefuls['bag']['token']"
        if rank == 0:
            assert second.startswith(own), (where, second)
        else:
            assert second.startswith("SaveRankError") and own in second, (where, second)
        assert "a value of type bytes" in second and "np.frombuffer" in second, second
        assert out["bytes_committed"] == [3], where


def _save_two(rank: int, world_size: int, root: str) -> None:
    from embckpt import Checkpointer

    model, opt = tm.build(world_size, seed=0, kinds=KINDS)
    statefuls = {"data": Bag(position=rank), "extra": Bag(n=1)}
    with Checkpointer(model, root, optimizer=opt, statefuls=statefuls) as ckpt:
        tm.train_step(model, opt, 1, rank, kinds=KINDS)
        ckpt.save(1).wait()


def _restore_some(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from embckpt import Checkpointer

    out: dict[str, Any] = {}
    model, opt = tm.build(world_size, seed=3, kinds=KINDS)
    warnings = _Warnings()
    logging.getLogger("embckpt").addHandler(warnings)
    for case, names in (("some", ("data",)), ("all", ("data", "extra"))):
        statefuls = {name: Bag() for name in names}
        warnings.messages.clear()
        with Checkpointer(model, root, optimizer=opt, statefuls=statefuls) as ckpt:
            result = ckpt.load()
        assert result is not None
        out[case] = {
            "unused": result.unused_statefuls,
            "skipped": result.skipped,
            "warnings": list(warnings.messages),
            "data": statefuls["data"].state,
        }
    return out


@pytest.mark.parametrize("world_size", [2, 1])
def test_restore_lists_the_statefuls_it_was_not_given(world_size: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_save_two, 2, root, timeout_s=300)
        results = run_ranks(_restore_some, world_size, root, timeout_s=300)
    reason = "stateful 'extra': the checkpoint holds it, but statefuls= does not name it"
    for rank, out in enumerate(results):
        where = f"rank {rank} of {world_size}"
        some, every = out["some"], out["all"]
        assert some["unused"] == ("extra",), (where, some)
        assert reason in some["skipped"], (where, some["skipped"])
        assert any(reason in message for message in some["warnings"]), (where, some)
        assert every["unused"] == (), (where, every)
        assert not any("'extra'" in message for message in every["warnings"]), (where, every)
        if world_size == 2:
            assert some["skipped"] == (reason,) and every["skipped"] == (), (where, some)
            assert some["data"] == every["data"] == {"position": rank}, (where, out)


def test_state_trees_come_back_with_their_types() -> None:
    """A stateful's tree (and the RNG streams) as encoded, decoded: lists stay lists and tuples
    tuples, however they nest, scalars and arrays equal."""
    import random

    import numpy as np
    import torch

    from embckpt import dense

    tree = {
        "seen": 5,
        "order": [3, 1, 2],
        "pair": (1.5, "a", None, True),
        "nested": [[1, 2], {"k": (3, [4, 5])}, ({"x": 1},), []],
        7: ("int key",),
        "tensor": torch.arange(4),
        "array": np.arange(3, dtype=np.int32),
        "rng": random.getstate(),
    }
    back = dense.decode_tree(dense.encode_tree(tree))
    tensor, array = back.pop("tensor"), back.pop("array")
    assert torch.equal(tensor, tree.pop("tensor"))
    assert np.array_equal(array, tree.pop("array")) and array.dtype == np.int32
    assert back == tree
    assert type(back["nested"][2]) is tuple and type(back["nested"][1]["k"][1]) is list
    random.setstate(back["rng"])  # a state Python accepts back
