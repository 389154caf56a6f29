"""One job per checkpoint directory: a renewed lease in the file ``LOCK``.

Two jobs saving into one directory would interleave chains and delete each other's leftovers,
so the first job's rank 0 takes a lease on the directory. ``LOCK`` is JSON naming the job
(``run_id``: ``TORCHELASTIC_RUN_ID`` when set, else none; ``host``, ``pid``), ``since``,
``expires`` (unix seconds), ``lease_s`` and a random ``token`` for this acquisition. A daemon
thread renews the lease every ``lease_s / 3``; a job that cannot renew before ``expires`` has
lost it, and :meth:`DirectoryLock.check_held` (called before every commit) refuses.

Another job's lock is taken over when it is expired (clocks of the hosts must agree to well
within a lease), when its process is gone from this host, or at once when it names the same
``TORCHELASTIC_RUN_ID`` (an elastic restart of the same job, whose rank 0 may land on another
node); ``torchrun``'s default run id ``none`` names no job. A live lease is refused, naming its
holder and its expiry. A lock without ``expires`` (either form is read) counts as expired one
lease after its ``since``, unless its process is known alive on this host. Several
checkpointers of one process share one lease.

Exclusion. On local disks (and NFS) a lock is created whole under a temporary name and
hard-linked to ``LOCK``, which fails if one exists; an expired lock is renamed aside and checked
to be the one read before it is replaced, so two takers cannot both win. Object stores have no
exclusive create through ``pyarrow.fs``: pyarrow 26's ``S3FileSystem`` sends no ``If-None-Match``
(``open_output_stream`` drops metadata keys it does not know, so a conditional PUT cannot be
asked for). There the lock is written, then read back, and mutual exclusion is only as good as
that read-back: two jobs starting within one round trip of each other can both believe they
won; the loser notices at its next renewal or commit (the token it reads back is not its own)
and refuses to commit, but files it wrote in between are not undone.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.fs as pafs

# Defined in embckpt.errors (and exported by embckpt); importable from here as before.
from embckpt.errors import DirectoryLockedError as DirectoryLockedError
from embckpt.errors import LeaseLostError as LeaseLostError
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import LOCK_NAME, TEMP_MARK, temp_name

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 60.0
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"


def run_id() -> str | None:
    """The job's elastic run id, or None (unset, or ``torchrun``'s default ``none``)."""
    value = os.environ.get(RUN_ID_ENV, "").strip()
    return None if value in ("", "none") else value


def describe(owner: dict[str, object]) -> str:
    """Who holds a lock, for messages: process, host, run id, and its expiry or age."""
    text = f"process {owner.get('pid')} on {owner.get('host')}"
    if owner.get("run_id"):
        text += f" (run {owner['run_id']})"
    if "expires" in owner:
        return f"{text}, lease until {_when(owner['expires'])}"
    return f"{text}, since {_when(owner.get('since', 0))}"


def _when(unix: object) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(str(unix))))


def _lost_to(found: dict[str, object] | None) -> str:
    if found is None:
        return "the lock file was removed (embckpt unlock?)"
    return f"taken over by {describe(found)}" if found else "overwritten by an unreadable lock"


def _pid_gone(owner: dict[str, object]) -> bool:
    """True only if the owner's process certainly no longer exists (same host, no such pid)."""
    if owner.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(str(owner.get("pid", -1))), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError, OverflowError):
        return False
    return False


@dataclass
class _Lease:
    """This process's hold on one lock file, shared by its checkpointers."""

    owner: dict[str, object]
    users: int = 1
    lost: str | None = None  # why the lease is gone, once it is
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None


_LEASES: dict[str, _Lease] = {}  # lock path -> this process's lease
_LEASES_GUARD = threading.Lock()


