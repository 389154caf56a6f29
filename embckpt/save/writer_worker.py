"""The rank's writer process: encodes and writes the rows a copy-on-write save copied.

Why a process: encoding and writing a checkpoint runs Python between its compiled kernels
(codecs, Parquet, checksums, the reference), and any thread of the training process doing
that holds the GIL the training loop needs to launch its steps: a GPU step slowed by a third to
a half while a save was written (issue 38). Here that work has its own interpreter; the
training process only claims and copies rows and sends what lies where in the shared slabs.

Started by ``save/writer_process.py`` as ``python -m embckpt.save.writer_worker SOCKET MEMORY``
(two inherited descriptors: the connection to the rank, the shared slab memory), or forked with
them by the writer zygote (``save/writer_zygote.py``) where the rank's launcher started one.
It reads a :class:`WriterSpec`, warms the codec's kernels, then serves one save at a time:

- ``begin``: a save starts (its step, decision, codec, whether the reference is rebuilt or
  edited, whether the rows are captured);
- ``chunk`` / ``protected``: rows in a slab (by offset) to write, as
  ``save/assemble.py`` assembles them; answered ``free`` once the slab is no longer read (small
  units are copied out and packed together, as the thread writer does); the first error of a
  save is sent at once (``error``), so that the rank stops copying;
- ``finish``: every unit written; answered with the file entries, phase seconds, captured rows,
  whether the reference is set and the first error, if any;
- ``commit``: the last save's reference edit applied; ``clear``: the reference dropped;
- ``arm`` / ``disarm``: failure points of this process (tests); ``close``: exit.

It exits when the rank closes the connection or ends (watched through a pidfd).
"""

from __future__ import annotations

import concurrent.futures
import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from embckpt import failpoints
from embckpt.blocks import TableShard
from embckpt.codecs import Codec, codec_from_config
from embckpt.errors import SaveError
from embckpt.policy import Decision
from embckpt.save.assemble import copied_out, kept_rows, merged_rows, staged_bytes
from embckpt.save.capture import CapturedRows, CaptureEdit
from embckpt.save.reference import ReferenceEdit
from embckpt.save.shared_memory import attach
from embckpt.save.snapshot import StagedUnit, Unit
from embckpt.save.writer import PACKED_FILE_BYTES, RowFileWriter, WriteEdits
from embckpt.storage.manifest import FileEntry
from embckpt.storage.phases import PhaseClock

NICENESS = 10
"""Added to the writer process's niceness: on a host whose cores training keeps busy (CPU
training), the writer yields to it; on a GPU host with idle cores it changes nothing."""


@dataclass(frozen=True)
class WriterSpec:
    """What the writer process is built from (sent once, pickled)."""

    store: Any  # CheckpointStore
    state_codec: dict[str, Any]
    base_codec: dict[str, Any]
    codec: dict[str, Any]  # the save codec when the rank started it: its kernels are warmed
    rank: int
    row_group_rows: int
    threads: int
    pack_below_bytes: int
    memory_bytes: int
    shards: dict[str, TableShard]  # by key, their tensors on the meta device


@dataclass
class _Save:
    """One save being written."""

    step: int
    decision: Decision
    codec: Codec
    edits: WriteEdits
    clock: PhaseClock = field(default_factory=PhaseClock)
    entries: list[FileEntry] = field(default_factory=list)
    tasks: list[concurrent.futures.Future[None]] = field(default_factory=list)
    small: list[StagedUnit] = field(default_factory=list)
    small_bytes: int = 0
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class _SharedSlabs:
    """What the writer's encoded-buffer accounting asks of its staging (``writer.Staging``):
    which addresses are the shared slabs (views the codec did not copy). Nothing is counted
    here: the rank's pool bounds the slabs, and this process holds at most ``threads`` units
    and one pack of small ones besides."""

    def __init__(self, memory: torch.Tensor) -> None:
        self._base = memory.data_ptr()
        self._end = self._base + memory.numel()

    def hold(self, nbytes: int) -> None:
        pass

    def release(self, nbytes: int) -> None:
        pass

    def owns(self, address: int) -> bool:
        return self._base <= address < self._end


