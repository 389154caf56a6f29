"""The rank's side of its writer process (``save/writer_worker.py``): started, asked, watched.

The process is started with ``subprocess`` (a fresh interpreter: nothing of the training
process is copied into it, no CUDA context, no lock another thread held, no re-run of the
user's script as ``multiprocessing``'s spawn does), or, where the rank's launcher started a
writer zygote (``save/writer_zygote.py``), forked from that (as clean, without the imports),
as soon as the ``Checkpointer`` is built, so that its imports and the codec's kernels are ready
before the first save. It gets two descriptors: a socket to the rank and the shared slab
memory (``save/shared_memory.py``).

Messages go out on the calling thread (the persist thread); a reply thread reads the answers:
a unit's slab freed (given back to the pool), a save finished. If the process dies, every
pending hand-over and the save's finish fail with :class:`WriterProcessError`, which the persist
reports on every rank like any failed save; the next save starts a new process, and, since the
reference died with the old one, is a full.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from embckpt.errors import SaveError
from embckpt.save.reference import ReferenceEdit
from embckpt.save.shared_memory import SharedMemory
from embckpt.save.writer_worker import WriterSpec, receive, send
from embckpt.save.writer_zygote import ZYGOTE_ENV, ForkedProcess, fork_writer, interpreter_env

log = logging.getLogger(__name__)

Process = subprocess.Popen[bytes] | ForkedProcess
"""The writer process, as its starter answers for it (``poll``, ``wait``, ``kill``, ``pid``)."""

Done = Callable[[BaseException | None], None]
"""Called once a hand-over's slab is no longer read (with the process's error if it died)."""


class WriterProcessError(RuntimeError):
    """The writer process ended while a save needed it."""


class WriterProcess:
    """The writer process of one rank's ``Checkpointer``.

    Args:
        spec: what the process builds its writer from.
        memory: the slab memory it maps.
    """

    def __init__(self, spec: WriterSpec, memory: SharedMemory) -> None:
        self.spec = spec
        self.memory = memory
        self.generation = 0
        self.reference = RemoteReference(self)
        self._lock = threading.Lock()
        self._jobs: dict[int, Done] = {}
        self._numbers = itertools.count()
        self._finished: concurrent.futures.Future[tuple[Any, ...]] | None = None
        self._error: WriterProcessError | None = None
        self.save_error: BaseException | None = None  # the save's first failure, sent early
        self._start()
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._conn)

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        fds = (theirs.fileno(), self.memory.fd)
        self._proc = _started(fds)
        theirs.close()
        self._conn = Connection(ours.detach())
        self.generation += 1
        self._error = None
        send(self._conn, self.spec)
        threading.Thread(
            target=self._replies,
            args=(self._conn, self._proc),
            name=f"embckpt-writer-replies-{self._proc.pid}",
            daemon=True,
        ).start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._error is None and self._proc.poll() is None

    def restart(self) -> None:
        """A new process in place of one that died (its reference is gone: not ready)."""
        if self.alive:
            return
        _stop(self._proc, self._conn)
        self._finalizer.detach()
        self._start()
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._conn)
        log.warning("started writer process %d in place of one that ended", self._proc.pid)

    # -- asking ----------------------------------------------------------------------------------
    def send(self, message: tuple[Any, ...]) -> None:
        """Sends ``message``; raises :class:`WriterProcessError` if the process is gone."""
        with self._lock:
            error = self._error
            if error is None:
                try:
                    send(self._conn, message)
                    return
                except OSError as exc:
                    error = self._died(f"could not be reached ({exc})")
        raise error

    def hand_over(self, kind: str, *fields: Any, done: Done) -> None:
        """Sends a ``chunk`` or ``protected`` message; ``done`` is called once its slab is
        free (at once, with the error, if the process is gone)."""
        number = next(self._numbers)
        with self._lock:
            self._jobs[number] = done
        try:
            self.send((kind, number, *fields))
        except WriterProcessError as exc:
            with self._lock:
                callback = self._jobs.pop(number, None)
            if callback is not None:
                callback(exc)

    def finish(self) -> tuple[Any, ...]:
        """Waits until every unit of the save is written; returns the process's answer:
        (entries, phase seconds, captured rows, reference ready, error)."""
        future: concurrent.futures.Future[tuple[Any, ...]] = concurrent.futures.Future()
        with self._lock:
            self._finished = future
            if self._error is not None:
                future.set_exception(self._error)
        if not future.done():
            try:
                self.send(("finish",))
            except WriterProcessError:
                pass  # the future holds the error
        return future.result()

    def failed(self, save_error: bool, text: str) -> BaseException:
        """The error the process reported for a save, as the rank raises it."""
        if save_error:
            return SaveError(text)
        return WriterProcessError(f"the writer process (pid {self.pid}) failed: {text}")

    def arm(self, point: str, *, nth: int = 1, exit_code: int | None = None) -> None:
        """Tests: arms ``point`` in the writer process (its ``nth`` hit raises, or exits the
        process with ``exit_code``)."""
        self.send(("arm", point, nth, exit_code))

    def disarm(self) -> None:
        """Tests: disarms every point of the writer process (if it still runs)."""
        try:
            self.send(("disarm",))
        except WriterProcessError:
            pass

    # -- answers ---------------------------------------------------------------------------------
    def _replies(self, conn: Connection, proc: Process) -> None:
        """The reply thread: slabs freed, saves finished; then, at the end, the process's
        death reported to everything still waiting on it."""
        while True:
            try:
                message = receive(conn)
            except (EOFError, OSError):
                break
            if message[0] == "free":
                with self._lock:
                    callback = self._jobs.pop(message[1], None)
                if callback is not None:
                    callback(None)
            elif message[0] == "error":
                self.save_error = self.failed(*message[1])
            elif message[0] == "finished":
                with self._lock:
                    future, self._finished = self._finished, None
                if future is not None:
                    future.set_result(message[1:])
        if proc is self._proc:
            with self._lock:
                self._died(_ended(proc))

    def _died(self, how: str) -> WriterProcessError:
        """Records the process's end (lock held) and fails whatever waited on it."""
        if self._error is None:
            self._error = WriterProcessError(f"the writer process (pid {self._proc.pid}) {how}")
        jobs, self._jobs = self._jobs, {}
        future, self._finished = self._finished, None
        error = self._error
        threading.Thread(target=_fail, args=(jobs, future, error), daemon=True).start()
        return error

    def close(self) -> None:
        """Asks the process to exit and waits for it (killed if it does not)."""
        self._finalizer()


