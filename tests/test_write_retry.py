"""Writes to the checkpoint directory ride out transient errors: retried whole, with backoff, a
bounded number of times; errors a retry cannot fix fail at once."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from embckpt import CheckpointConfig, ConfigError, load_yaml
from embckpt.examples.workload import DemoConfig
from embckpt.storage import fs as fs_module
from embckpt.storage.fs import CheckpointStore, is_retryable

PAYLOAD = bytes(range(256)) * 1000
ALWAYS = 1 << 30


def _slow_down(attempt: int) -> OSError:
    return OSError(f"injected: 503 Slow Down (attempt {attempt})")


class _FailingClose:
    """An output stream whose data goes through and whose close fails (a multipart upload
    refused at completion)."""

    def __init__(self, stream: pa.NativeFile, error: OSError) -> None:
        self.stream, self.error, self.closed = stream, error, False

    def write(self, data: Any) -> int:
        return self.stream.write(data)

    def flush(self) -> None:
        self.stream.flush()

    def close(self) -> None:
        self.stream.close()
        self.closed = True
        raise self.error


class FlakyHandler(pafs.FileSystemHandler):
    """A local directory whose first ``failures`` output streams fail with ``error(attempt)``,
    when opened or, with ``on_close``, when closed; ``opened`` counts the attempts."""

    def __init__(self, failures: int, error: Any = _slow_down, on_close: bool = False) -> None:
        self.local = pafs.LocalFileSystem()
        self.failures, self.error, self.on_close = failures, error, on_close
        self.opened = 0

    def open_output_stream(self, path: str, metadata: Any) -> Any:
        self.opened += 1
        if self.opened > self.failures:
            return self.local.open_output_stream(path, metadata=metadata)
        if not self.on_close:
            raise self.error(self.opened)
        stream = self.local.open_output_stream(path, metadata=metadata)
        return pa.PythonFile(_FailingClose(stream, self.error(self.opened)), mode="w")

    # -- the rest delegates to the local filesystem ---------------------------------------------
    def get_type_name(self) -> str:
        return "flaky"

    def normalize_path(self, path: str) -> str:
        return self.local.normalize_path(path)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self.local.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self.local.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.local.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        raise PermissionError("not on a test's filesystem")

    def delete_file(self, path: str) -> None:
        self.local.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self.local.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.local.copy_file(src, dest)

    def open_input_stream(self, path: str) -> pa.NativeFile:
        return self.local.open_input_stream(path)

    def open_input_file(self, path: str) -> pa.NativeFile:
        return self.local.open_input_file(path)

    def open_append_stream(self, path: str, metadata: Any) -> pa.NativeFile:
        return self.local.open_append_stream(path, metadata=metadata)


def _store(tmp_path: Path, handler: FlakyHandler, retries: int = 4) -> CheckpointStore:
    fs = pafs.PyFileSystem(handler)
    return CheckpointStore(
        str(tmp_path / "ckpts"), filesystem=fs, write_retries=retries, retry_backoff_s=0
    )


@pytest.mark.parametrize("on_close", [False, True], ids=["open", "close"])
def test_a_write_failing_twice_is_retried_and_complete(
    tmp_path: Path, on_close: bool, caplog: pytest.LogCaptureFixture
) -> None:
    handler = FlakyHandler(failures=2, on_close=on_close)
    store = _store(tmp_path, handler)
    assert not store.is_local
    with caplog.at_level(logging.WARNING, logger=fs_module.__name__):
        written = store.write_file(3, "tables/t/r0.parquet", PAYLOAD)
    assert handler.opened == 3
    assert store.read_checked(3, written).to_pybytes() == PAYLOAD
    path = store.step_path(3, "tables/t/r0.parquet")
    assert (tmp_path / "ckpts" / "step_000000000003" / "tables/t/r0.parquet").read_bytes() == (
        PAYLOAD
    )
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 2
    for attempt, message in enumerate(messages, 1):
        assert path in message and f"attempt {attempt} of 5" in message
        assert f"503 Slow Down (attempt {attempt})" in message


def test_a_write_always_failing_raises_the_last_error_after_every_attempt(
    tmp_path: Path,
) -> None:
    handler = FlakyHandler(failures=ALWAYS)
    store = _store(tmp_path, handler, retries=3)
    with pytest.raises(OSError, match=r"503 Slow Down \(attempt 4\)"):
        store.write_file(1, "dense/x.bin", PAYLOAD)
    assert handler.opened == 4
    assert store.committed_steps() == []


def test_zero_retries_means_one_attempt(tmp_path: Path) -> None:
    handler = FlakyHandler(failures=1)
    store = _store(tmp_path, handler, retries=0)
    with pytest.raises(OSError, match=r"503 Slow Down \(attempt 1\)"):
        store.write_atomic(store.step_path(1, "MANIFEST.json"), b"{}")
    assert handler.opened == 1
    assert not store.is_committed(1)


@pytest.mark.parametrize(
    "error",
    [
        PermissionError(errno.EACCES, "injected: access denied"),
        FileNotFoundError(errno.ENOENT, "injected: no such bucket"),
        OSError(errno.ENOSPC, "injected: no space left"),
        OSError(errno.EROFS, "injected: read-only"),
    ],
    ids=["permission", "not-found", "enospc", "erofs"],
)
def test_errors_a_retry_cannot_fix_fail_at_once(tmp_path: Path, error: OSError) -> None:
    handler = FlakyHandler(failures=1, error=lambda attempt: error)
    store = _store(tmp_path, handler)
    with pytest.raises(type(error), match="injected") as raised:
        store.write_file(1, "dense/x.bin", PAYLOAD)
    assert raised.value.errno == error.errno
    assert handler.opened == 1


@pytest.mark.parametrize(
    "error, retryable",
    [
        (OSError("When uploading part: AWS Error SLOW_DOWN (503 Slow Down)"), True),
        (OSError(errno.EIO, "I/O error"), True),
        (ConnectionResetError(errno.ECONNRESET, "reset"), True),
        (TimeoutError("timed out"), True),
        (PermissionError(errno.EACCES, "denied"), False),
        (FileNotFoundError(errno.ENOENT, "missing"), False),
        (IsADirectoryError(errno.EISDIR, "a folder"), False),
        (NotADirectoryError(errno.ENOTDIR, "not a folder"), False),
        (FileExistsError(errno.EEXIST, "exists"), False),
        (OSError(errno.ENOSPC, "full"), False),
        (OSError(errno.EDQUOT, "quota"), False),
        (OSError(errno.EROFS, "read-only"), False),
        (OSError(errno.ENAMETOOLONG, "long name"), False),
        (ValueError("not an OSError"), False),
    ],
)
def test_which_errors_are_retried(error: BaseException, retryable: bool) -> None:
    assert is_retryable(error) is retryable


def test_a_local_write_is_retried_and_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    replace, calls = os.replace, []

    def flaky_replace(src: str, dst: str) -> None:
        calls.append(src)
        if len(calls) == 1:
            raise OSError(errno.EIO, "injected: I/O error")
        replace(src, dst)

    monkeypatch.setattr(fs_module.os, "replace", flaky_replace)
    store = CheckpointStore(tmp_path / "ckpts", write_retries=2, retry_backoff_s=0)
    assert store.is_local
    written = store.write_file(2, "dense/x.bin", PAYLOAD)
    assert len(calls) == 2 and calls[0] != calls[1] and ".tmp-" in calls[0]
    assert store.read_checked(2, written).to_pybytes() == PAYLOAD
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == ["x.bin"]


def test_a_local_write_always_failing_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def failing_fsync(fd: int) -> None:
        calls.append(fd)
        raise OSError(errno.EIO, "injected: I/O error")

    monkeypatch.setattr(fs_module.os, "fsync", failing_fsync)
    store = CheckpointStore(tmp_path / "ckpts", write_retries=2, retry_backoff_s=0)
    with pytest.raises(OSError, match="injected"):
        store.write_file(2, "dense/x.bin", PAYLOAD)
    assert len(calls) == 3
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_backoff_doubles_with_full_jitter_and_a_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    waits: list[float] = []
    bounds: list[float] = []

    def highest(low: float, high: float) -> float:
        bounds.append(high)
        return high

    monkeypatch.setattr(fs_module.time, "sleep", waits.append)
    monkeypatch.setattr(fs_module._JITTER, "uniform", highest)
    handler = FlakyHandler(failures=ALWAYS)
    store = CheckpointStore(
        str(tmp_path / "ckpts"),
        filesystem=pafs.PyFileSystem(handler),
        write_retries=4,
        retry_backoff_s=1.0,
    )
    with pytest.raises(OSError, match="attempt 5"):
        store.write_file(1, "dense/x.bin", PAYLOAD)
    assert bounds == waits == [1.0, 2.0, 4.0, 5.0]


def test_the_default_waits_are_short_and_random(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    waits: list[float] = []
    monkeypatch.setattr(fs_module.time, "sleep", waits.append)
    handler = FlakyHandler(failures=ALWAYS)
    store = CheckpointStore(str(tmp_path / "ckpts"), filesystem=pafs.PyFileSystem(handler))
    with pytest.raises(OSError):
        store.write_file(1, "dense/x.bin", PAYLOAD)
    assert handler.opened == 5 and len(waits) == 4
    assert all(0 <= wait <= 0.1 * 2**i for i, wait in enumerate(waits))
    assert len(set(waits)) == 4  # jittered, not a fixed schedule


def test_the_store_refuses_negative_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="write_retries"):
        CheckpointStore(tmp_path, write_retries=-1)
    with pytest.raises(ValueError, match="retry_backoff_s"):
        CheckpointStore(tmp_path, retry_backoff_s=-0.5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"write_retries": -1}, r"write_retries must be >= 0, got -1"),
        ({"retry_backoff_s": -0.1}, r"retry_backoff_s must be >= 0, got -0\.1"),
    ],
)
def test_config_refuses_negative_settings(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CheckpointConfig(**kwargs)


def test_config_defaults_and_yaml(tmp_path: Path) -> None:
    config = CheckpointConfig()
    assert (config.write_retries, config.retry_backoff_s) == (4, 0.1)
    assert CheckpointConfig(write_retries=0, retry_backoff_s=0).retry_backoff_s == 0.0
    path = tmp_path / "run.yaml"
    path.write_text("checkpoint:\n  write_retries: 6\n  retry_backoff_s: 0.5s\n")
    loaded = load_yaml(path, DemoConfig).checkpoint
    assert (loaded.write_retries, loaded.retry_backoff_s) == (6, 0.5)
    path.write_text("checkpoint:\n  write_retries: 0\n  retry_backoff_s: 0\n")
    loaded = load_yaml(path, DemoConfig).checkpoint
    assert (loaded.write_retries, loaded.retry_backoff_s) == (0, 0.0)
    path.write_text("checkpoint:\n  write_retries: 1.5\n")
    with pytest.raises(ConfigError, match=r"checkpoint\.write_retries: expected an integer"):
        load_yaml(path, DemoConfig)
    path.write_text("checkpoint:\n  retry_backoff_s: -1\n")
    with pytest.raises(ConfigError, match=r"retry_backoff_s must be >= 0"):
        load_yaml(path, DemoConfig)
