"""Resuming from an older step (2 gloo ranks): without ``discard_newer`` saving a committed step
fails naming the option; with it the newer checkpoints move to ``discarded/`` and the job's new
saves are what ``restore()`` finds. The directory is opened through a configured filesystem (a
``SubTreeFileSystem``), and a job whose lease was taken over refuses to commit."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.fs as pafs
import toy_model as tm

from embckpt.examples.launcher import run_ranks
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import DISCARDED_DIR
from embckpt.storage.lock import LOCK_NAME
from embckpt.storage.verify import verify


def _resume_older(rank: int, world_size: int, base: str) -> dict:
    import torch.distributed as dist

    from embckpt import CheckpointConfig, Checkpointer, SaveError

    out: dict = {}
    fs = pafs.SubTreeFileSystem(base, pafs.LocalFileSystem())
    config = CheckpointConfig(policy="one_shot", full_every=0, pipeline="persist")
    model, opt = tm.build(world_size, seed=0)
    with Checkpointer(model, "job", optimizer=opt, config=config, filesystem=fs) as ckpt:
        out["root"] = ckpt.store.root
        for step in range(1, 31):
            tm.train_step(model, opt, step, rank, hot=100)
            if step % 10 == 0:
                ckpt.save(step).wait()
            if step == 20:
                out["old_20"] = tm.snapshot_state(model, opt, rank)

    with Checkpointer(model, "job", optimizer=opt, config=config, filesystem=fs) as ckpt:
        out["plain_restore"] = ckpt.restore(10)
        for key, step in (("save_error", 20), ("older_save_error", 15)):
            # 20 is committed; 15 is not, but 20 and 30 would still be "latest" over it.
            try:
                ckpt.save(step).wait()
                out[key] = None
            except SaveError as exc:  # rank 0's own error
                out[key] = str(exc)
            except Exception as exc:  # the other rank quotes it
                out[key] = str(exc)
        out["restored"] = ckpt.restore(10, discard_newer=True)
        out["after_discard"] = ckpt.store.committed_steps()
        for step in range(11, 21):  # another path from step 10 than the first run took
            tm.train_step(model, opt, step + 500, rank, hot=100)
        ckpt.save(20).wait()
        out["new_20"] = tm.snapshot_state(model, opt, rank)

    fresh, fresh_opt = tm.build(world_size, seed=5)
    with Checkpointer(fresh, "job", optimizer=fresh_opt, config=config, filesystem=fs) as ckpt:
        out["latest"] = ckpt.restore()
        out["diff_new"] = tm.differences(out["new_20"], tm.snapshot_state(fresh, fresh_opt, rank))
        out["diff_old"] = tm.differences(out["old_20"], tm.snapshot_state(fresh, fresh_opt, rank))
        if rank == 0:  # another job takes the directory over while this one runs
            now = time.time()
            lock = {"host": "other-node", "pid": 7, "since": now, "expires": now + 600}
            Path(out["root"], LOCK_NAME).write_text(json.dumps(lock))
        dist.barrier()
        tm.train_step(fresh, fresh_opt, 21, rank, hot=100)
        try:
            ckpt.save(21).wait()
            out["lost_lease_save"] = None
        except Exception as exc:
            out["lost_lease_save"] = str(exc)
        out["after_lost"] = ckpt.store.committed_steps()
    del out["old_20"], out["new_20"]
    return out


def test_resume_from_an_older_step_discards_the_newer_ones(tmp_path: Path) -> None:
    results = run_ranks(_resume_older, 2, str(tmp_path))
    for rank, out in enumerate(results):
        assert out["root"] == str(tmp_path / "job"), rank
        assert out["plain_restore"] == 10 and out["restored"] == 10, rank
        assert "discard_newer=True" in out["save_error"], (rank, out["save_error"])
        assert "newer checkpoints (steps 20, 30)" in out["older_save_error"], (rank, out)
        assert out["after_discard"] == [10], rank
        assert out["latest"] == 20, rank
        assert out["diff_new"] == [], (rank, out["diff_new"])
        assert out["diff_old"] != [], rank  # the new 20 is not the discarded one
        assert "lost the directory lock" in out["lost_lease_save"], (rank, out["lost_lease_save"])
        assert "other-node" in out["lost_lease_save"], rank
        assert out["after_lost"] == [10, 20], rank
    # The foreign lock is not removed by the job that lost it.
    assert json.loads((tmp_path / "job" / LOCK_NAME).read_text())["host"] == "other-node"
    (aside,) = (tmp_path / "job" / DISCARDED_DIR).iterdir()
    assert aside.name.startswith("after_step_000000000010_")
    assert sorted(p.name for p in aside.iterdir()) == ["step_000000000020", "step_000000000030"]
    assert all((p / "MANIFEST.json").is_file() for p in aside.iterdir())
    store = CheckpointStore(
        "job", filesystem=pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    )
    report = verify(store)  # the refused step 21 is a leftover, never a checkpoint
    assert report.ok and report.checked == [10, 20] and report.leftovers == [21], report
