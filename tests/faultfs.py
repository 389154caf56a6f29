"""A fault-injecting ``pyarrow.fs`` filesystem for tests and benchmarks.

Object stores fail in ways a local disk rarely does: a PUT or GET answered with ``503 Slow
Down``, or an upload whose bytes were all sent but whose completion failed. This module wraps
any filesystem (a local one by default) so that chosen calls fail deterministically, which lets
tests check that a failed save leaves no half-written checkpoint and that retries work::

    fs, handler = faulty_filesystem(FaultPlan(fail_writes={1}, fail_at="close"))
    Checkpointer(dmp, "/abs/ckpt", filesystem=fs)

Wrapped in a ``PyFileSystem``, the filesystem is not a ``LocalFileSystem``, so embckpt's
``CheckpointStore`` treats it as an object store (one PUT per file, no rename). To match, a
file written here appears whole under its name only when its stream is closed successfully:
bytes go to a hidden temporary sibling that is renamed on close, and a write failed at close
leaves nothing under its path (a previous object there stays, as on S3).

Fault decisions depend only on the plan and on each call's index among the counted calls (see
:class:`FaultPlan`), so a run with the same plan and the same call order fails the same calls.
"""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import pyarrow as pa
import pyarrow.fs as pafs

__all__ = ["FaultPlan", "FaultyHandler", "LogEntry", "faulty_filesystem", "TMP_MARKER"]

TMP_MARKER = ".faultfs-tmp-"  # in the names of uploads in progress, hidden from listings


def _frozen_ints(values: Iterable[int]) -> frozenset[int]:
    out = frozenset(int(v) for v in values)
    if any(v < 0 for v in out):
        raise ValueError(f"call indices are 0-based and not negative: {sorted(out)}")
    return out


@dataclass(frozen=True)
class FaultPlan:
    """Which calls fail.

    Writes (``open_output_stream``/``open_append_stream``) and reads (``open_input_file``/
    ``open_input_stream``) are numbered separately from 0 in call order, counting only calls
    whose path contains ``write_match``/``read_match`` (all calls when ``None``); numbering
    restarts with :meth:`FaultyHandler.reset`. A counted call fails if its index is listed, or,
    with a probability, if a draw from ``random.Random`` seeded with ``(seed, kind, index)``
    says so: the decision for write #k depends only on ``seed`` and ``k``, not on how reads and
    writes interleave.

    Attributes:
        fail_writes: indices of counted writes that fail.
        fail_reads: indices of counted reads that fail (at open).
        write_match: only writes whose path contains this substring are counted.
        read_match: only reads whose path contains this substring are counted.
        fail_at: ``"open"``: the write raises at open; ``"close"``: the stream accepts every
            byte and raises when closed (a PUT whose completion is refused) and nothing appears.
        write_probability: chance that a counted write fails, besides ``fail_writes``.
        read_probability: chance that a counted read fails, besides ``fail_reads``.
        seed: seeds the random decisions.
    """

    fail_writes: frozenset[int] = field(default_factory=frozenset)
    fail_reads: frozenset[int] = field(default_factory=frozenset)
    write_match: str | None = None
    read_match: str | None = None
    fail_at: Literal["open", "close"] = "open"
    write_probability: float = 0.0
    read_probability: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        # Accept any iterable (a set literal, a range) but store frozensets: plans stay hashable.
        object.__setattr__(self, "fail_writes", _frozen_ints(self.fail_writes))
        object.__setattr__(self, "fail_reads", _frozen_ints(self.fail_reads))
        if self.fail_at not in ("open", "close"):
            raise ValueError(f"fail_at must be 'open' or 'close', not {self.fail_at!r}")
        for name in ("write_probability", "read_probability"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], not {p}")

    @classmethod
    def random(
        cls, seed: int, write_p: float = 0.0, read_p: float = 0.0, **fields: Any
    ) -> FaultPlan:
        """A plan failing counted writes and reads at random, reproducibly for ``seed``."""
        return cls(seed=seed, write_probability=write_p, read_probability=read_p, **fields)

    def decides_fault(self, kind: Literal["write", "read"], index: int) -> bool:
        """Whether counted call ``index`` of ``kind`` fails; a pure function of the plan."""
        listed = self.fail_writes if kind == "write" else self.fail_reads
        if index in listed:
            return True
        p = self.write_probability if kind == "write" else self.read_probability
        if p <= 0.0:
            return False
        # A string seed is hashed with SHA-512 by random.seed: stable across runs and processes.
        return random.Random(f"{self.seed}:{kind}:{index}").random() < p