class Worker:
    """Serves the rank's saves (see the module's docstring)."""

    def __init__(self, conn: Connection, spec: WriterSpec, memory: torch.Tensor) -> None:
        self.conn = conn
        self.spec = spec
        self.memory = memory
        self.writer = RowFileWriter(
            spec.store,
            state_codec=codec_from_config(spec.state_codec),
            base_codec=codec_from_config(spec.base_codec),
            rank=spec.rank,
            row_group_rows=spec.row_group_rows,
            threads=spec.threads,
            pack_below_bytes=spec.pack_below_bytes,
        )
        self.shards = spec.shards
        self.tasks = concurrent.futures.ThreadPoolExecutor(spec.threads, "embckpt-writer")
        self.save: _Save | None = None
        self.edit: ReferenceEdit | None = None  # the last save's, applied at its commit
        self._send_lock = threading.Lock()
        self._codecs: dict[str, Codec] = {}

    def send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            send(self.conn, message)

    def warm(self) -> None:
        """The save codec's kernels, loaded before the first save asks for them."""
        self.writer.warm(self._codec(self.spec.codec), list(self.shards.values()))
        self.writer.staging = _SharedSlabs(self.memory)

    def _codec(self, config: dict[str, Any]) -> Codec:
        key = repr(sorted(config.items()))
        if key not in self._codecs:
            self._codecs[key] = codec_from_config(config)
        return self._codecs[key]

    # -- messages ------------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            try:
                message = receive(self.conn)
            except (EOFError, OSError):
                return
            kind = message[0]
            if kind == "close":
                return
            getattr(self, f"_on_{kind}")(*message[1:])

    def _on_begin(
        self,
        step: int,
        decision: Decision,
        codec: dict[str, Any],
        edit: bool | None,
        capture: bool,
        rebuild: bool,
    ) -> None:
        """A save starts; ``edit``: None, or whether its reference edit restarts the chain."""
        if rebuild:
            self.writer.reference.begin_full()
        edits = WriteEdits(
            reference=None if edit is None else ReferenceEdit(restarts_chain=edit),
            capture=CaptureEdit() if capture else None,
        )
        self.save = _Save(step, decision, self._codec(codec), edits)

    def _on_chunk(self, job: int, *fields: Any) -> None:
        """``fields``: block key, file part, local rows, tensors described, mask (None: all)."""
        self._task(job, lambda save: self._chunk(save, job, *fields))

    def _on_protected(self, job: int, groups: list[tuple[str, int, list[Any]]]) -> None:
        self._task(job, lambda save: self._protected(save, job, groups))

    def _on_finish(self) -> None:
        save = self.save
        assert save is not None, "finish without begin"
        concurrent.futures.wait(save.tasks)
        if save.error is None and save.small:
            self._guarded(save, lambda: self._write(save, save.small))
        captured = (
            None
            if save.edits.capture is None
            else [_as_arrays(rows) for rows in save.edits.capture.rows]
        )
        self.edit = save.edits.reference
        self.save = None
        self.send(
            (
                "finished",
                save.entries,
                save.clock.seconds(),
                captured,
                self.writer.reference.ready,
                _described(save.error),
            )
        )

    def _on_commit(self) -> None:
        if self.edit is not None:
            self.writer.reference.apply(self.edit)
        self.edit = None

    def _on_clear(self) -> None:
        self.writer.reference.clear()
        self.edit = None

    def _on_arm(self, point: str, nth: int, exit_code: int | None) -> None:
        action = None if exit_code is None else (lambda: os._exit(exit_code))
        failpoints.arm(point, nth=nth, action=action)

    def _on_disarm(self) -> None:
        failpoints.disarm()

    # -- units ---------------------------------------------------------------------------------
    def _task(self, job: int, work: Any) -> None:
        """Runs ``work(save)`` on a writer thread; the slab of ``job`` is freed when it ends,
        unless ``work`` freed it early (it returns True then)."""
        save = self.save
        assert save is not None, "rows without begin"

        def run() -> None:
            freed = [False]

            def guarded() -> None:
                freed[0] = bool(work(save))

            try:
                if save.error is None:
                    self._guarded(save, guarded)
            finally:
                if not freed[0]:
                    self.send(("free", job))

        save.tasks.append(self.tasks.submit(run))

    def _guarded(self, save: _Save, work: Any) -> None:
        try:
            work()
        except BaseException as exc:
            with save.lock:
                first = save.error is None
                save.error = save.error or exc
            if first:  # the rank stops copying at once; the finish still waits for the rest
                self.send(("error", _described(exc)))

    def _view(self, description: Any) -> torch.Tensor:
        """A tensor a message describes: bytes of the shared slabs, or sent by value."""
        if isinstance(description, np.ndarray):
            return torch.from_numpy(description)
        offset, dtype, shape = description
        size = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        return self.memory[offset : offset + size].view(dtype).view(shape)

    def _unit(
        self, key: str, part: int, rows: torch.Tensor, tensors: dict[str, Any], whole: bool
    ) -> StagedUnit:
        shard = self.shards[key]
        return StagedUnit.of(Unit(shard, part, rows, whole), rows, tensors)

    def _chunk(
        self,
        save: _Save,
        job: int,
        key: str,
        part: int,
        rows: np.ndarray,
        described: dict[str, Any],
        mask: np.ndarray | None,
    ) -> bool:
        """Writes a chunk's kept rows; returns True once the slab was freed early (the rows
        were copied out of it: some were dropped, or the unit is small and waits to be
        packed)."""
        tensors = {name: self._view(d) for name, d in described.items()}
        kept = kept_rows(
            torch.from_numpy(rows), tensors, None if mask is None else torch.from_numpy(mask)
        )
        if kept is None:
            return False
        local_rows, tensors, held = kept
        unit = self._unit(key, part, local_rows, tensors, not held)
        small = staged_bytes(unit) < self.spec.pack_below_bytes
        if small and not held:
            unit, held = copied_out(unit)
        if held:  # the unit no longer reads the slab
            self.send(("free", job))
        if small:
            self._pack(save, unit)
        else:
            self._write(save, [unit])
        return bool(held)

    def _protected(self, save: _Save, job: int, groups: list[tuple[str, int, list[Any]]]) -> bool:
        """Merges each block's protected rows (copies), frees the slab, writes them."""
        units = []
        for key, part, segments in groups:
            parts = [
                (torch.from_numpy(rows), {n: self._view(d) for n, d in tensors.items()})
                for rows, tensors in segments
            ]
            local_rows, tensors = merged_rows(parts)
            units.append(self._unit(key, part, local_rows, tensors, False))
        self.send(("free", job))
        for unit in units:
            if staged_bytes(unit) < self.spec.pack_below_bytes:
                self._pack(save, unit)
            else:
                self._write(save, [unit])
        return True

    def _pack(self, save: _Save, unit: StagedUnit) -> None:
        """A small unit joins the next packed file; written once they fill one."""
        with save.lock:
            save.small.append(unit)
            save.small_bytes += staged_bytes(unit)
            if save.small_bytes < PACKED_FILE_BYTES:
                return
            units, save.small, save.small_bytes = save.small, [], 0
        self._write(save, units)

    def _write(self, save: _Save, units: list[StagedUnit]) -> None:
        entries = self.writer.write(
            save.step, units, save.decision, save.codec, save.edits, save.clock
        )
        with save.lock:
            save.entries.extend(entries)


