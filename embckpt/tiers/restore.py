"""Restore from the nearest copies: find every tier's checkpoints, pick the newest step that can
be restored whole from any mix of them, fetch over the process group what this rank's node does
not hold, then run the ordinary restore (``read/restore.py``) over a :class:`TieredReadStore`.

Finding (every rank together): each node's leader lists its folder (own steps and the replicas
it keeps: ``tiers/local.py``) and sends the list and its manifests in one gather; rank 0 adds
the durable tier's committed steps. A step is whole when every file of every checkpoint of its
chain is held by some node, or that checkpoint is committed in the durable tier. Files are
found by node, so a relaunch that numbers a node's ranks differently finds them all the same.

Partial recovery (``partial_recovery``, CPR): when the newest step is not whole (a node and its
replica lost), the model is first restored whole from the newest older step that is, then the
newest step is restored into the blocks whose files all survived, with its dense state, RNG
streams and statefuls (every node holds those files: ``tiers/save.py`` copies them). The lost
blocks keep the older step's rows; :class:`PartialRecovery` says which and how much.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import pyarrow as pa

from embckpt.errors import ChainIncompleteError, CheckpointCorruptError, RestoreError
from embckpt.read.plan import plan_reads
from embckpt.read.restore import RestoreResult, restore_checkpoint
from embckpt.read.target import RestoreTarget
from embckpt.storage.chain import read_manifest
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import MANIFEST_NAME
from embckpt.storage.manifest import Manifest, WrittenFile
from embckpt.tiers.local import OWN, NodeTier
from embckpt.tiers.nodes import Nodes
from embckpt.tiers.read_store import TieredReadStore
from embckpt.tiers.transfer import exchange

log = logging.getLogger(__name__)

Key = tuple[int, str]  # (step, relative path)


@dataclass(frozen=True)
class PartialRecovery:
    """What a partial recovery could not restore from the newest step.

    Attributes:
        step: the newest step: dense state, RNG, statefuls and the surviving blocks.
        older_step: the step the lost blocks came from.
        lost_blocks: (block key, first global row, rows) of this rank's blocks restored from
            ``older_step``.
        lost_rows: rows restored from ``older_step``, over every rank.
        total_rows: rows of every block, over every rank.
        lost_fraction: ``lost_rows / total_rows`` times the share of training steps those rows
            went back (``(step - older_step) / step``): CPR's portion of lost samples.
    """

    step: int
    older_step: int
    lost_blocks: tuple[tuple[str, int, int], ...]
    lost_rows: int
    total_rows: int
    lost_fraction: float

    @property
    def rows_fraction(self) -> float:
        return self.lost_rows / self.total_rows if self.total_rows else 0.0


@dataclass
class Located:
    """Every tier's checkpoints, as every rank sees them after the gather."""

    held: dict[Key, list[tuple[str, str]]] = field(default_factory=dict)  # -> (node, store)
    sizes: dict[Key, int] = field(default_factory=dict)
    manifest_bytes: dict[int, bytes] = field(default_factory=dict)
    durable: set[int] = field(default_factory=set)
    parsed: dict[int, Manifest | None] = field(default_factory=dict)

    def manifest(self, step: int, durable: CheckpointStore) -> Manifest | None:
        if step not in self.parsed:
            found: Manifest | None = None
            try:
                if step in self.manifest_bytes:
                    found = Manifest.from_json(self.manifest_bytes[step].decode(), f"step {step}")
                elif step in self.durable:
                    found = read_manifest(durable, step)
                    self.manifest_bytes[step] = durable.read_file(step, MANIFEST_NAME).to_pybytes()
            except (CheckpointCorruptError, UnicodeDecodeError) as exc:
                log.warning("step %d: manifest unreadable: %s", step, exc)
            self.parsed[step] = found
        return self.parsed[step]

    def chain(self, step: int, durable: CheckpointStore) -> list[Manifest] | None:
        chain: list[Manifest] = []
        current: int | None = step
        while current is not None:
            manifest = self.manifest(current, durable)
            if manifest is None or any(m.step == current for m in chain):
                return None
            chain.append(manifest)
            current = manifest.parent_step
        return chain[::-1]

    def available(self, step: int, path: str, size: int) -> bool:
        return step in self.durable or self.sizes.get((step, path)) == size

    def whole(self, step: int, durable: CheckpointStore) -> bool:
        chain = self.chain(step, durable)
        return chain is not None and all(
            self.available(m.step, f.path, f.bytes) for m in chain for f in m.files
        )


