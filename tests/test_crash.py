"""Crash consistency: SIGKILL a rank at each point of a save, in diffs and in a full; the latest
committed checkpoint always restores the exact state of its step and verifies, no partial
checkpoint is ever listed, and the next start cleans up the debris."""

from __future__ import annotations

import os
import signal
import tempfile

import pytest
import toy_model as tm

from embckpt import failpoints
from embckpt.examples.launcher import RankFailed, run_ranks
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import MANIFEST_NAME
from embckpt.storage.sink import ChecksumSink, StreamedFile

pytestmark = pytest.mark.slow(20)  # seconds here, on 2 cores: see conftest.py

SAVE_EVERY = 3
STEPS = 18
POINTS = ("stage", "mid_file", "mid_packed", "between_files", "before_manifest", "after_manifest")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _DyingFile(StreamedFile):
    """A streamed file that kills this process once part of it (the magic and more) has gone
    into the file: the store's own temporary file is left half written."""

    def __init__(self, inner: StreamedFile) -> None:
        self.inner = inner

    def produce(self, sink: ChecksumSink) -> None:
        write = sink.write

        def dying(data):
            written = write(data)
            if sink.tell() > 4:
                _die()
            return written

        sink.write = dying  # type: ignore[method-assign]
        self.inner.produce(sink)


