"""Restore from the nearest copies: find every tier's checkpoints, pick the newest step that can
be restored whole from any mix of them, fetch over the process group what this rank's node does
not hold, then run the ordinary restore (``read/restore.py``) over a :class:`TieredReadStore`.

Finding (every rank together): each node's leader lists its folder (own steps and the replicas
it keeps: ``tiers/local.py``) and sends the list and its manifests in one gather; rank 0 adds
the durable tier's committed steps. A file is available where a copy has the manifest's size,
or in the durable tier; a step is whole when every file of every checkpoint of its chain is.
Files are found by node, so a relaunch that numbers a node's ranks differently finds them all
the same. Each copy is read once, checked as the restore reads it; a local copy refused there
is fetched from a peer and the restore run again (``tiers/read_store.py``).

Partial recovery (``partial_recovery``, CPR): when the newest step is not whole (a node and its
replica lost), each block whose files did not all survive is restored from the newest older
step that holds it (local or durable), then the newest step into the other blocks, with its
dense state, RNG streams and statefuls (every node holds those files: ``tiers/save.py`` copies
them). :class:`PartialRecovery` says which blocks came from which step, and how much was lost.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import pyarrow as pa

from embckpt.errors import ChainIncompleteError, CheckpointCorruptError, RankError, RestoreError
from embckpt.read.plan import plan_reads
from embckpt.read.restore import RestoreResult, restore_checkpoint
from embckpt.read.target import RestoreTarget
from embckpt.storage.chain import manifest_from_bytes
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import MANIFEST_NAME
from embckpt.storage.manifest import Manifest, WrittenFile
from embckpt.tiers.local import OWN, NodeTier
from embckpt.tiers.nodes import Nodes
from embckpt.tiers.read_store import TAG, Key, TieredReadStore
from embckpt.tiers.transfer import exchange

log = logging.getLogger(__name__)

Holder = tuple[str, str, int]  # (node, store label, size of its copy)


@dataclass(frozen=True)
class PartialRecovery:
    """What a partial recovery could not restore from the newest step.

    Attributes:
        step: the newest step: dense state, RNG, statefuls and the surviving blocks.
        older_step: the oldest step any lost block came from.
        lost_blocks: (block key, first global row, rows, step it came from) of this rank's
            blocks restored from an older step: the newest older one that holds it.
        lost_rows: rows restored from an older step, over every rank.
        total_rows: rows of every block, over every rank.
        lost_fraction: the lost rows times the training steps each went back
            (``step - its step``), over ``total_rows * step``: CPR's portion of lost samples.
        older_steps: every step some lost block came from, over every rank, oldest first.
    """

    step: int
    older_step: int
    lost_blocks: tuple[tuple[str, int, int, int], ...]
    lost_rows: int
    total_rows: int
    lost_fraction: float
    older_steps: tuple[int, ...] = ()

    @property
    def rows_fraction(self) -> float:
        return self.lost_rows / self.total_rows if self.total_rows else 0.0


@dataclass
class Located:
    """Every tier's checkpoints, as every rank sees them after the gather."""

    held: dict[Key, list[Holder]] = field(default_factory=dict)
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
                    data = durable.read_file(step, MANIFEST_NAME).to_pybytes()
                    found = manifest_from_bytes(durable, step, data)
                    self.manifest_bytes[step] = data
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

    def holders(self, key: Key, size: int) -> list[Holder]:
        """The nodes' copies of ``key`` of the manifest's ``size``."""
        return [h for h in self.held.get(key, []) if h[2] == size]

    def available(self, step: int, path: str, size: int) -> bool:
        return step in self.durable or bool(self.holders((step, path), size))

    def whole(self, step: int, durable: CheckpointStore) -> bool:
        chain = self.chain(step, durable)
        return chain is not None and all(
            self.available(m.step, f.path, f.bytes) for m in chain for f in m.files
        )

    def steps(self) -> list[int]:
        """Every step some tier holds a manifest of, newest first."""
        return sorted(set(self.manifest_bytes) | self.durable, reverse=True)


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
                if path != MANIFEST_NAME:
                    found.held.setdefault((step, path), []).append((node, label, size))
    return found


def _block_reads_available(found: Located, chain: list[Manifest], shard: Any) -> bool:
    """Whether every file ``shard`` needs from ``chain`` is available somewhere."""
    try:
        reads = plan_reads(chain, [shard])
    except Exception:  # tables named the old way (format 1-2): not restorable block by block
        return False
    return all(found.available(r.step, r.entry.path, r.entry.bytes) for r in reads)


