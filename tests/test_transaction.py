"""A save is a transaction (2 gloo ranks): a failure on one rank, in any phase, raises an embckpt
error on every rank and changes nothing a later save or restore reads; the writer's reference,
tracker bits and interval come back as they were, and training goes on. A restore that fails
on one rank leaves every rank's model, optimizer, RNG and statefuls as they were."""

from __future__ import annotations

import os
import tempfile

import toy_model as tm

from embckpt.examples.launcher import run_ranks


def _blocks_equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(
        a[k].keys() == b[k].keys() and all(torch.equal(a[k][n], b[k][n]) for n in a[k]) for k in a
    )


def _live_blocks(model, rank: int) -> dict:
    from embckpt.sharding import discover

    return {
        s.key: {"weight": s.weight.detach().float().clone()}
        for s in discover(model, rank).writer_shards()
    }


def _weights_match(reconstruction: dict, live: dict) -> bool:
    import torch

    return all(torch.equal(reconstruction[k]["weight"], v["weight"]) for k, v in live.items())


def _scenarios(rank: int, world_size: int, root: str) -> dict:
    import torch

    from embckpt import CheckpointConfig, Checkpointer, failpoints

    out: dict = {}
    model, opt = tm.build(world_size, seed=0)

    # 1. A failed incremental delta diff (rank 0's dense file) leaves the reference as the last
    # commit left it: the next diff restores exactly what the writer meant.
    config = CheckpointConfig(policy="incremental", full_every=0, codec="adaptive", bits=4)
    with Checkpointer(model, f"{root}/delta", optimizer=opt, config=config) as ckpt:
        ckpt.track_reconstruction()
        for step in (1, 2):
            tm.train_step(model, opt, step, rank, hot=60)
            ckpt.save(step).wait()
        before = ckpt.reconstruction()
        tm.train_step(model, opt, 3, rank, hot=60)
        if rank == 0:
            failpoints.arm("save.dense")
        out["failed_diff"] = tm.raised(lambda: ckpt.save(3).wait())
        out["reference_kept"] = _blocks_equal(before, ckpt.reconstruction())
        out["leftover_3"] = os.path.exists(f"{root}/delta/step_000000000003")
        tm.train_step(model, opt, 4, rank, hot=60)
        out["next"] = ckpt.save(4).wait().kind
        expected = ckpt.reconstruction()
        ckpt.restore(4)
        out["restored_exact"] = _weights_match(expected, _live_blocks(model, rank))
        tm.train_step(model, opt, 5, rank, hot=60)  # training goes on from the restored state
        out["after_restore"] = ckpt.save(5).wait().kind

    # 2. A failed full of an additive codec clears the reference: the next save is a full.
    config = CheckpointConfig(policy="incremental", full_every=2, codec="adaptive", bits=4)
    with Checkpointer(model, f"{root}/full", optimizer=opt, config=config) as ckpt:
        kinds = []
        for step in (6, 7):
            tm.train_step(model, opt, step, rank, hot=60)
            kinds.append(ckpt.save(step).wait().kind)
        tm.train_step(model, opt, 8, rank, hot=60)
        if rank == 1:
            failpoints.arm("save.encode")
        out["failed_full"] = tm.raised(lambda: ckpt.save(8).wait())
        out["ready_after_failed_full"] = ckpt.writer.reference.ready
        tm.train_step(model, opt, 9, rank, hot=60)
        kinds.append(ckpt.save(9).wait().kind)
        out["ready_after_full"] = ckpt.writer.reference.ready
        tm.train_step(model, opt, 10, rank, hot=60)
        kinds.append(ckpt.save(10).wait().kind)
        out["full_kinds"] = kinds

    # 3. Planning raises on rank 1 alone (a staging budget that cannot hold one row): every
    # rank raises, none hangs, and rank 1's tracker bits come back.
    small = CheckpointConfig(policy="one_shot", staging_budget_bytes=8 if rank == 1 else 4 << 30)
    with Checkpointer(model, f"{root}/plan", optimizer=opt, config=small) as ckpt:
        tm.train_step(model, opt, 10, rank, hot=60)
        out["plan_error"] = tm.raised(lambda: ckpt.save(10).wait())
        out["plan_committed"] = ckpt.store.committed_steps()
    config = CheckpointConfig(policy="one_shot", full_every=0, pipeline="off")
    with Checkpointer(model, f"{root}/bits", optimizer=opt, config=config) as ckpt:
        ckpt.save(10)
        tm.train_step(model, opt, 11, rank, hot=60)
        if rank == 1:
            failpoints.arm("save.plan")
        out["bits_error"] = tm.raised(lambda: ckpt.save(11))
        ckpt.save(12)  # no training since 11: it writes exactly the rows the failure gave back
        fresh, fresh_opt = tm.build(world_size, seed=9)
        with Checkpointer(fresh, f"{root}/bits", optimizer=fresh_opt, config=config) as other:
            other.restore(12)
        out["bits_diff"] = tm.differences(
            tm.snapshot_state(model, opt, rank), tm.snapshot_state(fresh, fresh_opt, rank)
        )

    # 4. A failed save puts the schedule back: maybe_save tries again at the
    # next step. The manifest's failure on rank 0 leaves no folder behind.
    config = CheckpointConfig(
        policy="one_shot", interval=3, adaptive_interval=False, pipeline="off"
    )
    with Checkpointer(model, f"{root}/interval", optimizer=opt, config=config) as ckpt:
        saved = []
        for step in range(13, 22):
            tm.train_step(model, opt, step, rank, hot=60)
            if step == 18 and rank == 0:
                failpoints.arm("save.manifest")
            try:
                pending = ckpt.maybe_save(step)
                saved.append((step, None if pending is None else pending.wait().step))
            except Exception:  # the scenario records that it raised
                saved.append((step, "raised"))
        out["interval_saved"] = saved
        out["interval_leftovers"] = ckpt.store.leftover_steps()
        out["interval_committed"] = ckpt.store.committed_steps()

    # 5. Retention that fails after the commit does not fail the save.
    config = CheckpointConfig(policy="full", keep_last=1)
    with Checkpointer(model, f"{root}/kept", optimizer=opt, config=config) as ckpt:
        ckpt.save(22).wait()
        if rank == 0:
            failpoints.arm("save.retention")
        out["retention_save"] = ckpt.save(23).wait().step
        ckpt.save(24).wait()
        out["kept"] = ckpt.store.committed_steps()

    # 6. A restore that fails on rank 1 while applying raises on every rank; the next save
    # is a full.
    config = CheckpointConfig(policy="one_shot", full_every=0)
    with Checkpointer(model, f"{root}/kept", optimizer=opt, config=config) as ckpt:
        if rank == 1:
            failpoints.arm("restore.apply")
        out["restore_error"] = tm.raised(ckpt.restore)
        tm.train_step(model, opt, 25, rank, hot=60)
        out["after_failed_restore"] = ckpt.save(25).wait().kind
        out["restored"] = ckpt.restore()
    # 7. A restore that fails while reading on rank 1 leaves rank 0's dense state, optimizer,
    # RNG and statefuls as they were, although rank 0 loaded its side state before the ranks
    # agreed (restore.py); training goes on.
    counter = _Counter()
    config = CheckpointConfig(policy="one_shot", full_every=0)
    with Checkpointer(
        model, f"{root}/side", optimizer=opt, config=config, statefuls={"counter": counter}
    ) as ckpt:
        ckpt.save(26).wait()
        tm.train_step(model, opt, 27, rank, hot=60)
        counter.seen = 5
        torch.manual_seed(1234 + rank)
        before, rng = tm.snapshot_state(model, opt, rank), torch.get_rng_state()
        if rank == 1:
            failpoints.arm("restore.fetch")
        out["side_error"] = tm.raised(lambda: ckpt.restore(26))
        out["side_kept"] = tm.differences(before, tm.snapshot_state(model, opt, rank))
        out["rng_kept"] = torch.equal(rng, torch.get_rng_state())
        out["counter"] = (counter.seen, counter.loads)
        tm.train_step(model, opt, 28, rank, hot=60)
        out["after_failed_side"] = ckpt.save(28).wait().kind
        out["side_restored"] = (ckpt.restore(26), counter.seen)
    out["armed"] = failpoints.armed()
    return out


