"""Where a save's time goes: the phase clock, the manifest's per-phase seconds, and the
pre-sized buffer of ``encode_file`` (same bytes whether or not its size estimate fits)."""

from __future__ import annotations

import tempfile
import threading
import time

import numpy as np
import pytest
import torch
import toy_model as tm

from embckpt.codecs import make_codec
from embckpt.config import CheckpointConfig
from embckpt.examples.launcher import run_ranks
from embckpt.storage import rowfile_read, rowfile_write
from embckpt.storage.phases import PHASES, PhaseClock


def test_nested_phases_count_only_their_own_time_and_threads_add_up() -> None:
    clock = PhaseClock()

    def work() -> None:
        with clock.time("hash"):
            time.sleep(0.05)
            with clock.time("write"):
                time.sleep(0.1)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = clock.seconds()
    assert set(seconds) == set(PHASES)
    assert 0.2 <= seconds["write"] < 0.3  # two threads, 0.1 s each
    # Without the nested writes (with them, 0.3 or more); the slack is for a loaded machine,
    # where each thread's wake-ups come late (0.20 s seen with a load average of 6 on 2 cores).
    assert 0.1 <= seconds["hash"] < 0.28
    assert seconds["encode"] == 0.0
    with pytest.raises(ValueError, match="unknown save phase 'decode'"):
        with clock.time("decode"):
            pass


def test_encode_file_is_the_same_when_its_buffer_estimate_is_too_small(monkeypatch) -> None:
    n, d = 5000, 16
    rows = np.arange(n, dtype=np.int64) * 3
    weights = torch.randn(n, d)
    args = dict(
        rows=rows,
        encoded=make_codec("raw").encode(weights),
        row_states={"momentum1": np.random.rand(n).astype(np.float32)},
        elem_states={},
        metadata={"table": "t", "cols": d},
        row_group_rows=1024,
    )
    fitted = rowfile_write.encode_file(**args)
    monkeypatch.setattr(rowfile_write, "_SLACK_BYTES", 0)
    monkeypatch.setattr(rowfile_write, "_SLACK_FRACTION", -0.5)  # half the columns: cannot fit
    grown = rowfile_write.encode_file(**args)
    assert fitted.equals(grown)
    back = rowfile_read.decode_file(grown, "f.parquet", 0, 3 * n)
    np.testing.assert_array_equal(back.rows, rows)


SLOWEST = {1: 1, 2: 0}  # step: the rank whose writes are slowed by SLOW_WRITE_S each
SLOW_WRITE_S = 0.1


def _phases(rank: int, world_size: int, root: str) -> dict:
    from embckpt import Checkpointer
    from embckpt.storage.chain import read_manifest

    model, opt = tm.build(world_size, seed=0)
    out: dict = {"slowed": dict.fromkeys(SLOWEST, 0)}
    lock = threading.Lock()
    # A budget of a few rows makes the full go in several pieces, on both threads.
    # Unpacked: each rank writes several files per piece, so slowed writes add up.
    config = CheckpointConfig(
        policy="one_shot", full_every=2, staging_budget_bytes=8192, pack_below_bytes=0
    )
    with Checkpointer(model, root, optimizer=opt, config=config) as ckpt:
        store = ckpt.store
        write_file = store.write_file

        def slow_write(step: int, relative: str, data, *checksum, clock):
            if SLOWEST[step] == rank:  # a slow disk: the wait is this rank's write time
                with clock.time("write"):
                    time.sleep(SLOW_WRITE_S)
                with lock:
                    out["slowed"][step] += 1
            return write_file(step, relative, data, *checksum, clock=clock)

        store.write_file = slow_write
        for step in SLOWEST:
            tm.train_step(model, opt, step, rank, hot=50)
            ckpt.save(step).wait()
        out["manifests"] = {s: read_manifest(store, s).stats for s in SLOWEST}
    return out


def test_manifest_records_the_slowest_ranks_phase_seconds() -> None:
    """One rank's writes are slowed, rank 1's in the first save and rank 0's in the second: the
    manifest names that rank and holds its seconds."""
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_phases, 2, root)
    stats = results[0]["manifests"]
    assert stats == results[1]["manifests"]
    assert sorted(stats) == [1, 2]
    for step, s in stats.items():
        phases = s["phase_seconds"]
        assert set(phases) == set(PHASES), step
        slowest = SLOWEST[step]
        assert s["phase_rank"] == slowest, step
        slowed = results[slowest]["slowed"][step]
        assert slowed >= 2, (step, slowed)
        assert phases["write"] >= slowed * SLOW_WRITE_S, (step, phases)
        for name in ("snapshot", "encode", "write", "fsync", "hash", "commit"):
            assert phases[name] > 0, (step, name)
        # Thread-seconds: at most the save's wall time on each of the persist thread, the
        # training thread and the two writer threads.
        assert sum(phases.values()) <= 4 * s["save_seconds"], step