def locate(comm: Any, nodes: Nodes, local: NodeTier, durable: CheckpointStore) -> Located:
    """Gathers every node's inventory and the durable tier's steps (collective)."""
    inventory: dict[tuple[str, int], dict[str, int]] = {}
    manifests: dict[int, bytes] = {}
    durable_steps: list[int] = []
    if nodes.is_leader:
        try:
            inventory = local.inventory()
            stores = local.stores()
            for label, step in sorted(inventory, key=lambda k: k[0] != OWN):
                if step not in manifests:
                    manifests[step] = stores[label].read_file(step, MANIFEST_NAME).to_pybytes()
        except Exception as exc:  # a node whose folder cannot be read holds nothing
            log.warning("node %s: cannot list %s: %s", nodes.me, local.root, exc)
            inventory, manifests = {}, {}
    if comm.rank == 0:
        try:
            durable_steps = durable.committed_steps()
        except Exception as exc:
            log.warning("cannot list the durable tier %s: %s", durable.uri, exc)
    found = Located()
    for node, held, their_manifests, steps in comm.all_gather(
        (nodes.me, inventory, manifests, durable_steps)
    ):
        found.durable.update(steps)
        for step, data in their_manifests.items():
            found.manifest_bytes.setdefault(step, data)
        for (label, step), files in held.items():
            for path, size in files.items():
                if path == MANIFEST_NAME:
                    continue
                found.held.setdefault((step, path), []).append((node, label))
                found.sizes[(step, path)] = size
    return found


def choose(
    found: Located, durable: CheckpointStore, step: int | None, partial: bool
) -> tuple[int | None, int | None]:
    """The step to restore and, for a partial recovery, the older step its lost blocks come
    from (None when the step is whole). Same on every rank: the inputs were gathered.

    Raises:
        ChainIncompleteError: ``step`` was asked for and cannot be restored.
    """
    steps = sorted(set(found.manifest_bytes) | found.durable, reverse=True)
    if step is not None:
        if found.whole(step, durable):
            return step, None
        older = next((s for s in steps if s < step and found.whole(s, durable)), None)
        if partial and older is not None and found.chain(step, durable) is not None:
            return step, older
        raise ChainIncompleteError(f"step {step}", "no tier holds every file it needs")
    for position, candidate in enumerate(steps):
        if found.whole(candidate, durable):
            if partial and position > 0:
                newest = next((s for s in steps if found.chain(s, durable) is not None), None)
                if newest is not None and newest > candidate:
                    return newest, candidate
            return candidate, None
    return None, None


def _needed(chain: list[Manifest], target: RestoreTarget) -> dict[Key, WrittenFile]:
    """The files this rank's restore of ``chain`` reads: its planned rows files, the dense file
    and the per-rank files (its own, or all on another world size)."""
    head = chain[-1]
    try:
        keys = {(r.step, r.entry.path) for r in plan_reads(chain, target.row_shards())}
    except Exception:  # tables named the old way (format 1-2): every rows file, to be safe
        keys = {(m.step, f.path) for m in chain for f in m.files if f.role == "rows"}
    other_world = head.world_size != target.comm.world_size
    for f in head.files:
        if f.role == "dense" or (f.role == "rank" and (other_world or f.rank == target.comm.rank)):
            keys.add((head.step, f.path))
    return {(m.step, f.path): f.written for m in chain for f in m.files if (m.step, f.path) in keys}


def fetch_from_peers(
    comm: Any,
    nodes: Nodes,
    local: NodeTier,
    found: Located,
    wanted: dict[Key, WrittenFile],
    threads: int,
) -> tuple[dict[Key, pa.Buffer], int, float]:
    """Gets the files of ``wanted`` of which this rank's node holds no good copy (each local
    copy is checked first) from a node that holds one, over the process group (collective).
    What arrives is checked when the restore reads it.

    Returns:
        The files received, their bytes, and the seconds the exchange took.
    """
    started = time.perf_counter()
    stores = local.stores()

    def good_here(key: Key) -> bool:
        """Whether a copy on this node passes its checks (else a peer's is asked for)."""
        for node, label in found.held.get(key, []):
            if node == nodes.me and label in stores:
                try:
                    stores[label].read_checked(key[0], wanted[key])
                    return True
                except CheckpointCorruptError as exc:
                    log.warning("refused a local copy: %s: %s", exc.path, exc.reason)
        return False

    keys = sorted(wanted)
    with ThreadPoolExecutor(max(1, threads)) as pool:
        here = dict(zip(keys, pool.map(good_here, keys), strict=True))
    requests: list[tuple[Key, int]] = []
    for key in keys:
        holders = [h for h in found.held.get(key, []) if h[0] != nodes.me]
        if here[key] or not holders:
            continue
        node, _ = sorted(holders, key=lambda h: (h[1] != OWN, h[0]))[0]
        requests.append((key, nodes.leader(node)))
    asked = comm.all_gather(requests)
    outgoing: dict[int, list[tuple[Hashable, pa.Buffer]]] = {}
    for rank, theirs in enumerate(asked):
        for key, server in theirs:
            if server != comm.rank:
                continue
            step, path = key
            for node, label in found.held[key]:
                if node != nodes.me or label not in stores:
                    continue
                try:
                    data = stores[label].read_file(step, path)
                except CheckpointCorruptError as exc:  # the asker falls back to the durable copy
                    log.warning("cannot send %s: %s", exc.path, exc.reason)
                    continue
                outgoing.setdefault(rank, []).append((key, data))
                break
    received: dict[Key, pa.Buffer] = {
        cast(Key, key): data for items in exchange(comm, outgoing).values() for key, data in items
    }
    nbytes = int(sum(d.size for d in received.values()))
    return received, nbytes, time.perf_counter() - started