def _side_available(found: Located, head: Manifest) -> bool:
    """Whether the newest step's dense state and per-rank files survived somewhere."""
    return all(
        found.available(head.step, f.path, f.bytes)
        for f in head.files
        if f.role in ("dense", "rank")
    )


def choose(
    found: Located,
    durable: CheckpointStore,
    step: int | None,
    partial: bool,
    target: RestoreTarget,
) -> tuple[int | None, dict[str, int]]:
    """The step to restore and, for a partial recovery, the older step each of this rank's
    lost blocks comes from (empty when the step is whole). Collective: a partial recovery
    needs every rank's blocks to be held by some older step.

    Raises:
        ChainIncompleteError: ``step`` was asked for and cannot be restored.
    """
    steps = found.steps()
    if step is not None:
        if found.whole(step, durable):
            return step, {}
        newest: int | None = step
    else:
        whole = next((s for s in steps if found.whole(s, durable)), None)
        newest = next((s for s in steps if found.chain(s, durable) is not None), None)
        if whole is not None and (newest is None or whole >= newest):
            return whole, {}
    sources: dict[str, int] | None = None
    chain = None if newest is None else found.chain(newest, durable)
    if partial and chain is not None and _side_available(found, chain[-1]):
        sources = {}
        older = [(s, found.chain(s, durable)) for s in steps if s < chain[-1].step]
        for shard in target.sharded.shards:
            if _block_reads_available(found, chain, shard):
                continue
            source = next(
                (s for s, c in older if c is not None and _block_reads_available(found, c, shard)),
                None,
            )
            if source is None:
                sources = None
                break
            sources[shard.key] = source
    agreed = target.comm.all_gather(sources is not None)
    if all(agreed) and sources is not None and newest is not None:
        return newest, sources
    if step is not None:
        raise ChainIncompleteError(f"step {step}", "no tier holds every file it needs")
    return next((s for s in steps if found.whole(s, durable)), None), {}


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
    wanted: Mapping[Key, WrittenFile],
    store: TieredReadStore,
) -> None:
    """Gets the files of ``wanted`` that this rank's node holds no usable copy of (none of the
    manifest's size, or refused) from a node that holds one, over the process group, into
    ``store.received`` (collective). Nothing is read here but what is sent: every copy is
    checked when the restore reads it.
    """
    started = time.perf_counter()
    stores = local.stores()
    requests: list[tuple[Key, int]] = []
    for key in sorted(wanted):
        size = wanted[key].bytes
        if key in store.asked or (key not in store.refused_local and store.local.get(key)):
            continue
        holders = [h for h in found.holders(key, size) if h[0] != nodes.me]
        if holders:
            node = sorted(holders, key=lambda h: (h[1] != OWN, h[0]))[0][0]
            requests.append((key, nodes.server(node, nodes.rank)))
    asked = comm.all_gather(requests)
    outgoing: dict[int, list[tuple[Hashable, pa.Buffer]]] = {}
    for rank, theirs in enumerate(asked):
        for key, server in theirs:
            if server != comm.rank:
                continue
            step, path = key
            for node, label, _ in found.held[key]:
                if node != nodes.me or label not in stores:
                    continue
                try:
                    data = stores[label].read_file(step, path)
                except CheckpointCorruptError as exc:  # the asker falls back to the durable copy
                    log.warning("cannot send %s: %s", exc.path, exc.reason)
                    continue
                outgoing.setdefault(rank, []).append((key, data))
                break
    received = exchange(comm, outgoing)
    store.asked.update(k for k, _ in requests)
    nbytes = 0
    for items in received.values():
        for sent, data in items:
            store.received[cast(Key, sent)] = data
            nbytes += data.size
    store.cost.add("peer", nbytes, time.perf_counter() - started)


def _local_copies(
    local: NodeTier, found: Located, nodes: Nodes, sizes: Mapping[Key, int]
) -> dict[Key, list[CheckpointStore]]:
    """This node's copies of each file of the manifest's size: own first, then replicas."""
    stores = local.stores()
    copies: dict[Key, list[CheckpointStore]] = {}
    for key, size in sizes.items():
        labels = sorted(
            (label for node, label, _ in found.holders(key, size) if node == nodes.me),
            key=lambda label: (label != OWN, label),
        )
        if labels:
            copies[key] = [stores[label] for label in labels if label in stores]
    return copies