def send(conn: Connection, message: Any) -> None:
    """Sends ``message`` to the other end of the private socket between a rank and the
    process it started (``multiprocessing``'s own serialisation; nothing read from storage is
    ever decoded this way). Messages hold no tensors: tensors lie in the shared memory, and
    values are numpy arrays."""
    conn.send(message)


def receive(conn: Connection) -> Any:
    return conn.recv()


def _as_arrays(rows: CapturedRows) -> tuple[Any, ...]:
    """Captured rows as numpy arrays (sent by value; ``process_sink.py`` rebuilds them)."""
    return (
        rows.key,
        rows.num_rows,
        rows.local_rows.numpy(),
        {k: v.numpy() for k, v in rows.values.items()},
    )


def _described(error: BaseException | None) -> tuple[bool, str] | None:
    """An error as the rank rebuilds it: whether it is a ``SaveError`` (whose message names the
    step, rank and file) and its text, the type named (an exception of any class crosses)."""
    if error is None:
        return None
    if isinstance(error, SaveError):
        return True, str(error)
    return False, f"{type(error).__name__}: {error}"


def _watch_rank(pid: int) -> None:
    """Exits when the rank that asked for this process is gone (its files then unneeded)."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(0)
    except (AttributeError, OSError):  # no pidfd here: looked at every 0.2 s
        while _exists(pid):
            time.sleep(0.2)
        os._exit(0)
    select.select([handle], [], [])  # readable once the rank has ended
    os._exit(0)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def serve(conn_fd: int, memory_fd: int, rank_pid: int) -> None:
    """Serves the rank ``rank_pid`` over the connection ``conn_fd`` with the slab memory
    ``memory_fd``, in a fresh interpreter (``main``) or a child of the writer zygote
    (``save/writer_zygote.py``)."""
    conn = Connection(conn_fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the rank handles Ctrl-C and closes us
    threading.Thread(target=_watch_rank, args=(rank_pid,), daemon=True).start()
    os.nice(NICENESS)
    torch.set_num_threads(1)
    try:
        spec: WriterSpec = receive(conn)
    except EOFError:  # the rank closed the connection before it asked for anything
        return
    _mapping, memory = attach(memory_fd, spec.memory_bytes)
    worker = Worker(conn, spec, memory)
    worker.warm()
    worker.run()


def main(argv: list[str]) -> None:
    serve(int(argv[1]), int(argv[2]), os.getppid())
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