def _local_stores(
    local: NodeTier, found: Located, nodes: Nodes
) -> dict[int, list[CheckpointStore]]:
    stores = local.stores()
    by_step: dict[int, list[CheckpointStore]] = {}
    labels = {
        (step, label)
        for key, hs in found.held.items()
        for node, label in hs
        if node == nodes.me
        for step in (key[0],)
    }
    for step, label in sorted(labels, key=lambda x: (x[0], x[1] != OWN, x[1])):
        if label in stores:
            by_step.setdefault(step, []).append(stores[label])
    return by_step


def restore_tiered(
    target: RestoreTarget,
    nodes: Nodes,
    local: NodeTier,
    durable: CheckpointStore,
    step: int | None,
    *,
    partial: bool,
    progress: bool | None = None,
) -> RestoreResult | None:
    """Restores the newest step whole from any mix of tiers, or partially (module doc);
    collective.

    Raises:
        ChainIncompleteError: ``step`` cannot be restored from any tier.
        others: as ``read/restore.py``.
    """
    started = time.perf_counter()
    comm = target.comm
    found = locate(comm, nodes, local, durable)
    chosen, older = choose(found, durable, step, partial)
    if chosen is None:
        return None
    chain = found.chain(chosen, durable)
    assert chain is not None  # chosen: its chain is known
    kept_shards = list(target.sharded.shards)
    lost: list[tuple[str, int, int]] = []
    wanted: dict[Key, WrittenFile] = {}
    older_chain: list[Manifest] = []
    if older is not None:
        older_chain = found.chain(older, durable) or []
        wanted.update(_needed(older_chain, target))
        kept_shards = []
        for shard in target.sharded.shards:
            reads = plan_reads(chain, [shard])
            if all(found.available(r.step, r.entry.path, r.entry.bytes) for r in reads):
                kept_shards.append(shard)
            else:
                lost.append((shard.key, shard.row_offset, shard.num_rows))
    narrowed = dataclasses.replace(target, blocks=frozenset(s.key for s in kept_shards))
    wanted.update(_needed(chain, narrowed))
    received, peer_bytes, peer_seconds = fetch_from_peers(
        comm, nodes, local, found, wanted, target.threads
    )
    store = TieredReadStore(
        local=_local_stores(local, found, nodes),
        received=received,
        durable=durable,
        durable_steps=found.durable,
        manifests=found.manifest_bytes,
        steps=sorted(set(found.manifest_bytes) | found.durable),
        uri=f"tiers({local.root}, {durable.uri})",
    )
    store.cost.add("peer", peer_bytes, peer_seconds)
    tiered = cast(CheckpointStore, store)  # read as one: it has a store's read methods
    if older is not None:
        restore_checkpoint(dataclasses.replace(target, store=tiered), older, progress=progress)
    result = restore_checkpoint(
        dataclasses.replace(narrowed, store=tiered), chosen, progress=progress
    )
    if result is None:
        raise RestoreError(f"step {chosen}: found in the tiers but not restored")
    report = None
    if older is not None:
        lost_keys = {key for key, _, _ in lost}
        mine = sum(s.num_rows for s in target.sharded.shards if s.writer and s.key in lost_keys)
        everything = sum(s.num_rows for s in target.sharded.shards if s.writer)
        lost_rows, total_rows = (int(x) for x in comm.all_sum([mine, everything]))
        rows_fraction = lost_rows / total_rows if total_rows else 0.0
        report = PartialRecovery(
            step=chosen,
            older_step=older,
            lost_blocks=tuple(lost),
            lost_rows=lost_rows,
            total_rows=total_rows,
            lost_fraction=rows_fraction * (chosen - older) / max(chosen, 1),
        )
        log.warning(
            "partial recovery: step %d, with %d of %d rows (%.1f%%) from step %d",
            chosen,
            lost_rows,
            total_rows,
            100 * rows_fraction,
            older,
        )
    return dataclasses.replace(
        result,
        seconds=time.perf_counter() - started,
        bytes_by_tier=dict(store.cost.bytes),
        seconds_by_tier=dict(store.cost.seconds),
        refused_copies=tuple(store.cost.refused),
        partial=report,
    )