def _restore_round(
    store: TieredReadStore,
    target: RestoreTarget,
    step: int,
    refetch: Any,
    progress: bool | None,
) -> RestoreResult | None:
    """``restore_checkpoint`` over ``store``; when a local copy is refused and a peer holds
    one, every rank agrees, the copy is fetched and the restore runs again (nothing was
    applied: reads all come before applying). Collective."""
    comm = target.comm
    while True:
        store.wants_peer.clear()
        try:
            return restore_checkpoint(
                dataclasses.replace(target, store=cast(CheckpointStore, store)),
                step,
                progress=progress,
            )
        except Exception as exc:
            # Every failed read through the store says TAG, on its rank and, quoted, on every
            # other: the ranks that see it agree here on a retry. (A rank failing otherwise in
            # the same round, and so not seeing TAG, leaves the others to the group's timeout.)
            if TAG not in str(exc):
                raise
            mine = sorted(store.wants_peer)
            own = None if mine or isinstance(exc, RankError) else exc
            asks = comm.gather_checked(mine, own, f"step {step}: asking for peers' copies")
            if not any(asks):
                raise
            refetch({key: None for key in mine})


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
    chosen, sources = choose(found, durable, step, partial, target)
    if chosen is None:
        return None
    located_s = time.perf_counter() - started
    chain = found.chain(chosen, durable)
    assert chain is not None  # chosen: its chain is known
    older_steps = sorted(
        {s for ranks in comm.all_gather(sorted(set(sources.values()))) for s in ranks}
    )
    rounds: list[tuple[int, RestoreTarget]] = [
        (s, dataclasses.replace(target, blocks=frozenset(k for k, v in sources.items() if v == s)))
        for s in older_steps
    ]
    rounds.append(
        (
            chosen,
            dataclasses.replace(
                target,
                blocks=frozenset(s.key for s in target.sharded.shards if s.key not in sources),
            ),
        )
    )
    wanted: dict[Key, WrittenFile] = {}
    for s, narrowed in rounds:
        older_chain = found.chain(s, durable)
        assert older_chain is not None
        wanted.update(_needed(older_chain, narrowed))
    store = TieredReadStore(
        local=_local_copies(local, found, nodes, {k: w.bytes for k, w in wanted.items()}),
        peer_held={
            k for k, w in wanted.items() if any(h[0] != nodes.me for h in found.holders(k, w.bytes))
        },
        durable=durable,
        durable_steps=found.durable,
        manifests=found.manifest_bytes,
        steps=found.steps(),
        uri=f"tiers({local.root}, {durable.uri})",
    )

    def refetch(keys: Mapping[Key, Any]) -> None:
        fetch_from_peers(
            comm, nodes, local, found, {k: wanted[k] for k in keys if k in wanted}, store
        )

    fetch_from_peers(comm, nodes, local, found, wanted, store)
    fetched_s = time.perf_counter() - started
    result: RestoreResult | None = None
    for s, narrowed in rounds:
        result = _restore_round(store, narrowed, s, refetch, progress)
    if result is None:
        raise RestoreError(f"step {chosen}: found in the tiers but not restored")
    report = _report(target, chosen, sources, older_steps) if older_steps else None
    phases = {**result.phases, "tiers.locate": located_s, "tiers.fetch": fetched_s - located_s}
    return dataclasses.replace(
        result,
        seconds=time.perf_counter() - started,
        phases=phases,
        bytes_by_tier=dict(store.cost.bytes),
        seconds_by_tier=dict(store.cost.seconds),
        refused_copies=tuple(store.cost.refused),
        partial=report,
    )


def _report(
    target: RestoreTarget, step: int, sources: Mapping[str, int], older_steps: list[int]
) -> PartialRecovery:
    """The partial recovery's report, summed over every rank (collective)."""
    lost = tuple(
        (s.key, s.row_offset, s.num_rows, sources[s.key])
        for s in target.sharded.shards
        if s.key in sources
    )
    writers = [s for s in target.sharded.shards if s.writer]
    mine = sum(s.num_rows for s in writers if s.key in sources)
    row_steps = sum(s.num_rows * (step - sources[s.key]) for s in writers if s.key in sources)
    everything = sum(s.num_rows for s in writers)
    lost_rows, lost_row_steps, total_rows = (
        int(x) for x in target.comm.all_sum([mine, row_steps, everything])
    )
    report = PartialRecovery(
        step=step,
        older_step=older_steps[0],
        lost_blocks=lost,
        lost_rows=lost_rows,
        total_rows=total_rows,
        lost_fraction=lost_row_steps / max(total_rows * step, 1),
        older_steps=tuple(older_steps),
    )
    log.warning(
        "partial recovery: step %d, with %d of %d rows (%.1f%%) from older steps %s",
        step,
        lost_rows,
        total_rows,
        100 * report.rows_fraction,
        list(older_steps),
    )
    return report
