"""Failed saves leave the previous checkpoint restorable; damaged or mismatched checkpoints
are refused with an error naming the file or table (2 gloo ranks)."""

from __future__ import annotations

import glob
import os
import tempfile

import torch.distributed as dist
import toy_model as tm

from embckpt.examples.launcher import run_ranks
from embckpt.storage.lock import LOCK_NAME


def _on_rank0(rank: int, fn) -> None:
    if rank == 0:
        fn()
    dist.barrier()


def _scenarios(rank: int, world_size: int, root: str) -> dict:
    from embckpt import CheckpointConfig, Checkpointer

    out: dict = {}
    one_shot = CheckpointConfig(policy="one_shot", full_every=0)
    model, opt = tm.build(world_size, seed=0)
    ckpt = Checkpointer(model, f"{root}/a", optimizer=opt, config=one_shot)
    for step in range(1, 11):
        tm.train_step(model, opt, step, rank, hot=80)
        if step in (5, 10):
            ckpt.save(step).wait()
    at_10 = tm.snapshot_state(model, opt, rank)
    for step in range(11, 16):
        tm.train_step(model, opt, step, rank, hot=80)

    # 1. A writer that fails part-way (on rank 1, after its first file) fails the save everywhere.
    real_write = ckpt.store.write_file
    calls = {"n": 0}

    def failing_write(step, relative, data, *checksum, **timing):
        calls["n"] += 1
        if rank == 1 and calls["n"] == 2:
            raise OSError("injected: disk went away")
        return real_write(step, relative, data, *checksum, **timing)

    ckpt.store.write_file = failing_write
    out["failed_save"] = tm.raised(lambda: ckpt.save(15).wait())
    ckpt.store.write_file = real_write
    out["manifest_15_after_failure"] = os.path.exists(f"{root}/a/step_000000000015/MANIFEST.json")
    out["leftover_15"] = ckpt.store.leftover_steps()
    fresh, fresh_opt = tm.build(world_size, seed=3)
    with Checkpointer(fresh, f"{root}/a", optimizer=fresh_opt, config=one_shot) as other:
        out["restored_after_failure"] = other.restore()
    out["diff_vs_10"] = tm.differences(at_10, tm.snapshot_state(fresh, fresh_opt, rank))

    # The failed save gave its tracker bits back: a retry writes every row changed since 5.
    out["retry"] = ckpt.save(15).wait().kind
    ckpt.close()
    with Checkpointer(fresh, f"{root}/a", optimizer=fresh_opt, config=one_shot) as other:
        other.restore()
    out["diff_retry"] = tm.differences(
        tm.snapshot_state(model, opt, rank), tm.snapshot_state(fresh, fresh_opt, rank)
    )

    # 2. A truncated rows file (written by rank 1) of step 15.
    target = sorted(glob.glob(f"{root}/a/step_000000000015/tables/{tm.table('tw')}/*.parquet"))[0]
    original = open(target, "rb").read()
    out["damaged_file"] = target
    dist.barrier()  # every rank holds the original bytes before rank 0 damages the file
    _on_rank0(rank, lambda: open(target, "wb").write(original[: len(original) // 2]))
    with Checkpointer(fresh, f"{root}/a", optimizer=fresh_opt, config=one_shot) as other:
        before = tm.snapshot_state(fresh, fresh_opt, rank)
        out["truncated"] = tm.raised(other.restore)
        out["untouched_after_refusal"] = tm.differences(
            before, tm.snapshot_state(fresh, fresh_opt, rank)
        )
        # 3. One flipped byte, same size.
        altered = bytearray(original)
        altered[len(altered) // 3] ^= 0xFF
        _on_rank0(rank, lambda: open(target, "wb").write(bytes(altered)))
        out["altered"] = tm.raised(other.restore)
        _on_rank0(rank, lambda: open(target, "wb").write(original))
        out["repaired"] = other.restore()

    # 4. An incremental chain with a missing link.
    incremental = CheckpointConfig(policy="incremental", full_every=0)
    with Checkpointer(model, f"{root}/b", optimizer=opt, config=incremental) as chain:
        for step in (16, 17, 18):
            tm.train_step(model, opt, step, rank, hot=80)
            chain.save(step).wait()
    _on_rank0(rank, lambda: os.remove(f"{root}/b/step_000000000017/MANIFEST.json"))
    with Checkpointer(fresh, f"{root}/b", optimizer=fresh_opt, config=incremental) as other:
        out["missing_link"] = tm.raised(other.restore)

    # 5. A model whose tables differ from the checkpoint's.
    bigger, bigger_opt = tm.build(world_size, seed=0, rows=tm.ROWS + 8)
    with Checkpointer(bigger, f"{root}/a", optimizer=bigger_opt) as other:
        out["mismatch"] = tm.raised(other.restore)

    # 6. An empty directory restores nothing, on every rank.
    with Checkpointer(fresh, f"{root}/empty", optimizer=fresh_opt) as other:
        out["empty"] = other.restore()
        out["empty_created"] = os.path.isdir(f"{root}/empty")

    # 7. Rank 0 chooses the step for every rank: one that is not committed, or a listing that
    # fails on rank 0 alone, raises on every rank with rank 0's reason.
    with Checkpointer(fresh, f"{root}/a", optimizer=fresh_opt, config=one_shot) as other:
        out["not_committed"] = tm.raised(lambda: other.restore(12))
        if rank == 0:

            def unlistable() -> None:
                raise OSError("injected: listing failed")

            other.store.newest_committed = unlistable
        out["unlisted"] = tm.raised(other.restore)
    return out


def test_failures_are_caught_and_named() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_scenarios, 2, root)
    for rank, out in enumerate(results):
        where = f"rank {rank}"
        assert "SaveError" in out["failed_save"] or "RankError" in out["failed_save"], where
        assert "injected: disk went away" in out["failed_save"], where
        assert out["manifest_15_after_failure"] is False, where
        assert out["restored_after_failure"] == 10, where
        assert out["diff_vs_10"] == [], where
        assert out["retry"] == "diff", where
        assert out["diff_retry"] == [], where
        name = os.path.basename(out["damaged_file"])
        assert out["truncated"] and name in out["truncated"], (where, out["truncated"])
        assert out["untouched_after_refusal"] == [], where
        assert out["altered"] and name in out["altered"] and "CRC32C" in out["altered"], where
        assert out["repaired"] == 15, where
        assert out["missing_link"] and "ChainIncompleteError" in out["missing_link"], where
        assert "step_000000000017" in out["missing_link"], where
        assert out["mismatch"] and "ModelMismatchError" in out["mismatch"], where
        assert f"table {tm.COLLECTION}.t_" in out["mismatch"], where
        assert out["empty"] is None and out["empty_created"], where
        assert "no committed checkpoint of step 12" in out["not_committed"], where
        assert "committed: 5, 10, 15" in out["not_committed"], where
        assert "cannot list the checkpoints" in out["unlisted"], where
        assert "injected: listing failed" in out["unlisted"], where
    # The truncated file was written by rank 1 (table-wise on the last rank): rank 1 names the
    # size problem itself, rank 0 quotes it.
    assert "size is" in results[1]["truncated"]
    assert "RankError" in results[0]["truncated"] and "rank 1" in results[0]["truncated"]


def _one_rank_cannot_open(rank: int, world_size: int, root: str) -> str:
    import embckpt.checkpointer as checkpointer_module
    from embckpt import Checkpointer

    model, opt = tm.build(world_size, seed=0)
    if rank == 1:

        def broken(*args, **kwargs):
            raise ValueError("cannot read this rank's tables")

        checkpointer_module.discover = broken  # type: ignore[assignment]
    try:
        Checkpointer(model, root, optimizer=opt).close()
    except Exception as exc:
        dist.barrier()  # both ranks are past the failed open
        return f"{type(exc).__name__}: {exc}; lock left: {os.path.exists(f'{root}/{LOCK_NAME}')}"
    return "opened"


def test_a_rank_that_cannot_open_fails_every_rank() -> None:
    """One rank's failure to read its model's tables, while opening, raises on every rank, and
    the others quote it (they used to see only its connection close, in a later collective);
    the directory's lock, which rank 0 took, is let go."""
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_one_rank_cannot_open, 2, root, timeout_s=120)
    assert results[1] == "ValueError: cannot read this rank's tables; lock left: False", results
    assert results[0].startswith("RankError: opening"), results
    assert "rank 1" in results[0] and "cannot read this rank's tables" in results[0], results
    assert results[0].endswith("lock left: False"), results  # rank 0 took it, and let it go
