"""Reliability: random damage is always caught, one job per directory, a full disk fails the
save cleanly, object storage (an S3 server on loopback) works end to end, nothing is unpickled."""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import errno
import json
import os
import random
import shutil
import subprocess
import threading
import uuid
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import toy_model as tm

from embckpt.examples.launcher import free_port, run_ranks
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.lock import DirectoryLock, DirectoryLockedError
from embckpt.storage.verify import verify

pytestmark = pytest.mark.slow(25)  # seconds here, on 2 cores: see conftest.py


def _damage(path: Path, others: list[Path], rng: random.Random) -> str:
    data = path.read_bytes()
    kind = rng.choice(["flip", "truncate", "extend", "delete", "swap", "zero"])
    if kind == "flip":
        buf = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(buf))
    elif kind == "truncate":
        path.write_bytes(data[: rng.randrange(len(data))])
    elif kind == "extend":
        path.write_bytes(data + os.urandom(rng.randint(1, 64)))
    elif kind == "delete":
        path.unlink()
    elif kind == "swap":
        donor = rng.choice([o for o in others if o.read_bytes() != data])
        shutil.copyfile(donor, path)
    else:
        start = rng.randrange(len(data))
        path.write_bytes(data[:start] + bytes(min(16, len(data) - start)) + data[start + 16 :])
    return kind


def test_fuzz_random_damage_is_always_caught(run_copy: Path) -> None:
    directory = run_copy / "incremental"
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != "LOCK")
    pristine = {p: p.read_bytes() for p in files}
    rng = random.Random(7)
    kinds: dict[str, int] = {}
    for trial in range(150):
        target = rng.choice(files)
        kind = _damage(target, [f for f in files if f != target], rng)
        if target.exists() and target.read_bytes() == pristine[target]:
            continue  # a no-op damage (e.g. zeroing zeros): nothing to catch
        kinds[kind] = kinds.get(kind, 0) + 1
        report = verify(CheckpointStore(directory))
        named = [path for path, _ in report.problems]
        step_dir = str(target.parent).split("/step_")[1].split("/")[0]
        manifest = str(directory / f"step_{step_dir}" / "MANIFEST.json")
        if kind == "delete" and target.name == "MANIFEST.json":
            # A checkpoint exists iff its manifest does: this one is gone, now a leftover, and
            # whatever depended on it is reported.
            assert int(step_dir) in report.leftovers, (trial, report)
        else:
            assert not report.ok, f"trial {trial}: {kind} of {target} went unnoticed"
            assert str(target) in named or manifest in named, (trial, kind, target, named)
        target.write_bytes(pristine[target])
    assert verify(CheckpointStore(directory)).ok
    assert len(kinds) == 6 and sum(kinds.values()) >= 140, kinds


def test_one_job_per_directory(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.create_root()
    (tmp_path / "LOCK").write_text(json.dumps({"host": os.uname().nodename, "pid": 1, "since": 0}))
    with pytest.raises(DirectoryLockedError, match="in use by process 1"):
        DirectoryLock(store.fs, store.root, True).acquire()
    finished = subprocess.run(["true"], check=True)  # a process that is certainly gone
    dead_pid = subprocess.Popen(["true"]).pid
    os.waitpid(dead_pid, 0)
    assert finished.returncode == 0
    (tmp_path / "LOCK").write_text(json.dumps({"host": os.uname().nodename, "pid": dead_pid}))
    first = DirectoryLock(store.fs, store.root, True)
    assert first.acquire() is True  # a stale lock is taken over
    second = DirectoryLock(store.fs, store.root, True)
    assert second.acquire() is False  # the same process shares it
    second.release()
    assert (tmp_path / "LOCK").exists()
    first.release()
    assert not (tmp_path / "LOCK").exists()


def _save_restore_verify(rank: int, world_size: int, uri: str, locked: str, writer: str) -> dict:
    from embckpt import CheckpointConfig, Checkpointer
    from embckpt.storage.lock import DirectoryLockedError

    out: dict = {}
    config = CheckpointConfig(policy="one_shot", full_every=0, writer=writer)
    model, opt = tm.build(world_size, seed=0)
    with Checkpointer(model, uri, optimizer=opt, config=config) as ckpt:
        for step in range(1, 10):
            tm.train_step(model, opt, step, rank, hot=100)
            if step % 3 == 0:
                ckpt.save(step).wait()
        out["lock_held"] = ckpt.store.fs.get_file_info(f"{ckpt.store.root}/LOCK").size is not None
    expected = tm.snapshot_state(model, opt, rank)
    fresh, fresh_opt = tm.build(world_size, seed=4)
    restoring = dataclasses.replace(config, writer="thread")  # restores only: no writer process
    with Checkpointer(fresh, uri, optimizer=fresh_opt, config=restoring) as ckpt:
        out["restored"] = ckpt.restore()
        out["committed"] = ckpt.store.committed_steps()
    out["diff"] = tm.differences(expected, tm.snapshot_state(fresh, fresh_opt, rank))
    try:
        Checkpointer(fresh, locked, optimizer=fresh_opt)
        out["second_job"] = None
    except DirectoryLockedError as exc:
        out["second_job"] = str(exc)
    except Exception as exc:  # the other ranks quote rank 0's refusal
        out["second_job"] = str(exc)
    return out


@pytest.mark.parametrize("writer", ["auto", "process"])
def test_s3_save_restore_verify_and_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    """Also through the writer process, which writes the rows to the same S3 endpoint."""
    import pyarrow.fs as pafs
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        for key, value in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            monkeypatch.setenv(key, value)
        query = f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
        fs, _ = pafs.FileSystem.from_uri(f"s3://ckpts?{query}&allow_bucket_creation=true")
        fs.create_dir("ckpts")
        job = f"job-{uuid.uuid4().hex[:8]}"  # moto's buckets outlive its server in-process
        uri = f"s3://ckpts/{job}?{query}"
        locked = tmp_path / "locked"
        locked.mkdir()
        (locked / "LOCK").write_text(json.dumps({"host": os.uname().nodename, "pid": 1}))
        results = run_ranks(_save_restore_verify, 2, uri, str(locked), writer)
        report = verify(CheckpointStore(uri))
        objects = fs.get_file_info(pafs.FileSelector(f"ckpts/{job}", recursive=True))
    finally:
        server.stop()
    for rank, out in enumerate(results):
        assert out["restored"] == 9 and out["committed"] == [3, 6, 9], rank
        assert out["diff"] == [], rank
        assert "in use by process 1" in out["second_job"], rank
    assert results[0]["lock_held"]
    assert report.ok and report.checked == [3, 6, 9]
    names = {info.base_name for info in objects}
    assert "LOCK" not in names  # released on close
    assert not any(".tmp-" in n for n in names)  # object stores need no temporary names


class _FullDisk:
    """A local disk with ``free`` bytes left, for the files embckpt's storage writes (``open`` in
    ``storage.fs`` and ``storage.lock``): once they are taken, a write stores what fits and
    fails with ENOSPC, as a full disk's does. No mount needed, so the test runs anywhere."""

    def __init__(self, free: int) -> None:
        self.free = free
        self._lock = threading.Lock()

    def open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        opened = builtins.open(file, mode, *args, **kwargs)
        return opened if set(mode).isdisjoint("wax+") else _Filling(self, opened)

    def take(self, wanted: int) -> int:
        with self._lock:
            granted = min(wanted, self.free)
            self.free -= granted
            return granted

    def patch(self) -> contextlib.ExitStack:
        from embckpt.storage import fs, lock

        stack = contextlib.ExitStack()
        for module in (fs, lock):
            stack.enter_context(mock.patch.object(module, "open", self.open, create=True))
        return stack


class _Filling:
    """A file being written on a :class:`_FullDisk`."""

    def __init__(self, disk: _FullDisk, file: Any) -> None:
        self._disk, self._file = disk, file

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        granted = self._disk.take(len(view))
        self._file.write(view[:granted])
        if granted < len(view):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._file.name)
        return granted

    def __enter__(self) -> _Filling:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def __getattr__(self, name: str) -> Any:  # flush, fileno, close, name
        return getattr(self._file, name)