class LogEntry(NamedTuple):
    """One call seen by the handler; ``injected`` says whether it was chosen to fail."""

    op: str
    path: str
    injected: bool


def _fault(kind: str, index: int, path: str) -> OSError:
    return OSError(f"injected fault: 503 Slow Down ({kind} #{index} of {path})")


class _Upload:
    """The file object behind a write that succeeds: streams to a hidden temporary sibling on
    the base filesystem and renames it to its path on close, so the file appears whole or not
    at all (as an object does when its PUT completes). Not an ``io.IOBase``: those close (and
    here, would publish) when garbage collected; a stream dropped unclosed leaves its hidden
    temporary, as an abandoned multipart upload leaves parts."""

    def __init__(
        self, base: pafs.FileSystem, path: str, metadata: Mapping[str, str] | None, append: bool
    ) -> None:
        self._base = base
        self._path = path
        self._tmp = f"{path}{TMP_MARKER}{uuid.uuid4().hex[:8]}"
        if append and base.get_file_info(path).type == pafs.FileType.File:
            base.copy_file(path, self._tmp)  # the object is replaced whole, as on a store
            self._out = base.open_append_stream(self._tmp, compression=None, metadata=metadata)
        else:
            self._out = base.open_output_stream(self._tmp, compression=None, metadata=metadata)
        self.closed = False

    def write(self, data: Any) -> int:
        return self._out.write(data)

    def tell(self) -> int:
        return self._out.tell()

    def flush(self) -> None:
        self._out.flush()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._out.close()
            self._base.move(self._tmp, self._path)
        except BaseException:
            self._discard()
            raise

    def _discard(self) -> None:
        try:
            self._base.delete_file(self._tmp)
        except OSError:
            pass


class _RefusedUpload:
    """The file object behind a write failed at close: counts the bytes, keeps none of them,
    and raises when closed, so nothing reaches the base filesystem."""

    def __init__(self, error: OSError) -> None:
        self._error = error
        self._size = 0
        self.closed = False

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self._size += n
        return n

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if self.closed:
            return  # the first close reported the failure; pyarrow may close again on exit
        self.closed = True
        raise self._error