class _Counter:
    """A stateful that counts its loads."""

    def __init__(self) -> None:
        self.seen, self.loads = 0, 0

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen, self.loads = state["seen"], self.loads + 1


def test_failures_roll_back_on_every_rank_and_training_goes_on() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_scenarios, 2, root, timeout_s=300)
    for rank, out in enumerate(results):
        where = f"rank {rank}"
        own = rank == 0
        assert out["failed_diff"], where
        expected = "SaveError" if own else "SaveRankError"
        assert out["failed_diff"].startswith(expected), (where, out["failed_diff"])
        assert (
            "step 3" in out["failed_diff"] and "injected fault at save.dense" in out["failed_diff"]
        ), where
        assert out["reference_kept"], where
        assert not out["leftover_3"] or rank == 1, where  # rank 0 deletes it, maybe after 1 looks
        assert out["next"] == "diff" and out["restored_exact"], where
        assert out["after_restore"] == "full", where  # a restore leaves no reference
        assert out["failed_full"] and "save.encode" in out["failed_full"], where
        assert out["full_kinds"] == ["full", "diff", "full", "diff"], where
        assert not out["ready_after_failed_full"] and out["ready_after_full"], where
        assert out["plan_error"] and "staging budget" in out["plan_error"], where
        assert "rank 1" in out["plan_error"], where
        assert out["plan_committed"] == [], where
        assert out["bits_error"] and "save.plan" in out["bits_error"], where
        assert out["bits_diff"] == [], (where, out["bits_diff"])
        # Interval 3 from step 13: saves at 15 and 18; 18 fails, 19 tries again, then 22.
        assert out["interval_saved"] == [
            (13, None),
            (14, None),
            (15, 15),
            (16, None),
            (17, None),
            (18, "raised"),
            (19, 19),
            (20, None),
            (21, None),
        ], (where, out["interval_saved"])
        assert out["interval_leftovers"] == [] and out["interval_committed"] == [15, 19], where
        assert out["retention_save"] == 23 and out["kept"] == [24], where
        assert out["restore_error"], where
        kind = "RestoreError" if rank == 1 else "RestoreRankError"
        assert out["restore_error"].startswith(kind), (where, out["restore_error"])
        assert "restore.apply" in out["restore_error"], where
        assert out["after_failed_restore"] == "full" and out["restored"] == 25, where
        kind = "RestoreError" if rank == 1 else "RestoreRankError"
        assert out["side_error"].startswith(kind), (where, out["side_error"])
        assert "restore.fetch" in out["side_error"], where
        assert out["side_kept"] == [] and out["rng_kept"], (where, out["side_kept"])
        # Rank 0 loaded the saved count, then put its own back; rank 1 loaded nothing.
        assert out["counter"] == (5, 2 if rank == 0 else 0), where
        assert out["after_failed_side"] == "full" and out["side_restored"] == (26, 0), where
        assert out["armed"] == (), where