def _arm(ckpt, point: str, nth: int) -> None:
    """Makes the nth occurrence of ``point`` kill this process."""
    count = {"n": 0}

    def hit() -> bool:
        count["n"] += 1
        return count["n"] == nth

    store = ckpt.store
    write_file, write_atomic = store.write_file, store.write_atomic
    if point == "stage":
        failpoints.arm("save.stage", nth=nth, action=_die)
    elif point == "between_files":

        def after_file(step, relative, data, *checksum, **timing):
            written = write_file(step, relative, data, *checksum, **timing)
            if hit():
                _die()
            return written

        store.write_file = after_file
    else:

        def atomic(path, data, **timing):
            is_manifest = path.endswith(MANIFEST_NAME)
            counted = "/packed/" in path if point == "mid_packed" else not is_manifest
            if point in ("mid_file", "mid_packed") and counted and hit():
                if isinstance(data, StreamedFile):  # dies with the file half streamed
                    write_atomic(path, _DyingFile(data), **timing)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(f"{path}.tmp-killed", "wb") as out:
                    out.write(memoryview(data)[: len(memoryview(data)) // 2])
                _die()
            if point == "before_manifest" and is_manifest and hit():
                _die()
            write_atomic(path, data, **timing)
            if point == "after_manifest" and is_manifest and hit():
                _die()

        store.write_atomic = atomic


def _train_and_crash(
    rank: int, world_size: int, root: str, point: str, victim: int, nth: int, packed: bool
):
    from embckpt import CheckpointConfig, Checkpointer

    # Unpacked trials write one file per block; packed ones (the default) share rows files.
    config = CheckpointConfig(
        policy="incremental", full_every=3, **({} if packed else {"pack_below_bytes": 0})
    )
    model, opt = tm.build(world_size, seed=0)
    ckpt = Checkpointer(model, root, optimizer=opt, config=config)
    if rank == victim:
        _arm(ckpt, point, nth)
    for step in range(1, STEPS + 1):
        tm.train_step(model, opt, step, rank, hot=100)
        if step % SAVE_EVERY == 0:
            ckpt.save(step)
    ckpt.close()


def _restore_each(rank: int, world_size: int, roots: list[str]) -> list[dict]:
    from embckpt import CheckpointConfig, Checkpointer
    from embckpt.storage.verify import verify

    reference, ref_opt = tm.build(world_size, seed=0)
    expected = {}
    for step in range(1, STEPS + 1):
        tm.train_step(reference, ref_opt, step, rank, hot=100)
        if step % SAVE_EVERY == 0:
            expected[step] = tm.snapshot_state(reference, ref_opt, rank)
    out = []
    config = CheckpointConfig(policy="incremental", full_every=3)
    for root in roots:
        model, opt = tm.build(world_size, seed=11)
        with Checkpointer(model, root, optimizer=opt, config=config) as ckpt:
            step = ckpt.restore()
            leftovers_after_start = ckpt.store.leftover_steps()
        report = verify(CheckpointStore(root))
        state = tm.snapshot_state(model, opt, rank)
        out.append(
            {
                "step": step,
                "diff": tm.differences(expected[step], state) if step else None,
                "verify_ok": report.ok,
                "leftovers_after_start": leftovers_after_start,
            }
        )
    return out


# (point, victim rank, nth occurrence, step of the save it dies in, packed). Saves at steps 3
# (full), 6, 9 (diffs), 12 (full), 15 and 18 (diffs). Unpacked, rank 0 writes 6 files in each,
# rank 1 5 in a full and 3 in a diff; packed (small blocks of one schema share a rows file),
# rank 0 writes 5 in each, one of them a packed file of two blocks, and rank 1 3. Every point
# is hit in a diff on each rank that reaches it (the manifest is rank 0's); a half-written file
# and a missing manifest, which leave an uncommitted step behind, also in the full of step 12,
# which a restore must not take as the base of its chain; and a half-written packed file, in a
# diff and in a full.
TRIALS = (
    ("stage", 1, 2, 6, False),
    ("stage", 0, 3, 9, False),
    ("mid_file", 1, 8, 6, False),  # its last file
    ("mid_file", 0, 14, 9, False),  # its second file
    ("between_files", 0, 9, 6, False),
    ("between_files", 1, 17, 15, False),  # after the second full
    ("before_manifest", 0, 2, 6, False),
    ("after_manifest", 0, 3, 9, False),
    ("mid_file", 0, 20, 12, False),  # its second file
    ("before_manifest", 0, 4, 12, False),  # every file written
    ("mid_packed", 0, 2, 6, True),  # a packed rows file (two blocks), half written: a diff
    ("mid_packed", 0, 4, 12, True),  # and a full
    ("between_files", 0, 7, 6, True),
    ("mid_file", 0, 17, 12, True),  # its second file of the full
)


@pytest.mark.timeout(600)
def test_sigkill_anywhere_in_a_save_leaves_the_latest_commit_restorable() -> None:
    trials = TRIALS
    assert {t[0] for t in trials} == set(POINTS)
    with tempfile.TemporaryDirectory() as tmp:
        roots, before = [], []
        for i, trial in enumerate(trials):
            point, victim, nth, dies_in, packed = trial
            root = f"{tmp}/trial{i}"
            try:  # the victim dies, its peer loses its connection
                run_ranks(_train_and_crash, 2, root, point, victim, nth, packed, timeout_s=120)
                killed = False
            except RankFailed:
                killed = True
            assert killed, f"trial {i} {trial} never reached its kill point"
            store = CheckpointStore(root)
            committed = store.committed_steps()
            assert committed, f"trial {i} {trial}: died before the first commit, proves nothing"
            last = dies_in if point == "after_manifest" else dies_in - SAVE_EVERY
            assert committed[-1] == last, f"trial {i} {trial}: died elsewhere ({committed})"
            before.append((committed, store.leftover_steps()))
            roots.append(root)
        results = run_ranks(_restore_each, 2, roots)
    saw_debris = 0
    for i, (trial, (committed, leftovers)) in enumerate(zip(trials, before, strict=True)):
        saw_debris += bool(leftovers)
        for rank_results in results:
            r = rank_results[i]
            where = f"trial {i} {trial}"
            assert r["step"] == committed[-1], where
            assert r["diff"] == [], f"{where}: restored state differs from step {r['step']}"
            assert r["verify_ok"], where
            assert r["leftovers_after_start"] == [], f"{where}: debris not cleaned on start"
    assert saw_debris >= 3, "kills never left a half-written checkpoint: the test proves little"
