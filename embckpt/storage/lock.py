"""One job per checkpoint directory: a lock file naming its owner.

Two jobs saving into one directory would interleave chains and delete each other's leftovers,
so the first job's rank 0 takes ``LOCK`` (created exclusively where the filesystem can: local
disks) and a second job is refused with the owner's name. The lock names host and process: a
lock whose process is gone from this host is stale (a killed job) and is taken over; several
checkpointers of one process share it. Object stores cannot create a file exclusively through
``pyarrow.fs``; there the lock is written, then read back to see who won.
"""

from __future__ import annotations

import json
import os
import socket
import time

import pyarrow.fs as pafs

from embckpt.errors import EmbckptError

LOCK_NAME = "LOCK"
_HELD: dict[str, int] = {}  # lock path -> checkpointers of this process holding it


class DirectoryLockedError(EmbckptError, RuntimeError):
    """Another live job holds the checkpoint directory."""


def _me() -> dict[str, object]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}


def _alive(owner: dict[str, object]) -> bool:
    if owner.get("host") != socket.gethostname():
        return True  # another host: cannot tell, assume it is alive
    try:
        os.kill(int(str(owner.get("pid", -1))), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DirectoryLock:
    """The lock of one checkpoint directory; ``acquire`` then ``release``."""

    def __init__(self, fs: pafs.FileSystem, root: str, is_local: bool) -> None:
        self.fs, self.path, self.is_local = fs, f"{root}/{LOCK_NAME}", is_local
        self.held = False

    def _read(self) -> dict[str, object] | None:
        try:
            with self.fs.open_input_stream(self.path) as src:
                return dict(json.loads(src.read()))
        except (FileNotFoundError, OSError, ValueError):
            return None

    def acquire(self) -> bool:
        """Takes the lock, or raises DirectoryLockedError naming the live owner.

        Returns:
            True if this process did not hold the lock before (the caller may clean up).
        """
        if _HELD.get(self.path):
            _HELD[self.path] += 1
            self.held = True
            return False
        me = _me()
        owner = self._read()
        if owner is not None:
            same_process = owner.get("host") == me["host"] and owner.get("pid") == me["pid"]
            if not same_process and _alive(owner):
                since = time.ctime(float(str(owner.get("since", 0))))
                raise DirectoryLockedError(
                    f"{self.path}: checkpoint directory is in use by process {owner.get('pid')} "
                    f"on {owner.get('host')} since {since}; "
                    "one job per directory (delete the LOCK file if that job is gone)"
                )
            self.fs.delete_file(self.path)  # stale (its process is gone) or our own
        payload = json.dumps(me).encode()
        if self.is_local:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                raise DirectoryLockedError(
                    f"{self.path}: another job took the lock at the same moment"
                ) from None
            with os.fdopen(fd, "wb") as out:
                out.write(payload)
        else:
            with self.fs.open_output_stream(self.path) as out:
                out.write(payload)
            if self._read() != json.loads(payload):
                raise DirectoryLockedError(f"{self.path}: another job took the lock")
        self.held = True
        _HELD[self.path] = 1
        return True

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        _HELD[self.path] -= 1
        if _HELD[self.path]:
            return
        del _HELD[self.path]
        owner = self._read()
        if owner is not None and owner.get("pid") == os.getpid():
            self.fs.delete_file(self.path)