class FaultyHandler(pafs.FileSystemHandler):
    """A ``PyFileSystem`` handler delegating to ``base`` and failing the calls ``plan`` picks.

    Counters (since the last :meth:`reset`): ``writes`` and ``reads`` (counted calls, see
    :class:`FaultPlan`), ``write_faults`` and ``read_faults`` (calls chosen to fail; a
    close-time fault is counted when its stream opens), and ``log`` (every call, as
    :class:`LogEntry`). Thread safe: embckpt writes files from several threads.

    A pickled handler (a ``PyFileSystem`` sent to a spawned process) keeps its base and plan
    and starts with fresh counters: each process counts its own calls.
    """

    def __init__(self, plan: FaultPlan | None = None, base: pafs.FileSystem | None = None) -> None:
        self.base: pafs.FileSystem = base if base is not None else pafs.LocalFileSystem()
        self.plan: FaultPlan = plan if plan is not None else FaultPlan()
        self._lock = threading.Lock()
        self.reset()

    def reset(self, plan: FaultPlan | None = None) -> None:
        """Zeroes the counters and the log, so call indices start again from 0; with ``plan``,
        also replaces the plan (``handler.plan = ...`` alone keeps counting)."""
        with self._lock:
            if plan is not None:
                self.plan = plan
            self.writes = 0
            self.reads = 0
            self.write_faults = 0
            self.read_faults = 0
            self.log: list[LogEntry] = []

    def __getstate__(self) -> dict[str, Any]:
        return {"base": self.base, "plan": self.plan}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["plan"], state["base"])  # type: ignore[misc]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FaultyHandler):
            return NotImplemented
        return self.plan == other.plan and self.base.equals(other.base)

    def __hash__(self) -> int:
        return hash((self.plan, self.base.type_name))

    def equals(self, other: object) -> bool:
        """Same plan over an equal base: a pickled copy equals its original."""
        return self == other

    # -- fault decisions --------------------------------------------------------------------
    def _note(self, op: str, path: str) -> None:
        with self._lock:
            self.log.append(LogEntry(op, path, False))

    def _decide(
        self, op: str, kind: Literal["write", "read"], path: str
    ) -> tuple[OSError | None, FaultPlan]:
        """Counts the call if it matches; returns the error to raise if it is to fail, and the
        plan that decided (the plan may be replaced meanwhile by another thread)."""
        with self._lock:
            plan = self.plan
            match = plan.write_match if kind == "write" else plan.read_match
            error = None
            if match is None or match in path:
                if kind == "write":
                    index, self.writes = self.writes, self.writes + 1
                else:
                    index, self.reads = self.reads, self.reads + 1
                if plan.decides_fault(kind, index):
                    error = _fault(kind, index, path)
                    if kind == "write":
                        self.write_faults += 1
                    else:
                        self.read_faults += 1
            self.log.append(LogEntry(op, path, error is not None))
            return error, plan

    def _open_write(
        self, op: str, path: str, metadata: Mapping[str, str] | None, append: bool
    ) -> pa.NativeFile:
        error, plan = self._decide(op, "write", path)
        if error is not None:
            if plan.fail_at == "open":
                raise error
            return pa.PythonFile(_RefusedUpload(error), mode="w")
        return pa.PythonFile(_Upload(self.base, path, metadata or None, append), mode="w")

    def _open_read(self, op: str, path: str) -> None:
        error, _ = self._decide(op, "read", path)
        if error is not None:
            raise error

    # -- FileSystemHandler ------------------------------------------------------------------
    def get_type_name(self) -> str:
        return f"faulty+{self.base.type_name}"

    def normalize_path(self, path: str) -> str:
        return self.base.normalize_path(path)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        for path in paths:
            self._note("get_file_info", path)
        return self.base.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        self._note("list", selector.base_dir)
        infos = self.base.get_file_info(selector)
        # Uploads in progress are invisible on an object store until they complete.
        return [info for info in infos if TMP_MARKER not in info.base_name]

    def create_dir(self, path: str, recursive: bool) -> None:
        self._note("create_dir", path)
        self.base.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self._note("delete_dir", path)
        self.base.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self._note("delete_dir_contents", path)
        self.base.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        self._note("delete_root_dir_contents", "/")
        self.base.delete_dir_contents("/", accept_root_dir=True)

    def delete_file(self, path: str) -> None:
        self._note("delete_file", path)
        self.base.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self._note("move", f"{src} -> {dest}")
        self.base.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self._note("copy_file", f"{src} -> {dest}")
        self.base.copy_file(src, dest)

    def open_input_stream(self, path: str) -> pa.NativeFile:
        self._open_read("open_input_stream", path)
        # PyFileSystem applies any decompression itself: the base must not do it again.
        return self.base.open_input_stream(path, compression=None)

    def open_input_file(self, path: str) -> pa.NativeFile:
        self._open_read("open_input_file", path)
        return self.base.open_input_file(path)

    def open_output_stream(
        self, path: str, metadata: Mapping[str, str] | None = None
    ) -> pa.NativeFile:
        return self._open_write("open_output_stream", path, metadata, append=False)

    def open_append_stream(
        self, path: str, metadata: Mapping[str, str] | None = None
    ) -> pa.NativeFile:
        return self._open_write("open_append_stream", path, metadata, append=True)


def faulty_filesystem(
    plan: FaultPlan | None = None, base: pafs.FileSystem | None = None
) -> tuple[pafs.PyFileSystem, FaultyHandler]:
    """A filesystem failing the calls ``plan`` picks, and its handler (to read its counters or
    change its plan); ``base`` defaults to the local filesystem."""
    handler = FaultyHandler(plan, base)
    return pafs.PyFileSystem(handler), handler
