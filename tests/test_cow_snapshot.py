"""Copy-on-write snapshots (save/cow.py): training goes on while a checkpoint is copied out in
small chunks, and rows a step is about to update are copied first. The checkpoint must hold the
state as of its step exactly, whatever the steps did during the window, a job restored from it
must train on exactly like the writer, and a failure in the window must leave the previous
checkpoint restorable and every staging slab given back."""

from __future__ import annotations

import tempfile
import time

import pytest
import torch
import toy_model as tm

from embckpt.examples.launcher import run_ranks

BUDGET = 20000  # a few 2.5 KB slabs: the copier waits for writes, so steps run in the window
# Small blocks are packed: copied out of their slabs, which never wait. Unpacked, they hold them.
UNPACKED = {"staging_budget_bytes": BUDGET, "pack_below_bytes": 0}


def _slow_writes(ckpt, seconds: float) -> None:
    real = ckpt.store.write_file

    def slow(step, relative, data, *checksum, **timing):
        time.sleep(seconds)
        return real(step, relative, data, *checksum, **timing)

    ckpt.store.write_file = slow


def _train(model, opt, step: int, rank: int, device: str, hot: int | None = None) -> None:
    """toy_model's step, on ``device``."""
    dense, kjt, labels = tm.batch(step, rank, hot=hot)
    opt.zero_grad()
    logits = model(dense.to(device), kjt.to(torch.device(device))).squeeze(-1)
    torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to(device)).backward()
    opt.step()


def _window_scenario(rank: int, world_size: int, root: str, device: str = "cpu") -> dict:
    from embckpt import CheckpointConfig, Checkpointer

    out: dict = {}
    for policy in ("full", "one_shot"):
        config = CheckpointConfig(policy=policy, **UNPACKED)
        model, opt = tm.build(world_size, seed=0, device=device)
        ckpt = Checkpointer(model, f"{root}/{policy}", optimizer=opt, config=config)
        for step in range(1, 5):
            _train(model, opt, step, rank, device, hot=120)
        ckpt.save(4).wait()
        for step in range(5, 31):  # nearly every row: the diff is larger than the slabs too
            _train(model, opt, step, rank, device)
        at_save = tm.snapshot_state(model, opt, rank)
        _slow_writes(ckpt, 0.05)
        handle = ckpt.save(30)
        session = ckpt._saver._hooks.session
        steps_in_window = 0
        for step in range(31, 37):  # hot rows: the saved rows are the ones these steps update
            _train(model, opt, step, rank, device, hot=120)
            steps_in_window += int(not handle.done())
        manifest = handle.wait()
        at_36 = tm.snapshot_state(model, opt, rank)
        ckpt.close()
        fresh, fresh_opt = tm.build(world_size, seed=5, device=device)
        with Checkpointer(fresh, f"{root}/{policy}", optimizer=fresh_opt, config=config) as other:
            restored = other.restore()
            after_restore = tm.differences(at_save, tm.snapshot_state(fresh, fresh_opt, rank))
            for step in range(31, 37):
                _train(fresh, fresh_opt, step, rank, device, hot=120)
            continued = tm.differences(at_36, tm.snapshot_state(fresh, fresh_opt, rank))
        out[policy] = {
            "kind": manifest.kind,
            "restored": restored,
            "steps_in_window": steps_in_window,
            "protected_rows": session.protected_rows,
            "after_restore": after_restore,
            "continued": continued,
        }
    return out


def _failure_scenario(rank: int, world_size: int, root: str) -> dict:
    from embckpt import CheckpointConfig, Checkpointer, SaveError, failpoints

    config = CheckpointConfig(policy="full", **UNPACKED)
    model, opt = tm.build(world_size, seed=0)
    ckpt = Checkpointer(model, root, optimizer=opt, config=config)
    tm.train_step(model, opt, 1, rank, hot=120)
    ckpt.save(1).wait()
    at_1 = tm.snapshot_state(model, opt, rank)
    _slow_writes(ckpt, 0.02)
    if rank == 1:
        failpoints.arm("save.write", nth=3)
    handle = ckpt.save(2)
    for step in range(2, 6):
        tm.train_step(model, opt, step, rank, hot=120)
    error = tm.raised(handle.wait)
    failpoints.disarm()
    slabs_in_use = ckpt._saver.slabs._in_use
    held = ckpt._saver.slabs.held_bytes
    tm.train_step(model, opt, 6, rank, hot=120)
    at_6 = tm.snapshot_state(model, opt, rank)
    next_kind = ckpt.save(6).wait().kind
    ckpt.close()
    fresh, fresh_opt = tm.build(world_size, seed=5)
    with Checkpointer(fresh, root, optimizer=fresh_opt, config=config) as other:
        first = other.restore(1)
        one = tm.differences(at_1, tm.snapshot_state(fresh, fresh_opt, rank))
        latest = other.restore()
        six = tm.differences(at_6, tm.snapshot_state(fresh, fresh_opt, rank))
    return {
        "error": error,
        "slabs_in_use": slabs_in_use,
        "held": held,
        "next_kind": next_kind,
        "restored": (first, latest),
        "one": one,
        "six": six,
        "saved_type": SaveError.__name__,
    }