def test_interval_and_clock_come_back_as_they_were() -> None:
    from embckpt.interval import AdaptiveInterval, IntervalMeasurements, IterationClock

    clock = IterationClock()
    for now in (0.0, 1.0, 2.0, 3.5):
        clock.tick(now, busy=now > 3)
    interval = AdaptiveInterval(10, 0.05)
    interval.update(IntervalMeasurements(1.0, 0.0, 0.2, 3))
    state, window = interval.state(), clock.window()
    taken = clock.collect(0.4)
    interval.update(IntervalMeasurements(taken.clean_iter_s, taken.busy_extra_s, 0.4, 3))
    assert interval.state() != state and clock.window() != window
    clock.tick(4.0, busy=False)  # an iteration timed while the failed save ran
    interval.restore(state)
    clock.give_back(window)
    assert interval.state() == state and len(interval.history) == 1
    again = clock.collect(0.4)
    assert again.iterations == taken.iterations + 1
    # Clean iterations of 1 s, 1 s and, timed since, 0.5 s; the busy one as before.
    assert again.clean_iter_s == (1.0 + 1.0 + 0.5) / 3
    assert again.busy_extra_s == 1.5 - again.clean_iter_s


def _peer_dies(rank: int, world_size: int, root: str) -> None:
    import time

    from embckpt import CheckpointConfig, Checkpointer, failpoints

    model, opt = tm.build(world_size, seed=0)
    ckpt = Checkpointer(model, f"{root}/ckpt", optimizer=opt, config=CheckpointConfig())
    tm.train_step(model, opt, 1, rank)
    ckpt.save(1).wait()
    tm.train_step(model, opt, 2, rank)
    if rank == 1:
        failpoints.arm("save.encode", action=lambda: os._exit(3))
    started = time.perf_counter()
    error = tm.raised(lambda: ckpt.save(2).wait())
    with open(f"{root}/rank{rank}.txt", "w") as out:
        out.write(f"{time.perf_counter() - started:.1f}\n{error}")


def test_a_rank_that_dies_mid_save_fails_the_save_on_the_others() -> None:
    from embckpt.examples.launcher import RankFailed

    with tempfile.TemporaryDirectory() as root:
        try:
            run_ranks(_peer_dies, 2, root, timeout_s=120)
        except RankFailed as exc:  # rank 1 exits on purpose
            assert "(1, 3)" in str(exc), str(exc)
        seconds, error = open(f"{root}/rank0.txt").read().split("\n", 1)
    assert error.startswith("SaveRankError") and "step 2" in error, error
    assert float(seconds) < 60, seconds


def _freed_without_gc(rank: int, world_size: int, root: str) -> list[bool]:
    import gc
    import weakref

    from embckpt import CheckpointConfig, Checkpointer

    model, opt = tm.build(world_size, seed=0)
    gc.disable()  # what is left to the collector may be freed at exit, after its process group
    try:
        ckpt = Checkpointer(model, root, optimizer=opt, config=CheckpointConfig(pipeline="full"))
        for step in (1, 2):
            tm.train_step(model, opt, step, rank)
            ckpt.save(step).wait()
        ckpt.restore()
        ckpt.close()
        refs = [weakref.ref(x) for x in (ckpt, ckpt._saver, ckpt.comm, ckpt.writer)]
        del ckpt
        return [ref() is None for ref in refs]
    finally:
        gc.enable()


def test_a_closed_checkpointer_is_freed_without_the_garbage_collector() -> None:
    # A reference cycle kept the checkpointer's gloo group alive until interpreter exit, where
    # destroying it aborted a torchrun job ("terminate called without an active exception").
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_freed_without_gc, 2, root, timeout_s=120)
    assert results == [[True] * 4, [True] * 4], results
