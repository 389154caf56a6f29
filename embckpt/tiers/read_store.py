"""A read-only view of one checkpoint directory made of every tier's copies: each file is read
from the nearest copy that passes its checksum, else the next one.

Nearest first: the node's own folder and the replicas it keeps (``local``), then a copy another
node sent over the process group (``peer``, fetched before the restore, ``tiers/restore.py``),
then the durable directory (``durable``). Each copy is read once, and checked as it is read (the
restore's own reads verify size and checksum). A copy that fails is refused, logged and counted,
and the next copy is read; when that next copy is a peer's not fetched yet, the read fails with
:data:`PEER_MARK` and ``tiers/restore.py`` fetches it and runs the restore again (nothing
stays applied: a restore writes no row until every rank read everything, and a rank puts back
the side state it loaded meanwhile). ``read/restore.py`` reads this view as it reads a
``CheckpointStore``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import pyarrow as pa

from embckpt.errors import CheckpointCorruptError
from embckpt.storage.checked import check_whole, open_rows_from
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import MANIFEST_NAME
from embckpt.storage.manifest import FileEntry, WrittenFile
from embckpt.storage.phases import PhaseClock
from embckpt.storage.rowfile_read import CheckedFile

log = logging.getLogger(__name__)

TIERS = ("local", "peer", "durable")
TAG = "[tiers]"  # in every failed read's reason: ``tiers/restore.py`` then agrees on a retry
PEER_MARK = f"{TAG} wants a peer's copy"
_T = TypeVar("_T")
Key = tuple[int, str]  # (step, relative path)


@dataclass
class TierCost:
    """Bytes and busy seconds read per tier, and the copies refused (path: reason)."""

    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIERS, 0.0))
    refused: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, tier: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.bytes[tier] += nbytes
            self.seconds[tier] += seconds


class TieredReadStore:
    """The copies of every tier, read as one directory.

    Args:
        local: per file, this node's stores holding a copy of the manifest's size (own first,
            then replicas).
        peer_held: the files another node holds a copy of.
        durable: the durable directory; read only for ``durable_steps`` (committed there).
        manifests: manifest bytes by step, gathered from every node.
        steps: the steps this view offers to restore.
        uri: names the view in messages.

    Attributes:
        received: files other nodes sent (``tiers/restore.py`` adds them).
        asked: files asked of other nodes so far (sent or not).
        refused_local: files whose local copies failed: the next round skips them.
        wants_peer: files whose local copies failed in this round while a peer holds one not
            asked for yet.
    """

    def __init__(
        self,
        local: Mapping[Key, Sequence[CheckpointStore]],
        peer_held: set[Key],
        durable: CheckpointStore,
        durable_steps: set[int],
        manifests: Mapping[int, bytes],
        steps: Sequence[int],
        uri: str,
    ) -> None:
        self.local = local
        self.is_local = False  # reads may cross the network (a peer, the durable tier)
        self.by_step: dict[int, list[CheckpointStore]] = {}
        for (step, _), stores in local.items():
            known = self.by_step.setdefault(step, [])
            known.extend(s for s in stores if s not in known)
        self.peer_held = peer_held
        self.received: dict[Key, pa.Buffer] = {}
        self.asked: set[Key] = set()
        self.refused_local: set[Key] = set()
        self.wants_peer: set[Key] = set()
        self.durable = durable
        self.durable_steps = durable_steps
        self.manifests = manifests
        self.steps = sorted(steps)
        self.uri = uri
        self.verify_keys = durable.verify_keys  # the keys a reader of this job trusts
        self.cost = TierCost()
        self._lock = threading.Lock()

    # -- what read/restore.py and storage/chain.py ask of a store ---------------------------
    def committed_steps(self) -> list[int]:
        return list(self.steps)

    def is_committed(self, step: int) -> bool:
        return step in self.manifests or step in self.durable_steps

    def step_path(self, step: int, relative: str = "") -> str:
        stores = self.by_step.get(step) or [self.durable]
        return stores[0].step_path(step, relative)

    def check_contained(self, step: int, relatives: Sequence[str], manifest_path: str) -> None:
        for store in self.by_step.get(step, ()):
            store.check_contained(step, relatives, manifest_path)

    def read_file(self, step: int, relative: str) -> pa.Buffer:
        """A manifest (which checks itself), from the gathered copies or the durable tier."""
        if relative == MANIFEST_NAME and step in self.manifests:
            return pa.py_buffer(self.manifests[step])
        return self._first(step, relative, lambda store: store.read_file(step, relative), 0)

    def read_checked(
        self, step: int, expected: WrittenFile, clock: PhaseClock | None = None
    ) -> pa.Buffer:
        def from_memory(data: pa.Buffer) -> pa.Buffer:
            return check_whole(data, expected, f"{self.uri}:{expected.path}", clock)

        return self._first(
            step,
            expected.path,
            lambda store: store.read_checked(step, expected, clock),
            expected.bytes,
            from_memory,
        )

    def open_rows(
        self,
        step: int,
        entry: FileEntry,
        groups: Sequence[int] | None,
        clock: PhaseClock | None = None,
    ) -> CheckedFile:
        def from_memory(data: pa.Buffer) -> CheckedFile:
            path = f"{self.uri}:{entry.path}"
            return open_rows_from(
                entry,
                groups,
                path,
                lambda: check_whole(data, entry.written, path, clock),
                lambda: pa.BufferReader(data),
                clock,
            )

        return self._first(
            step,
            entry.path,
            lambda store: store.open_rows(step, entry, groups, clock),
            _planned_bytes(entry, groups),
            from_memory,
        )

    # -- the walk over copies ---------------------------------------------------------------
    def _first(
        self,
        step: int,
        relative: str,
        read: Callable[[CheckpointStore], _T],
        nbytes: int,
        from_memory: Callable[[pa.Buffer], _T] | None = None,
    ) -> _T:
        """``read`` of the nearest copy that passes its checks.

        Raises:
            CheckpointCorruptError: a local copy failed and a peer's is not fetched yet
                (:data:`PEER_MARK`), or every copy failed (the reason lists each one's).
        """
        key = (step, relative)
        reasons: list[str] = []
        copies: list[tuple[str, Callable[[], _T]]] = []
        if key not in self.refused_local:
            copies += [("local", functools.partial(read, s)) for s in self.local.get(key, ())]
        data = self.received.get(key)
        if data is not None and from_memory is not None:
            copies.append(("peer", lambda: from_memory(data)))
        for tier, attempt in copies:
            started = time.perf_counter()
            try:
                value = attempt()
            except CheckpointCorruptError as exc:
                self._refuse(key, tier, exc)
                reasons.append(f"{tier}: {exc.path}: {exc.reason}")
                continue
            self.cost.add(tier, 0 if tier == "peer" else nbytes, time.perf_counter() - started)
            return value
        where = f"{self.uri} step {step}: {relative}"
        if reasons and key in self.peer_held and key not in self.asked:
            with self._lock:
                self.wants_peer.add(key)
            raise CheckpointCorruptError(where, f"{PEER_MARK}: {'; '.join(reasons)}")
        if step in self.durable_steps:
            started = time.perf_counter()
            try:
                value = read(self.durable)
            except CheckpointCorruptError as exc:
                self._refuse(key, "durable", exc)
                reasons.append(f"durable: {exc.path}: {exc.reason}")
            else:
                self.cost.add("durable", nbytes, time.perf_counter() - started)
                return value
        raise CheckpointCorruptError(
            where, f"{TAG} no good copy: " + ("; ".join(reasons) or "none held")
        )

    def _refuse(self, key: Key, tier: str, exc: CheckpointCorruptError) -> None:
        with self._lock:
            self.cost.refused.append(f"{exc.path}: {exc.reason}")
            if tier == "local":
                self.refused_local.add(key)
        log.warning("refused a %s copy: %s: %s", tier, exc.path, exc.reason)


def _planned_bytes(entry: FileEntry, groups: Sequence[int] | None) -> int:
    """The bytes a read of ``groups`` fetches: the footer and those row groups, or the file."""
    index = entry.partial_index
    if index is None or (groups is None and entry.block is None):
        return entry.bytes
    wanted = range(len(index.row_groups)) if groups is None else groups
    footer = entry.bytes - index.footer_offset
    return footer + sum(index.row_groups[g].length for g in wanted)