class RemoteReference:
    """The writer process's reconstructed rows (``save/reference.py``), as the save's
    transaction sees them: ready once a full written by the current process set them."""

    def __init__(self, process: WriterProcess) -> None:
        self._process = process
        self._ready_in: int | None = None  # the process generation whose reference is set

    @property
    def ready(self) -> bool:
        return self._ready_in == self._process.generation and self._process.alive

    def written(self, ready: bool) -> None:
        """A save's units are written; ``ready``: the process's reference is set."""
        self._ready_in = self._process.generation if ready else None

    def begin_full(self) -> None:
        self._ready_in = None  # the process drops it when the full begins

    def clear(self) -> None:
        self._ready_in = None
        self._quietly(("clear",))

    def apply(self, edit: ReferenceEdit) -> None:
        """The save whose edit it is committed: the process applies the edit it kept."""
        self._quietly(("commit",))

    def _quietly(self, message: tuple[Any, ...]) -> None:
        """A message whose loss does not matter: a dead process has no reference."""
        try:
            self._process.send(message)
        except WriterProcessError:
            pass


def _fail(
    jobs: dict[int, Done],
    future: concurrent.futures.Future[tuple[Any, ...]] | None,
    error: WriterProcessError,
) -> None:
    for callback in jobs.values():
        callback(error)
    if future is not None and not future.done():
        future.set_exception(error)


def _started(fds: tuple[int, int]) -> Process:
    """The writer process serving ``fds``: forked by the launcher's writer zygote where there
    is one (``save/writer_zygote.py``), else a fresh interpreter."""
    address = os.environ.get(ZYGOTE_ENV)
    if address:
        try:
            return fork_writer(address, fds)
        except (OSError, EOFError) as exc:
            log.warning("writer zygote %s unavailable (%s): starting an interpreter", address, exc)
    return subprocess.Popen(
        [sys.executable, "-m", "embckpt.save.writer_worker", *map(str, fds)],
        pass_fds=fds,
        env=interpreter_env(),
        stdin=subprocess.DEVNULL,
    )


def _ended(proc: Process) -> str:
    """How the process ended, in words."""
    try:
        code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return "closed its connection"
    if code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _stop(proc: Process, conn: Connection) -> None:
    """Closes the connection (the process exits when it reads its end) and reaps it."""
    try:
        send(conn, ("close",))
    except OSError:
        pass
    conn.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # forked by a zygote that is gone: status unknown
            pass