class DirectoryLock:
    """The lease of one checkpoint directory: ``acquire``, ``check_held`` before each commit,
    then ``release``.

    Args:
        fs: the directory's filesystem.
        root: the directory, as a path of ``fs``.
        is_local: ``fs`` is a local disk (exclusive creation and atomic rename exist).
        lease_s: how long the lease lasts without renewal.
    """

    def __init__(
        self, fs: pafs.FileSystem, root: str, is_local: bool, lease_s: float = DEFAULT_LEASE_S
    ) -> None:
        if not lease_s > 0:
            raise ValueError(f"lock_lease_s must be > 0, got {lease_s}")
        self.fs, self.path, self.is_local = fs, f"{root}/{LOCK_NAME}", is_local
        self.lease_s = float(lease_s)
        self.held = False
        self._lease: _Lease | None = None

    # -- the file -------------------------------------------------------------------------------
    def _read(self, path: str | None = None) -> dict[str, object] | None:
        """The lock's content; None if there is none; ``{}`` if it is not a lock's JSON.

        Raises:
            OSError: the lock could not be read (an error is no evidence the lock is free).
        """
        try:
            with self.fs.open_input_stream(path or self.path) as src:
                raw = src.read()
        except FileNotFoundError:
            return None
        try:
            found = json.loads(raw)
        except ValueError:
            return {}
        return dict(found) if isinstance(found, dict) else {}

    def _new_owner(self) -> dict[str, object]:
        now = time.time()
        return {
            "run_id": run_id(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": now,
            "expires": now + self.lease_s,
            "lease_s": self.lease_s,
            "token": uuid.uuid4().hex,
        }

    def _write_new(self, owner: dict[str, object]) -> None:
        """Creates ``LOCK``; refused if one appeared meanwhile (checked by read-back on objects)."""
        payload = json.dumps(owner).encode()
        if not self.is_local:
            with self.fs.open_output_stream(self.path) as out:
                out.write(payload)
            if self._read() != owner:
                raise DirectoryLockedError(f"{self.path}: another job took the lock at once")
            return
        tmp = _durable_file(f"{self.path}{TEMP_MARK}{owner['token']}", payload)
        try:
            os.link(tmp, self.path)  # whole or absent; fails if a lock exists
        except FileExistsError:
            raise DirectoryLockedError(
                f"{self.path}: another job took the lock at the same moment"
            ) from None
        finally:
            os.unlink(tmp)

    def _take_over(self, seen: dict[str, object], owner: dict[str, object]) -> None:
        """Replaces the lock ``seen`` (expired, dead or the same job) by ``owner``."""
        if not self.is_local:
            self._write_new(owner)
            return
        aside = f"{self.path}.taken-{owner['token']}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            pass  # removed meanwhile: create ours, exclusively
        else:
            moved = self._read(aside)
            if moved != seen:  # renewed or replaced since it was read: not ours to take
                try:
                    os.link(aside, self.path)
                except FileExistsError:
                    pass
                os.unlink(aside)
                raise DirectoryLockedError(
                    f"{self.path}: the lock changed while it was being taken over "
                    f"(now {describe(moved or {})})"
                )
            os.unlink(aside)
        self._write_new(owner)

    def _replace(self, owner: dict[str, object]) -> None:
        """Rewrites our own lock (a renewal) atomically."""
        payload = json.dumps(owner).encode()
        if not self.is_local:
            with self.fs.open_output_stream(self.path) as out:
                out.write(payload)
            return
        os.replace(_durable_file(temp_name(self.path), payload), self.path)

    # -- acquire, renew, check, release -----------------------------------------------------------
    def _refusal(self, found: dict[str, object], me: dict[str, object]) -> str | None:
        """Why ``found`` may not be taken over (None: it may), logging the takeover if so."""
        now = float(str(me["since"]))
        if not found:
            log.warning("%s: unreadable lock taken over", self.path)
            return None
        if found.get("host") == me["host"] and found.get("pid") == me["pid"]:
            return None  # an earlier lease of this very process
        holder = describe(found)
        if me["run_id"] is not None and found.get("run_id") == me["run_id"]:
            log.warning(
                "%s: run %s restarting: took over its lock (%s)", self.path, me["run_id"], holder
            )
            return None
        if _pid_gone(found):
            log.warning("%s: took over the lock of %s: that process is gone", self.path, holder)
            return None
        if "expires" in found:
            expires = float(str(found["expires"]))
        elif found.get("host") == me["host"]:
            expires = float("inf")  # a lock from before leases, its process alive here
        else:
            expires = float(str(found.get("since", 0))) + self.lease_s
        if now > expires:
            log.warning("%s: took over the expired lock of %s", self.path, holder)
            return None
        return (
            f"{self.path}: checkpoint directory is in use by {holder}; one job per directory "
            "(if that job is gone, wait for its lease to expire or run `embckpt unlock DIR`)"
        )

    def acquire(self) -> bool:
        """Takes the lease, or raises DirectoryLockedError naming the live holder.

        Returns:
            True if this process did not hold the lock before (the caller may clean up).

        Raises:
            DirectoryLockedError: another job holds a live lease (its holder and expiry named),
                or took the lock at the same moment.
            OSError: the lock could not be read or written.
        """
        with _LEASES_GUARD:
            lease = _LEASES.get(self.path)
            if lease is not None and lease.lost is None:
                lease.users += 1
                self._lease, self.held = lease, True
                return False
            me = self._new_owner()
            found = self._read()
            if found is None:
                self._write_new(me)
            else:
                refusal = self._refusal(found, me)
                if refusal is not None:
                    raise DirectoryLockedError(refusal)
                self._take_over(found, me)
            lease = _Lease(owner=me)
            lease.thread = threading.Thread(
                target=self._renew_loop, args=(lease,), name="embckpt-lease", daemon=True
            )
            _LEASES[self.path] = lease  # a lost lease it replaces lives on with its holders
            self._lease, self.held = lease, True
        lease.thread.start()
        return True

    def _renew_loop(self, lease: _Lease) -> None:
        while not lease.stop.wait(self.lease_s / 3):
            if not self._renew(lease):
                return

    def _renew(self, lease: _Lease) -> bool:
        """Extends the lease once; False once it is lost (then it stays lost)."""
        now = time.time()
        if now >= float(str(lease.owner["expires"])):
            lease.lost = f"the lease expired at {_when(lease.owner['expires'])} before a renewal"
        else:
            try:
                found = self._read()
                if found is None or found.get("token") != lease.owner["token"]:
                    lease.lost = _lost_to(found)
                else:
                    renewed = {**lease.owner, "expires": now + self.lease_s}
                    self._replace(renewed)
                    lease.owner = renewed
            except OSError as exc:  # retried at the next tick while the lease lasts
                log.warning("%s: renewing the lease failed: %s", self.path, exc)
        if lease.lost is not None:
            log.error("%s: this job lost the directory lock: %s", self.path, lease.lost)
            return False
        return True

    def check_held(self) -> None:
        """Call before a commit: raises if this job no longer holds the directory.

        Raises:
            LeaseLostError: the lease expired unrenewed, or ``LOCK`` now names another holder.
        """
        lease = self._lease
        if not self.held or lease is None:
            raise LeaseLostError(f"{self.path}: this job does not hold the directory lock")
        if lease.lost is None:
            try:
                found = self._read()
            except OSError as exc:
                raise LeaseLostError(f"{self.path}: cannot read the lock: {exc}") from exc
            if found is None or found.get("token") != lease.owner["token"]:
                lease.lost = _lost_to(found)
            elif time.time() >= float(str(lease.owner["expires"])):
                lease.lost = f"the lease expired at {_when(lease.owner['expires'])}"
        if lease.lost is not None:
            raise LeaseLostError(
                f"{self.path}: this job lost the directory lock ({lease.lost}); "
                "refusing to commit a checkpoint another job may be writing next to"
            )

    def release(self) -> None:
        """Drops this holder; the last one stops renewing and deletes ``LOCK`` if still ours."""
        if not self.held:
            return
        lease, self._lease, self.held = self._lease, None, False
        if lease is None:
            return
        with _LEASES_GUARD:
            lease.users -= 1
            if lease.users:
                return
            if _LEASES.get(self.path) is lease:
                del _LEASES[self.path]
        lease.stop.set()
        if lease.thread is not None:
            lease.thread.join()
        try:
            found = self._read()
            if found is not None and found.get("token") == lease.owner["token"]:
                self.fs.delete_file(self.path)
        except OSError as exc:  # the lease expires on its own
            log.warning("%s: could not remove the lock: %s", self.path, exc)


def unlock(directory: str | Path, *, filesystem: pafs.FileSystem | None = None) -> str | None:
    """Removes a directory's lock by hand (``embckpt unlock DIR``), whoever holds it.

    Only for a job known to be gone: a live holder notices at its next renewal or commit and
    stops committing.

    Returns:
        A description of the holder removed; None if there was no lock.
    """
    store = CheckpointStore(directory, filesystem=filesystem)
    lock = DirectoryLock(store.fs, store.root, store.is_local)
    found = lock._read()
    if found is None:
        return None
    store.fs.delete_file(lock.path)
    return describe(found) if found else "an unreadable lock"


def _durable_file(path: str, payload: bytes) -> str:
    """Writes ``payload`` to a new local file and syncs it (before it is linked or renamed into
    place, so the lock never appears half-written); returns ``path``."""
    with open(path, "wb") as out:
        out.write(payload)
        out.flush()
        os.fsync(out.fileno())
    return path
