"""``Follower``: serves the newest committed checkpoint of a directory, for inference.

Each update reads the new checkpoint's files and applies them onto the tables it serves
(``serve/tables.py``); the path to a newer step is the cheapest the served state allows:

* a diff whose parent is the served step: that diff alone;
* a diff of the same chain whose parent is older (a one-shot diff, or a follower that fell
  behind): the tables go back to the chain's full in memory, then the links after the full;
* a step of another chain (a new full, or a follower that started late): the new chain, full
  first.

Everything is fetched and checked (checksums, and signatures with ``verify_key``) before the
first row is written, and applied while no view is open (``serve/view.py``). A failure at any
point leaves the last good step served, reported by a log line and :attr:`Follower.last_error`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import torch

from embckpt import dense
from embckpt.blocks import TableShard
from embckpt.read.stage import default_threads
from embckpt.serve.tables import ServedTables, StagedLink
from embckpt.serve.view import View, ViewLock
from embckpt.storage.chain import load_parts, read_chain
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import MANIFEST_NAME
from embckpt.storage.manifest import Manifest
from embckpt.storage.signing import VerifyKeys, load_verify_keys

__all__ = ["Follower", "Update"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Update:
    """One applied step.

    Attributes:
        step, previous: the step now served, and the one before (None at the first).
        path: the checkpoints read and applied, in order.
        rewound: whether the tables went back to their full first (kept in memory, not read).
        bytes_read: bytes fetched for it (manifests, the parts' indexes, rows and dense files).
        checkpoint_bytes: the bytes of ``step``'s own files, its manifest included.
        committed_unix: when ``step``'s manifest was written (its modification time).
        applied_unix: when the update was visible to new views.
        seconds: from the start of the update to ``applied_unix``.
    """

    step: int
    previous: int | None
    path: tuple[int, ...]
    rewound: bool
    bytes_read: int
    checkpoint_bytes: int
    committed_unix: float
    applied_unix: float
    seconds: float

    @property
    def freshness_s(self) -> float:
        """From the checkpoint's commit to its rows being served."""
        return self.applied_unix - self.committed_unix


class _CountingStore(CheckpointStore):
    """A store that counts the bytes read through it (rows files count through staging)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._count_lock = threading.Lock()
        self.bytes_read = 0

    def count(self, size: int) -> None:
        with self._count_lock:
            self.bytes_read += size

    def read_file(self, step: int, relative: str) -> pa.Buffer:
        data = super().read_file(step, relative)
        self.count(data.size)
        return data

    def read_head(self, step: int, relative: str, length: int) -> bytes:
        data = super().read_head(step, relative, length)
        self.count(len(data))
        return data


@dataclass
class _Served:
    step: int | None = None
    dense: Mapping[str, Any] = field(default_factory=dict)
    chain: list[Manifest] = field(default_factory=list)


class Follower:
    """Follows a checkpoint directory and serves its newest committed step's tables.

    Args:
        directory: the directory a training job writes (local path or ``pyarrow.fs`` URI).
        device: where the served tables live.
        verify_key: a public key (PEM file path, or key object), or several: only checkpoints
            signed by one of them are served (``storage/signing.py``).
        filesystem: a configured ``pyarrow.fs.FileSystem``; ``directory`` is then the path in it.
        threads: reader threads (default as a restore's).
    """

    def __init__(
        self,
        directory: str | Path,
        device: str | torch.device = "cpu",
        verify_key: Any = None,
        *,
        filesystem: pafs.FileSystem | None = None,
        threads: int | None = None,
    ) -> None:
        keys: VerifyKeys | None = load_verify_keys(verify_key)
        self._store = _CountingStore(directory, filesystem=filesystem, verify_keys=keys)
        self._tables = ServedTables(torch.device(device), threads or default_threads())
        self._lock = ViewLock()
        self._served = _Served()
        self._known: dict[int, Manifest] = {}
        self._polling = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: BaseException | None = None
        """The error of the last poll, None when it succeeded."""
        self.last_update: Update | None = None
        self.updates = 0

    @property
    def step(self) -> int | None:
        """The committed step served (None before the first)."""
        return self._served.step

    @property
    def held_rows(self) -> int:
        """Rows held beyond one copy of the tables (the full's values of rows diffs replaced)."""
        return self._tables.held_rows()

    @property
    def view_wait_s(self) -> float:
        """Seconds updates have waited for open views, in all."""
        return self._lock.waited_s

    def poll(self) -> bool:
        """Applies the newest committed checkpoint if it is newer than the one served.

        Returns:
            True if the served step moved. A failure is logged and kept in :attr:`last_error`
            (the last good step stays served), never raised.
        """
        with self._polling:
            try:
                update = self._poll()
            except Exception as exc:  # noqa: BLE001 - reported, and the last good step served
                self.last_error = exc
                log.warning("follower: serving step %s; update failed: %s", self.step, exc)
                return False
            self.last_error = None
            if update is None:
                return False
            self.last_update = update
            self.updates += 1
            log.info(
                "follower: step %d applied (%s), %d bytes read, %.3f s after its commit",
                update.step,
                " -> ".join(map(str, update.path)),
                update.bytes_read,
                update.freshness_s,
            )
            return True

    def view(self) -> View:
        """The served step's tables, pinned until released (use it in a ``with`` block).

        Raises:
            LookupError: no step is served yet.
        """
        self._lock.acquire_read()
        served = self._served
        if served.step is None:
            self._lock.release_read()
            raise LookupError(f"{self._store.uri}: no committed checkpoint served yet")
        return View(served.step, self._tables.tensors, served.dense, self._lock)

    def run(
        self, interval_s: float, on_update: Callable[[Update], Any] | None = None
    ) -> threading.Thread:
        """Polls every ``interval_s`` seconds in a background thread until :meth:`close`;
        ``on_update`` is called (in that thread) after each applied step."""
        if self._thread is not None:
            raise RuntimeError("the follower already runs")

        def loop() -> None:
            while not self._stop.is_set():
                if self.poll() and on_update is not None and self.last_update is not None:
                    on_update(self.last_update)
                self._stop.wait(interval_s)

        self._thread = threading.Thread(target=loop, name="embckpt-follow", daemon=True)
        self._thread.start()
        return self._thread

    def close(self) -> None:
        """Stops :meth:`run`'s thread, if any."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- updates ---------------------------------------------------------------------------
    def _poll(self) -> Update | None:
        target = self._store.newest_committed()
        if target is None or (self.step is not None and target <= self.step):
            return None
        return self._update_to(target)

    def _update_to(self, target: int) -> Update:
        start = time.perf_counter()
        read_before = self._store.bytes_read
        chain = read_chain(self._store, target, _NO_PARTS, self._known)
        served = self._served.chain
        path = _path([m.step for m in served], [m.step for m in chain])
        todo = chain[len(chain) - path.links :]
        shards = self._tables.shards_for(chain[0]) if path.rebase else self._tables.shards
        links: list[StagedLink] = []
        try:
            for manifest in todo:  # every byte fetched and checked before any is applied
                complete = load_parts(self._store, manifest)
                links.append(self._tables.stage(self._store, complete, shards))
            dense_state = self._dense(chain[-1])
            rows_bytes = sum(link.cost.bytes_read for link in links)
            with self._lock.updating():
                self._apply(links, shards, path, served)
                self._served = _Served(target, dense_state, chain)
                applied = time.time()
        finally:
            for link in links:
                link.close()
        self._known = {m.step: m for m in chain}
        size, committed = self._store.file_info(target, MANIFEST_NAME)
        return Update(
            step=target,
            previous=served[-1].step if served else None,
            path=tuple(m.step for m in todo),
            rewound=path.rewind,
            bytes_read=self._store.bytes_read - read_before + rows_bytes,
            checkpoint_bytes=chain[-1].total_bytes + size,
            committed_unix=committed,
            applied_unix=applied,
            seconds=time.perf_counter() - start,
        )

    def _apply(
        self,
        links: list[StagedLink],
        shards: dict[str, TableShard],
        path: _Path,
        served: list[Manifest],
    ) -> None:
        """Applies staged links (under the update lock). A diff that fails leaves the tables
        as they were; a full that fails half-written is undone by reading the served step's
        chain again (if that fails too, nothing is served until an update succeeds)."""
        if not path.rebase:
            self._tables.update(links, path.rewind)
            return
        try:
            self._tables.rebase(shards, links[0])
            self._tables.update(links[1:], rewind=False)
        except BaseException:
            self._recover(served)
            raise

    def _recover(self, served: list[Manifest]) -> None:
        self._served = _Served(self._served.step, self._served.dense, [])
        if not served:
            return
        try:
            shards = self._tables.shards_for(served[0])
            staged = [
                self._tables.stage(self._store, load_parts(self._store, m), shards) for m in served
            ]
            try:
                self._tables.rebase(shards, staged[0])
                self._tables.update(staged[1:], rewind=False)
            finally:
                for link in staged:
                    link.close()
        except Exception as exc:  # noqa: BLE001 - the tables are lost: serve nothing
            log.error("follower: step %s cannot be read again (%s): serving none", self.step, exc)
            self._served = _Served()
            return
        self._served = _Served(served[-1].step, self._served.dense, served)

    def _dense(self, manifest: Manifest) -> dict[str, Any]:
        """The dense state of ``manifest``'s step: the writer's non-table state_dict entries."""
        entry = next((f for f in manifest.files if f.role == "dense"), None)
        if entry is None:
            return {}
        data = self._store.read_checked(manifest.step, entry.written).to_pybytes()
        state = dense.decode_tree(data)["model"]
        device = self._tables.device
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


_NO_PARTS: Callable[[Manifest], Collection[int]] = lambda manifest: ()  # noqa: E731
"""Reading a chain's links, none of their parts: the follower loads the parts of the links
it applies, and only those."""


@dataclass(frozen=True)
class _Path:
    links: int  # the chain's last links to read and apply
    rewind: bool  # back to the full first (in memory)
    rebase: bool  # another chain: its full first


def _path(served: list[int], chain: list[int]) -> _Path:
    """The cheapest way from the served chain to ``chain`` (both full first)."""
    if not served or served[0] != chain[0]:
        return _Path(len(chain), rewind=False, rebase=True)
    if chain[: len(served)] == served:
        return _Path(len(chain) - len(served), rewind=False, rebase=False)
    return _Path(len(chain) - 1, rewind=True, rebase=False)
