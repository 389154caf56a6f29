"""The directory lock's lease: expiry, takeover, elastic restarts, renewal, loss, unlock; on a
local disk and on an S3 server on loopback (moto), through a configured ``S3FileSystem``."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from embckpt.examples.launcher import free_port
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import DISCARDED_DIR, LOCK_NAME
from embckpt.storage.lock import (
    DirectoryLock,
    DirectoryLockedError,
    LeaseLostError,
    unlock,
)
from embckpt.storage.retention import discard_newer


def _foreign(expires_in: float, run_id: str | None = None) -> dict[str, object]:
    """A lock written by a job on another host."""
    now = time.time()
    return {
        "run_id": run_id,
        "host": "other-node-7",
        "pid": 4242,
        "since": now - 100,
        "expires": now + expires_in,
        "lease_s": 60.0,
        "token": "f" * 32,
    }


def _write(store: CheckpointStore, owner: dict[str, object]) -> None:
    with store.fs.open_output_stream(f"{store.root}/{LOCK_NAME}") as out:
        out.write(json.dumps(owner).encode())


def _read(store: CheckpointStore) -> dict[str, object]:
    with store.fs.open_input_stream(f"{store.root}/{LOCK_NAME}") as src:
        return dict(json.loads(src.read()))


def _lock(store: CheckpointStore, lease_s: float = 60.0) -> DirectoryLock:
    return DirectoryLock(store.fs, store.root, store.is_local, lease_s)


def _check_lease_rules(
    store: CheckpointStore, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rule on one store; the lock file is written as another host would."""
    store.create_root()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)

    _write(store, _foreign(expires_in=300))
    with pytest.raises(DirectoryLockedError) as refused:
        _lock(store).acquire()
    message = str(refused.value)
    assert "process 4242 on other-node-7" in message and "lease until" in message, message
    assert time.strftime("%Y-%m-%d", time.gmtime(time.time() + 300)) in message
    assert _read(store)["token"] == "f" * 32  # untouched

    _write(store, _foreign(expires_in=-1))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="embckpt.storage.lock"):
        lock = _lock(store)
        assert lock.acquire() is True
    assert "other-node-7" in caplog.text and "expired" in caplog.text, caplog.text
    mine = _read(store)
    assert mine["host"] == socket.gethostname() and mine["pid"] == os.getpid()
    assert mine["expires"] > time.time() + 50  # type: ignore[operator]
    lock.check_held()
    lock.release()
    assert not store.fs.get_file_info(f"{store.root}/{LOCK_NAME}").is_file

    # An elastic restart: same run id, another node, lease still live.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-31")
    _write(store, _foreign(expires_in=300, run_id="job-31"))
    lock = _lock(store)
    assert lock.acquire() is True
    assert _read(store)["run_id"] == "job-31"
    lock.release()
    _write(store, _foreign(expires_in=300, run_id="job-32"))  # another job's live lease
    with pytest.raises(DirectoryLockedError, match="run job-32"):
        _lock(store).acquire()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default names no job
    _write(store, _foreign(expires_in=300, run_id=None))
    with pytest.raises(DirectoryLockedError, match="other-node-7"):
        _lock(store).acquire()

    # A lease taken over while held: the holder refuses to commit.
    _write(store, _foreign(expires_in=-1))
    lock = _lock(store)
    lock.acquire()
    _write(store, _foreign(expires_in=300))
    with pytest.raises(LeaseLostError, match="taken over by process 4242 on other-node-7"):
        lock.check_held()
    lock.release()
    assert _read(store)["host"] == "other-node-7"  # not ours to delete

    # unlock: removes whoever holds it and says who that was.
    assert "process 4242 on other-node-7" in str(unlock(store.root, filesystem=store.fs))
    assert unlock(store.root, filesystem=store.fs) is None
    assert not store.fs.get_file_info(f"{store.root}/{LOCK_NAME}").is_file


def test_lock_errors_are_public_and_the_ones_the_lock_raises(tmp_path: Path) -> None:
    """Users catch them from the package; the lock module raises those very classes."""
    import embckpt
    import embckpt.storage.lock as lock_module
    from embckpt import DirectoryLockedError as Locked
    from embckpt import EmbckptError
    from embckpt import LeaseLostError as Lost

    assert Locked is DirectoryLockedError is lock_module.DirectoryLockedError
    assert Lost is LeaseLostError is lock_module.LeaseLostError
    assert {"DirectoryLockedError", "LeaseLostError"} <= set(embckpt.__all__)
    for cls in (Locked, Lost):
        assert issubclass(cls, EmbckptError) and issubclass(cls, RuntimeError)
        assert cls.__module__ == "embckpt.errors"
    store = CheckpointStore(tmp_path)
    _write(store, _foreign(expires_in=300))
    with pytest.raises(Locked, match="in use by process 4242"):
        _lock(store).acquire()
    lock = _lock(store)
    with pytest.raises(Lost, match="does not hold"):
        lock.check_held()