def _fill_disk(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed as dist

    from embckpt import CheckpointConfig, Checkpointer, SaveError

    out: dict = {}
    config = CheckpointConfig(policy="one_shot", full_every=0)
    model, opt = tm.build(world_size, seed=0)
    ckpt = Checkpointer(model, root, optimizer=opt, config=config)
    tm.train_step(model, opt, 1, rank)
    ckpt.save(1).wait()
    at_1 = tm.snapshot_state(model, opt, rank)
    tm.train_step(model, opt, 2, rank)
    disk = _FullDisk(free=4096)  # almost no room
    with disk.patch():
        try:
            ckpt.save(2).wait()
            out["full_disk"] = None
        except SaveError as exc:
            out["full_disk"] = str(exc)
        out["filled"] = disk.free == 0
        tm.train_step(model, opt, 3, rank)  # training goes on
        out["committed_when_full"] = ckpt.store.committed_steps()
        out["debris_when_full"] = sorted(
            str(p.relative_to(root)) for p in Path(root).rglob("*") if ".tmp-" in p.name
        )
    dist.barrier()  # space freed on every rank
    out["after_space_freed"] = ckpt.save(3).wait().kind
    ckpt.close()
    fresh, fresh_opt = tm.build(world_size, seed=3)
    with Checkpointer(fresh, root, optimizer=fresh_opt, config=config) as other:
        out["restored_1"] = other.restore(1)
    out["diff_1"] = tm.differences(at_1, tm.snapshot_state(fresh, fresh_opt, rank))
    return out


def test_full_disk_fails_the_save_cleanly(tmp_path: Path) -> None:
    """A disk filled during a save (simulated, see :class:`_FullDisk`) fails that save on every
    rank, leaves no partial file or step, and the next save after space is freed commits."""
    root = tmp_path / "ckpts"
    results = run_ranks(_fill_disk, 2, str(root))
    for rank, out in enumerate(results):
        assert out["full_disk"] and "No space left" in out["full_disk"], (rank, out["full_disk"])
        assert out["committed_when_full"] == [1], rank
        assert out["debris_when_full"] == [], rank
        assert out["after_space_freed"] == "diff", rank
        assert out["restored_1"] == 1 and out["diff_1"] == [], rank
    assert any(out["filled"] for out in results)  # some write hit the full disk
    assert verify(CheckpointStore(root)).ok
    assert CheckpointStore(root).committed_steps() == [1, 3]


def test_loading_never_unpickles() -> None:
    import re

    source = Path(__file__).parents[1] / "embckpt"
    banned = re.compile(r"(?<![\w.])(import pickle|pickle\.load|torch\.load\(|np\.load\()")
    for path in source.rglob("*.py"):
        found = banned.search(path.read_text())
        assert found is None, f"{path} uses {found.group(0) if found else ''}"
