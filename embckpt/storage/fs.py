"""A checkpoint directory on any ``pyarrow.fs`` filesystem: listing, atomic writes, checked reads.

Layout: ``<root>/step_<step:012d>/`` holds one checkpoint; it is committed if and only if its
``MANIFEST.json`` exists. Files are written whole (temporary name, fsync, rename on local disks;
a single PUT on object stores, where an object appears atomically), so a reader never sees half
of a file under its final name; a write failing with a transient error is tried again whole.
A rows file is streamed (``storage/sink.py``): on local disks its bytes go into the temporary
file as the Parquet writer produces them; an object store's PUT sends the file buffered whole.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import os
import random
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.fs as pafs

from embckpt.errors import CheckpointCorruptError
from embckpt.storage import checksum as checksums
from embckpt.storage.checked import check_whole, open_rows_from
from embckpt.storage.layout import MANIFEST_NAME, is_temp, step_dir_name, step_of_dir, temp_name
from embckpt.storage.manifest import FileEntry, WrittenFile
from embckpt.storage.paths import path_problem, real_path_below
from embckpt.storage.phases import PhaseClock, timed
from embckpt.storage.signing import VerifyKeys, digest
from embckpt.storage.sink import ChecksumSink, StreamedFile

if TYPE_CHECKING:
    from embckpt.storage.rowfile_read import CheckedFile

log = logging.getLogger(__name__)

# Failures a retry cannot fix: a missing parent, a refusal, a full or read-only disk, a bad name.
_PERMANENT_TYPES = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    FileExistsError,
)
_PERMANENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.ENAMETOOLONG})
_MAX_BACKOFF_S = 5.0
LOOKS = 16  # manifest lookups in flight at once on an object store (CheckpointStore.step_states)
# Not the global ``random`` stream, whose state a checkpoint saves and a restore puts back; and
# no state to copy: processes forked from one (run_ranks' ranks, DataLoader workers) must not
# all draw the same jitter.
_JITTER = random.SystemRandom()


def is_retryable(exc: BaseException) -> bool:
    """Whether a failed write may succeed if tried again: any ``OSError`` (pyarrow reports an
    object store's 503 Slow Down or a dropped connection as a plain one) except the kinds that
    never will."""
    if not isinstance(exc, OSError) or isinstance(exc, _PERMANENT_TYPES):
        return False
    return exc.errno not in _PERMANENT_ERRNOS


def _unwrap(filesystem: pafs.FileSystem, path: str) -> tuple[pafs.FileSystem, str]:
    """The base filesystem under any ``SubTreeFileSystem`` layers, and ``path`` on it."""
    while isinstance(filesystem, pafs.SubTreeFileSystem):
        path = f"{filesystem.base_path.rstrip('/')}/{path.lstrip('/')}"
        filesystem = filesystem.base_fs
    if isinstance(filesystem, pafs.LocalFileSystem):
        return filesystem, str(Path(path).absolute())
    return filesystem, path.rstrip("/")


class CheckpointStore:
    """The root folder of a job's checkpoints.

    Args:
        uri: a local path or any URI ``pyarrow.fs.FileSystem.from_uri`` understands (``s3://``);
            with ``filesystem``, the root's path inside that filesystem.
        fsync: fsync local files and their folder before a write returns.
        filesystem: a configured filesystem (an ``S3FileSystem`` with its own endpoint, retry
            strategy or credentials, a ``SubTreeFileSystem``...) to use instead of resolving
            ``uri``. A ``SubTreeFileSystem`` is unwrapped to its base, so a local one keeps
            atomic renames; ``uri`` then only names the directory in messages.
        write_retries: times a file write failing with a transient error (:func:`is_retryable`)
            is tried again before the error is raised; 0 disables retries. The default, 4
            retries with ``retry_backoff_s=0.1``, waits 0.1 + 0.2 + 0.4 + 0.8 = 1.5 s at most
            (0.75 s on average with full jitter): enough to ride out an object store's
            throttling bursts (S3 asks clients to back off and retry on 503 Slow Down) without
            holding a save that will fail anyway for long.
        retry_backoff_s: the wait before the first retry; the n-th retry waits a uniformly
            random time up to ``retry_backoff_s * 2**(n-1)`` (full jitter, so writers throttled
            together do not retry together), never more than 5 s.
        digests: files written get a SHA-256 digest too (a signed checkpoint's writer).
        verify_keys: only manifests signed by one of these are read (None: any).

    Raises:
        ValueError: ``filesystem`` is given with a URI instead of a path, or ``write_retries``
            or ``retry_backoff_s`` is negative.
    """

    def __init__(
        self,
        uri: str | Path,
        *,
        fsync: bool = True,
        filesystem: pafs.FileSystem | None = None,
        write_retries: int = 4,
        retry_backoff_s: float = 0.1,
        digests: bool = False,
        verify_keys: VerifyKeys | None = None,
    ) -> None:
        if write_retries < 0 or retry_backoff_s < 0:
            raise ValueError(
                f"write_retries and retry_backoff_s must be >= 0, got {write_retries} and "
                f"{retry_backoff_s}"
            )
        uri = str(uri)
        if filesystem is not None:
            if "://" in uri:
                raise ValueError(
                    f"{uri}: with a filesystem, give the directory's path inside it, not a URI"
                )
            self.fs, self.root = _unwrap(filesystem, uri)
            local = isinstance(self.fs, pafs.LocalFileSystem)
            uri = self.root if local else f"{self.fs.type_name}://{self.root}"
        elif "://" in uri:
            self.fs, self.root = pafs.FileSystem.from_uri(uri)
        else:
            self.fs, self.root = pafs.LocalFileSystem(), str(Path(uri).absolute())
        self.uri = uri
        self.fsync = fsync
        self.write_retries = write_retries
        self.retry_backoff_s = retry_backoff_s
        self.digests = digests
        self.verify_keys = verify_keys
        self.is_local = isinstance(self.fs, pafs.LocalFileSystem)
        self._real_root: str | None = None

    # -- layout ---------------------------------------------------------------------------------
    def step_path(self, step: int, relative: str = "") -> str:
        base = f"{self.root}/{step_dir_name(step)}"
        return f"{base}/{relative}" if relative else base

    def create_root(self) -> None:
        self.fs.create_dir(self.root, recursive=True)

    def _step_folders(self) -> dict[int, str]:
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        except FileNotFoundError:
            return {}
        found = {}
        for info in infos:
            step = step_of_dir(info.base_name)
            if step is not None and info.type == pafs.FileType.Directory:
                found[step] = info.path
        return found

    def step_states(self, at_least: int = 0) -> dict[int, bool]:
        """Each step folder from step ``at_least`` on, ascending, and whether its manifest
        exists: one listing, then one look per folder, at most :data:`LOOKS` at once on an
        object store, where each look is a request (one after another, a job keeping every
        checkpoint, the default, waited for hundreds of them: saves and restores now look up
        only the folders they need, ``at_least``, :meth:`newest_committed`)."""
        steps = sorted(step for step in self._step_folders() if step >= at_least)
        if self.is_local or len(steps) < 2:
            return {step: self.is_committed(step) for step in steps}
        with concurrent.futures.ThreadPoolExecutor(
            min(LOOKS, len(steps)), thread_name_prefix="embckpt-looks"
        ) as pool:
            return dict(zip(steps, pool.map(self.is_committed, steps), strict=True))

    def committed_steps(self) -> list[int]:
        """Steps whose manifest exists, ascending."""
        return [step for step, committed in self.step_states().items() if committed]

    def committed_after(self, step: int) -> list[int]:
        """Committed steps newer than ``step``, ascending (only their folders looked up)."""
        return [s for s, committed in self.step_states(at_least=step + 1).items() if committed]

    def newest_committed(self) -> int | None:
        """The newest step whose manifest exists (None if none): one listing, and one look
        per folder from the newest down to the first committed one."""
        for step in sorted(self._step_folders(), reverse=True):
            if self.is_committed(step):
                return step
        return None

    def file_info(self, step: int, relative: str) -> tuple[int, float]:
        """A file's size and modification time (unix seconds; an object's upload time)."""
        info = self.fs.get_file_info(self._inside(step, relative))
        mtime = info.mtime.timestamp() if info.mtime is not None else float("nan")
        return int(info.size or 0), mtime

    def leftover_steps(self) -> list[int]:
        """Step folders without a manifest: debris of interrupted saves, never checkpoints."""
        return [step for step, committed in self.step_states().items() if not committed]

    def is_committed(self, step: int) -> bool:
        info = self.fs.get_file_info(self.step_path(step, MANIFEST_NAME))
        return info.type == pafs.FileType.File

    def clean_leftovers(self) -> list[int]:
        """Deletes step folders without a manifest (interrupted saves) and temporary files of
        interrupted writes in committed ones. Call only while holding the directory's lock."""
        states = self.step_states()
        leftovers = [step for step, committed in states.items() if not committed]
        for step in leftovers:
            self.remove_step(step)
        if self.is_local:
            for step in (step for step, committed in states.items() if committed):
                for info in self.fs.get_file_info(
                    pafs.FileSelector(self.step_path(step), recursive=True)
                ):
                    if is_temp(info.base_name) and info.type == pafs.FileType.File:
                        self.fs.delete_file(info.path)
        return leftovers

    def remove_step(self, step: int) -> None:
        """Deletes a step folder; the manifest goes first so the folder stops being a checkpoint."""
        manifest = self.step_path(step, MANIFEST_NAME)
        if self.fs.get_file_info(manifest).type == pafs.FileType.File:
            self.fs.delete_file(manifest)
        if self.fs.get_file_info(self.step_path(step)).type == pafs.FileType.Directory:
            self.fs.delete_dir(self.step_path(step))

    # -- writes ---------------------------------------------------------------------------------
    def write_file(
        self,
        step: int,
        relative: str,
        data: pa.Buffer | bytes | StreamedFile,
        checksum: str | None = None,
        *,
        clock: PhaseClock | None = None,
    ) -> WrittenFile:
        """Writes one whole file of a step folder and returns its size and checksum.

        Args:
            data: the bytes, or a :class:`StreamedFile` that produces them into the file,
                checksummed on the way (its ``checksum`` is the one recorded).
            checksum: the file's checksum if the caller already has it (bytes only), so each
                byte is read once; computed here otherwise.
            clock: a save's clock, which gets the ``write`` and ``fsync`` time.

        Raises:
            ValueError: ``relative`` would leave the step folder (e.g. a table named ``a/../..``):
                it is refused here, or it would be written outside and the manifest naming it
                refused by every reader.
        """
        problem = path_problem(relative)
        if problem is not None:
            raise ValueError(f"{self.step_path(step, relative)}: {problem}")
        if isinstance(data, StreamedFile):
            self.write_atomic(self.step_path(step, relative), data, clock=clock)
            return WrittenFile(relative, data.size, data.checksum, data.digest)
        if checksum is None:
            checksum = checksums.checksum(data)
        with timed(clock, "hash"):
            sha = digest(data) if self.digests else ""
        self.write_atomic(self.step_path(step, relative), data, clock=clock)
        return WrittenFile(relative, len(memoryview(data)), checksum, sha)

    def write_atomic(
        self,
        path: str,
        data: pa.Buffer | bytes | StreamedFile,
        *,
        clock: PhaseClock | None = None,
    ) -> None:
        """Writes ``path`` so that it appears whole or not at all, trying the whole write again
        after a transient error (``write_retries``, ``retry_backoff_s``; a :class:`StreamedFile`
        is produced again from its start); ``clock`` gets the ``write`` and ``fsync`` time.

        Raises:
            OSError: the last attempt's error, unchanged; or the first one that a retry cannot
                fix (:func:`is_retryable`).
        """
        write = self._write_local if self.is_local else self._write_object
        for attempt in range(self.write_retries + 1):
            try:
                write(path, data, clock)
                return
            except OSError as exc:
                if attempt == self.write_retries or not is_retryable(exc):
                    raise
                wait = _JITTER.uniform(0, min(self.retry_backoff_s * 2**attempt, _MAX_BACKOFF_S))
                log.warning(
                    "%s: write attempt %d of %d failed (%s); retrying in %.2f s",
                    path,
                    attempt + 1,
                    self.write_retries + 1,
                    exc,
                    wait,
                )
                time.sleep(wait)

    def _write_object(
        self, path: str, data: pa.Buffer | bytes | StreamedFile, clock: PhaseClock | None
    ) -> None:
        # Object stores publish an object only when its upload completes: no rename needed. A
        # streamed file is buffered whole first: a stream failing half-way must publish nothing,
        # and pyarrow's output streams complete the upload when closed, whatever happened.
        if isinstance(data, StreamedFile):
            buffer = pa.BufferOutputStream()
            data.write_to(ChecksumSink(buffer.write, digests=self.digests))
            data = buffer.getvalue()
        with timed(clock, "write"):
            self.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
            with self.fs.open_output_stream(path) as out:
                out.write(data)

    def _write_local(
        self, path: str, data: pa.Buffer | bytes | StreamedFile, clock: PhaseClock | None
    ) -> None:
        """Temporary file, fsync, rename; a failed attempt's temporary file is removed (one a
        crash leaves behind is never read: ``clean_leftovers`` deletes it)."""
        parent = path.rsplit("/", 1)[0]
        os.makedirs(parent, exist_ok=True)
        tmp = temp_name(path)
        try:
            with open(tmp, "wb") as out:
                if isinstance(data, StreamedFile):
                    data.write_to(ChecksumSink(out.write, clock, self.digests))
                else:
                    with timed(clock, "write"):
                        out.write(memoryview(data))
                if self.fsync:
                    with timed(clock, "fsync"):
                        out.flush()
                        os.fsync(out.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        if self.fsync:
            with timed(clock, "fsync"):
                dir_fd = os.open(parent, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)

    # -- reads ----------------------------------------------------------------------------------
    def check_contained(self, step: int, relatives: Iterable[str], manifest_path: str) -> None:
        """Refuses, on local disks, file names that leave the step folder through a symbolic
        link (their spelling is checked when the manifest is parsed): the real path of each
        file must lie under the real path of the step folder. The store's root is resolved once,
        each folder below it once per call (``paths.real_path_below``: one ``lstat`` a name);
        a file itself costs one ``lstat`` unless it is a link.

        Raises:
            CheckpointCorruptError: names the manifest and the entry at fault.
        """
        if not self.is_local:
            return
        if self._real_root is None:  # resolved once: the store's root is the user's choice
            self._real_root = os.path.realpath(self.root)
        folder = real_path_below(self._real_root, step_dir_name(step))
        real_folders: dict[str, str] = {"": folder}
        for relative in relatives:
            parent, _, name = relative.rpartition("/")
            if parent not in real_folders:
                real_folders[parent] = real_path_below(folder, parent)
            real = os.path.join(real_folders[parent], name)
            if os.path.islink(real):
                real = os.path.realpath(real)
            if os.path.commonpath([folder, real]) != folder:
                raise CheckpointCorruptError(
                    manifest_path,
                    f"file entry {relative!r}: a symbolic link leads outside the checkpoint "
                    f"folder (to {real})",
                )

    def read_file(self, step: int, relative: str) -> pa.Buffer:
        """Reads a whole file of a step folder, unchecked (a manifest, which checks itself).

        Raises:
            CheckpointCorruptError: the file is missing or unreadable, or ``relative`` does not
                name a file inside the step folder.
        """
        path = self._inside(step, relative)
        try:
            with self.fs.open_input_file(path) as src:
                return src.read_buffer()
        except OSError as exc:
            raise CheckpointCorruptError(path, f"cannot read: {exc}") from exc

    def read_head(self, step: int, relative: str, length: int) -> bytes:
        """The first ``length`` bytes of a file of a step folder (fewer if it is shorter),
        unchecked: one ranged read, so an object store fetches nothing more.

        Raises:
            CheckpointCorruptError: the file is missing or unreadable.
        """
        path = self._inside(step, relative)
        try:
            with self.fs.open_input_file(path) as src:
                return bytes(src.read_at(min(length, src.size()), 0))
        except OSError as exc:
            raise CheckpointCorruptError(path, f"cannot read: {exc}") from exc

    def read_checked(
        self, step: int, expected: WrittenFile, clock: PhaseClock | None = None
    ) -> pa.Buffer:
        """Reads a whole file and checks its size and checksum against the manifest's record;
        ``clock`` gets the ``fetch`` and ``verify`` time.

        Raises:
            CheckpointCorruptError: missing, truncated, extended or altered; names the file.
        """
        with timed(clock, "fetch"):
            data = self.read_file(step, expected.path)
        return check_whole(data, expected, self.step_path(step, expected.path), clock)

    def open_rows(
        self,
        step: int,
        entry: FileEntry,
        groups: Sequence[int] | None,
        clock: PhaseClock | None = None,
    ) -> CheckedFile:
        """The footer and row groups ``groups`` of a rows file, fetched and each checked
        against the manifest's index, ready to decode.

        Local files are memory-mapped: the bytes are checked and later parsed where the page
        cache holds them, never copied. With ``groups`` None, or for an entry without an index
        of its own file (``FileEntry.partial_index``), the whole file is read and checked;
        except for a block of a packed file (``FileEntry.block``), of which ``groups`` None
        reads the block's own row groups (its index lists them: without one, it is corrupt).

        Args:
            clock: a restore's clock: it gets the ``fetch`` and ``verify`` time.

        Raises:
            CheckpointCorruptError: the file is missing, has another size than the manifest
                says, or a range fetched does not match its checksum; names the file.
        """
        path = self._inside(step, entry.path)

        def source() -> pa.NativeFile:
            with timed(clock, "fetch"):
                try:
                    if self.is_local:
                        return pa.memory_map(path)
                    return self.fs.open_input_file(path)
                except (OSError, pa.ArrowException) as exc:
                    raise CheckpointCorruptError(path, f"cannot read: {exc}") from exc

        return open_rows_from(
            entry,
            groups,
            path,
            lambda: self.read_checked(step, entry.written, clock),
            source,
            clock,
        )

    def _inside(self, step: int, relative: str) -> str:
        """The full path of a file a manifest names, refused if the name leaves the step
        folder (``storage/paths.py``)."""
        path = self.step_path(step, relative)
        problem = path_problem(relative)
        if problem is not None:
            raise CheckpointCorruptError(path, problem)
        return path