def test_lease_rules_on_a_local_disk(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(tmp_path / "ckpts")
    _check_lease_rules(store, caplog, monkeypatch)
    (tmp_path / "ckpts" / LOCK_NAME).write_text("{not json")
    assert unlock(tmp_path / "ckpts") == "an unreadable lock"
    assert unlock(tmp_path / "ckpts") is None


def test_renewal_keeps_the_lease_past_its_length(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    lock = _lock(store, lease_s=0.9)
    lock.acquire()
    first = _read(store)
    time.sleep(2.5)  # almost three leases: only renewals keep it alive
    renewed = _read(store)
    assert renewed["token"] == first["token"]
    assert renewed["expires"] > time.time()  # type: ignore[operator]
    lock.check_held()
    # Another process on this host (alive, same lease rules) is refused.
    probe = (
        "import sys; from embckpt.storage.fs import CheckpointStore;"
        "from embckpt.storage.lock import DirectoryLock, DirectoryLockedError;"
        f"s = CheckpointStore({str(tmp_path)!r});"
        "l = DirectoryLock(s.fs, s.root, True, 0.9)\n"
        "try:\n l.acquire()\nexcept DirectoryLockedError as e:\n print(e); sys.exit(3)"
    )
    other = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert other.returncode == 3, other.stdout + other.stderr
    assert f"process {os.getpid()}" in other.stdout
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_lease_that_is_not_renewed_is_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(tmp_path)
    lock = _lock(store, lease_s=30)
    lock.acquire()
    lease = lock._lease
    assert lease is not None
    lease.stop.set()  # the renewals below are driven by hand

    def unreachable(path: str | None = None) -> None:
        raise OSError("storage unreachable")

    monkeypatch.setattr(lock, "_read", unreachable)
    with caplog.at_level(logging.WARNING, logger="embckpt.storage.lock"):
        assert lock._renew(lease) is True  # a failed renewal is retried while the lease lasts
        assert "renewing the lease failed: storage unreachable" in caplog.text
        lease.owner["expires"] = time.time() - 1
        assert lock._renew(lease) is False
    assert "lost the directory lock" in caplog.text
    monkeypatch.undo()
    with pytest.raises(LeaseLostError, match="expired"):
        lock.check_held()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[pafs.S3FileSystem]:
    """A configured S3FileSystem (endpoint, retry strategy) on a moto server, bucket ``ckpts``."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    try:
        fs = pafs.S3FileSystem(
            endpoint_override=f"127.0.0.1:{port}",
            scheme="http",
            region="us-east-1",
            allow_bucket_creation=True,
            retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=2),
        )
        fs.create_dir("ckpts")
        yield fs
    finally:
        server.stop()


def test_lease_rules_and_discard_on_s3(
    s3: pafs.S3FileSystem, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore("ckpts/job", filesystem=s3)
    assert store.uri == "s3://ckpts/job" and not store.is_local
    _check_lease_rules(store, caplog, monkeypatch)
    # Newer checkpoints move aside manifest first, every file with them.
    for step in (10, 20, 30):
        store.write_atomic(store.step_path(step, "dense/rank_00000.safetensors"), b"x" * step)
        store.write_atomic(store.step_path(step, "MANIFEST.json"), b"{}")
    moved, into = discard_newer(store, 10)
    assert moved == [30, 20] and into is not None
    assert store.committed_steps() == [10] and store.leftover_steps() == []
    assert into.startswith(f"ckpts/job/{DISCARDED_DIR}/after_step_000000000010_")
    for step in (20, 30):
        folder = f"{into}/step_{step:012d}"
        assert s3.get_file_info(f"{folder}/MANIFEST.json").is_file
        assert s3.get_file_info(f"{folder}/dense/rank_00000.safetensors").size == step
    assert discard_newer(store, 10) == ([], None)


def test_a_filesystem_with_a_uri_is_refused(s3: pafs.S3FileSystem) -> None:
    with pytest.raises(ValueError, match="not a URI"):
        CheckpointStore("s3://ckpts/job", filesystem=s3)