def _step_copy_fails(rank: int, world_size: int, root: str) -> dict:
    """Rank 0's steps fail to copy the rows they protect: training goes on, the save fails."""
    from embckpt import CheckpointConfig, Checkpointer
    from embckpt.save import cow

    config = CheckpointConfig(policy="full", **UNPACKED)
    model, opt = tm.build(world_size, seed=0)
    ckpt = Checkpointer(model, root, optimizer=opt, config=config)
    _train(model, opt, 1, rank, "cpu")
    ckpt.save(1).wait()
    _slow_writes(ckpt, 0.05)
    real = cow.CowSession._protect_rows

    def broken(*_args, **_kwargs) -> None:
        raise RuntimeError("injected: a step could not copy its rows")

    if rank == 0:
        cow.CowSession._protect_rows = broken  # type: ignore[method-assign]
    handle = ckpt.save(2)
    trained = 0
    for step in range(2, 8):
        _train(model, opt, step, rank, "cpu", hot=120)  # must not raise
        trained += 1
    error = tm.raised(handle.wait)
    cow.CowSession._protect_rows = real  # type: ignore[method-assign]
    next_kind = ckpt.save(8).wait().kind
    ckpt.close()
    return {"trained": trained, "error": error, "next_kind": next_kind}


def _both(rank: int, world_size: int, root: str) -> dict:
    return {
        "window": _window_scenario(rank, world_size, f"{root}/w"),
        "failure": _failure_scenario(rank, world_size, f"{root}/f"),
        "step_copy": _step_copy_fails(rank, world_size, f"{root}/s"),
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    with tempfile.TemporaryDirectory() as root:
        return run_ranks(_both, 2, root)


def _check_window(got: dict, policy: str, rank: int) -> None:
    assert got["kind"] == ("full" if policy == "full" else "diff"), rank
    assert got["steps_in_window"] >= 2, (rank, got)  # training ran while it was copied
    assert got["protected_rows"] > 0, (rank, got)  # and steps copied rows before updates
    assert got["restored"] == 30
    assert got["after_restore"] == [], (rank, got["after_restore"])
    assert got["continued"] == [], (rank, got["continued"])


@pytest.mark.parametrize("policy", ["full", "one_shot"])
def test_steps_in_the_window_do_not_reach_the_checkpoint(results, policy) -> None:
    for rank, result in enumerate(results):
        _check_window(result["window"][policy], policy, rank)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_steps_in_the_window_do_not_reach_the_checkpoint_on_a_gpu(tmp_path) -> None:
    """The same on CUDA: claims on the training stream, copies on a side stream."""
    (got,) = run_ranks(_window_scenario, 1, str(tmp_path), "cuda")
    for policy in ("full", "one_shot"):
        _check_window(got[policy], policy, 0)


def test_a_failure_in_the_window_gives_every_slab_back_and_keeps_the_previous_checkpoint(
    results,
) -> None:
    for rank, result in enumerate(results):
        got = result["failure"]
        assert got["error"] is not None and "step 2" in got["error"], (rank, got["error"])
        assert got["slabs_in_use"] == 0 and got["held"] == 0, (rank, got)
        assert got["next_kind"] == "full"
        assert got["restored"] == (1, 6)
        assert got["one"] == [] and got["six"] == [], (rank, got)


def test_a_step_that_cannot_copy_its_rows_trains_on_and_the_save_fails_everywhere(results) -> None:
    for rank, result in enumerate(results):
        got = result["step_copy"]
        assert got["trained"] == 6, (rank, got)
        assert got["error"] is not None and "step 2" in got["error"], (rank, got)
        assert "injected: a step could not copy its rows" in got["error"], (rank, got)
        assert got["error"].startswith("SaveError" if rank == 0 else "SaveRankError"), got
        assert got["next_kind"] == "full", (rank, got)
