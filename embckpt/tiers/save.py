"""After a checkpoint commits on the node-local tier: a manifest copy on every node, the peer
replica, the durable copy every ``durable_every`` checkpoints, retention per tier.

Order (docs/ARCHITECTURE.md, "Tiers"): the save writes each rank's files to its node's folder
and rank 0 commits the manifest in its own (``save/persist.py``, unchanged). Then, on every rank
together (:meth:`TierSaver.committed`):

1. manifest copies: rank 0's manifest bytes go to every node's leader, which writes them into
   its node's step folder: the node's part is now committed there too;
2. replica: each node's leader sends its step folder, manifest last, to the leader of the next
   node (``Nodes.peer``), which writes it under ``replicas/<node>/``, manifest last;
3. durable, every ``durable_every``-th checkpoint: every step of its chain not yet committed
   there is uploaded, oldest first, each file by one rank of a node that holds it (checked
   against the manifest's checksum first); rank 0 writes that step's manifest once every rank
   reported its files written, so a durable checkpoint is never committed incomplete;
4. retention: each node keeps ``local_keep_last`` (and their chains) of its own and replica
   steps; rank 0 applies ``keep_last`` to the durable tier.

The checkpoint is committed before any of this: a failure here is logged and never undoes the
local commit (a copy without its manifest is a leftover, never read, and cleaned at the next
start). The ranks agree after each stage, so they all take the same path.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import pyarrow as pa

from embckpt.collective import Collective
from embckpt.config import CheckpointConfig
from embckpt.errors import RankError
from embckpt.read.restore import RestoreResult
from embckpt.read.target import RestoreTarget
from embckpt.storage.chain import read_manifest
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import MANIFEST_NAME
from embckpt.storage.manifest import Manifest
from embckpt.storage.retention import apply_retention
from embckpt.tiers.local import OWN, NodeTier
from embckpt.tiers.nodes import Nodes
from embckpt.tiers.restore import restore_tiered
from embckpt.tiers.transfer import exchange

log = logging.getLogger(__name__)


class TierSaver:
    """The tier work after each commit (collective: every rank calls :meth:`committed`).

    Args:
        config: ``local_dir``, ``replicas``, ``durable_every``, the retention settings.
        comm: the checkpointer's group.
        nodes: every rank's node.
        local: this node's folder.
        durable: the checkpointer's directory.
        lock: the durable directory's lock (rank 0 holds it); checked before a durable commit.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        comm: Collective,
        nodes: Nodes,
        local: NodeTier,
        durable: CheckpointStore,
        lock: Any,
    ) -> None:
        self.config = config
        self.comm = comm
        self.nodes = nodes
        self.local = local
        self.durable = durable
        self.lock = lock
        self.saved = 0  # checkpoints this job committed: every durable_every-th goes durable

    def committed(self, manifest: Manifest) -> None:
        """Runs stages 1-4 of the module doc for the just-committed ``manifest``; never
        raises (the checkpoint is committed already)."""
        step = manifest.step
        self.saved += 1
        stages = [("copying the manifest to every node", self._copy_manifest)]
        if self.config.replicas and self.nodes.peer(self.nodes.me) is not None:
            stages.append(("sending the replica", self._replicate))
        if self.saved % self.config.durable_every == 0:
            stages.append(("writing the durable copy", self._to_durable))
        stages.append(("retention", self._retain))
        for what, stage in stages:
            error: BaseException | None = None
            try:
                stage(step)
            except Exception as exc:
                error = exc
            try:
                self.comm.check(error, f"step {step}: {what}")
            except Exception as exc:
                log.warning(
                    "step %d is committed on the local tier; %s failed: %s", step, what, exc
                )
                if isinstance(exc, RankError) and error is None and "could not agree" in str(exc):
                    return  # the group itself failed: no later stage can agree either

    def restore(
        self, target: RestoreTarget, step: int | None, *, progress: bool | None = None
    ) -> RestoreResult | None:
        """Restores from the nearest copies (``tiers/restore.py``); collective."""
        return restore_tiered(
            target,
            self.nodes,
            self.local,
            self.durable,
            step,
            partial=self.config.partial_recovery,
            progress=progress,
        )

    def settle_newer(self, step: int, discard: bool) -> None:
        """After restoring ``step``: each node's leader deletes its own and replica checkpoints
        newer than it when ``discard`` (``discard_newer=True``), else warns that saving one of
        those steps again will fail (collective; raises on every rank if a deletion failed)."""
        error: BaseException | None = None
        if self.nodes.is_leader:
            try:
                for label, store in self.local.stores().items():
                    newer = store.committed_after(step)
                    for s in newer if discard else ():
                        store.remove_step(s)
                    if newer and not discard:
                        log.warning(
                            "restored step %d; node %s's %s folder holds newer checkpoints %s: "
                            "saving one of those steps again will fail; restore with "
                            "discard_newer=True to delete them",
                            step,
                            self.nodes.me,
                            label,
                            newer,
                        )
            except Exception as exc:
                error = exc
        self.comm.check(error, f"deleting local checkpoints newer than step {step}")

    # -- 1. manifest copies -----------------------------------------------------------------------
    def _copy_manifest(self, step: int) -> None:
        """Every node gets the manifest and the checkpoint's small side files (the dense file
        and every rank's RNG and statefuls), so that any surviving node can give a restore its
        dense state, RNG and data position (partial recovery needs them from the newest step)."""
        data = self._from_rank0(lambda: self.local.own.read_file(step, MANIFEST_NAME).to_pybytes())
        error: BaseException | None = None
        side: list[tuple[str, bytes]] = []
        try:
            manifest = Manifest.from_json(data.decode(), self.local.own.step_path(step))
            side = [
                (f.path, self.local.own.read_file(step, f.path).to_pybytes())
                for f in manifest.files
                if f.role in ("dense", "rank") and f.rank == self.comm.rank
            ]
        except Exception as exc:
            error = exc
        gathered = self.comm.gather_checked(side, error, f"step {step}: side files")
        if self.nodes.is_leader:
            store = self.local.own
            for files in gathered:
                for path, content in files:
                    if store.fs.get_file_info(store.step_path(step, path)).size != len(content):
                        store.write_atomic(store.step_path(step, path), content)
            if not store.is_committed(step):  # rank 0's node: committed by the save itself
                store.write_atomic(store.step_path(step, MANIFEST_NAME), data)

    # -- 2. replica -----------------------------------------------------------------------------
    def _replicate(self, step: int) -> None:
        """Each node's leader sends its step folder to the next node's leader (``Nodes.peer``),
        manifest last; the receiver writes it under ``replicas/<node>/``, manifest last."""
        nodes, me = self.nodes, self.nodes.me
        outgoing: dict[int, list[tuple[Any, pa.Buffer]]] = {}
        error: BaseException | None = None
        if nodes.is_leader:
            try:
                peer = nodes.peer(me)
                assert peer is not None
                held = self.local.inventory().get((OWN, step), {})
                names = sorted(p for p in held if p != MANIFEST_NAME) + [MANIFEST_NAME]
                outgoing[nodes.leader(peer)] = [
                    ((me, name), self.local.own.read_file(step, name)) for name in names
                ]
            except Exception as exc:  # sends nothing, and fails the stage after the exchange
                error, outgoing = exc, {}
        received = exchange(self.comm, outgoing)
        if error is not None:
            raise error
        for items in received.values():
            for key, data in items:  # the manifest comes last: written last
                node, name = cast(tuple[str, str], key)
                store = self.local.replica(node)
                store.write_atomic(store.step_path(step, name), data)

    # -- 3. durable -----------------------------------------------------------------------------
    def _to_durable(self, step: int) -> None:
        todo = self._from_rank0(
            lambda: [s for s in self._chain(step) if not self.durable.is_committed(s)]
        )
        for s in todo:
            self._upload(s)

    def _from_rank0(self, compute: Any) -> Any:
        """Rank 0's ``compute()``, broadcast; its failure raises on every rank (no rank is
        left waiting in a collective the others skipped)."""
        value, error = None, None
        if self.comm.rank == 0:
            try:
                value = compute()
            except Exception as exc:
                error = f"rank 0: {exc}"
        value, error = self.comm.broadcast((value, error))
        if error is not None:
            raise RuntimeError(error)
        return value

    def _chain(self, step: int) -> list[int]:
        steps, current = [], step
        while True:
            steps.append(current)
            parent = read_manifest(self.local.own, current).parent_step
            if parent is None:
                return steps[::-1]
            current = parent

    def _upload(self, step: int) -> None:
        """One step to the durable tier: each file by one rank of the first node (in
        ``Nodes.names`` order) holding it, checked against its checksum first; then the
        manifest, by rank 0, once every rank reported its files written."""
        error: BaseException | None = None
        held: set[str] = set()
        try:
            manifest = read_manifest(self.local.own, step)
            files = self.local.inventory().get((OWN, step), {})
            held = {f.path for f in manifest.files if files.get(f.path) == f.bytes}
        except Exception as exc:
            error = exc
        holders = self.comm.gather_checked(
            (self.nodes.me, sorted(held)), error, f"step {step}: listing its files"
        )
        first: dict[str, str] = {}
        for node, paths in sorted(holders):
            for path in paths:
                first.setdefault(path, node)
        mine = self.nodes.ranks(self.nodes.me)
        ours = sorted(p for p, node in first.items() if node == self.nodes.me)
        written: list[str] = []
        try:
            by_path = {f.path: f for f in manifest.files}
            for path in ours[mine.index(self.comm.rank) :: len(mine)]:
                data = self.local.own.read_checked(step, by_path[path].written)
                self.durable.write_atomic(self.durable.step_path(step, path), data)
                written.append(path)
        except Exception as exc:
            error = exc
        gathered = self.comm.gather_checked(written, error, f"uploading step {step}")
        done = {path for paths in gathered for path in paths}
        missing = sorted({f.path for f in manifest.files} - done)
        if missing:
            raise RuntimeError(
                f"step {step}: no node holds {len(missing)} of its files (e.g. {missing[0]}): "
                "not committed in the durable tier"
            )
        if self.comm.rank == 0:
            self.lock.check_held()
            data = self.local.own.read_file(step, MANIFEST_NAME)
            self.durable.write_atomic(self.durable.step_path(step, MANIFEST_NAME), data)

    # -- 4. retention ---------------------------------------------------------------------------
    def _retain(self, step: int) -> None:
        if self.nodes.is_leader and self.config.local_keep_last:
            for store in self.local.stores().values():
                apply_retention(store, self.config.local_keep_last)
        if self.comm.rank == 0 and self.config.keep_last:
            apply_retention(self.durable, self.config.keep_last)


def open_tiers(
    config: CheckpointConfig, comm: Collective, durable: CheckpointStore, lock: Any
) -> TierSaver | None:
    """The tiers of a ``Checkpointer`` (collective): None without ``local_dir``; else every
    rank's node, and this node's folder, created and cleaned of interrupted saves by its
    leader.

    Raises:
        RankError: a node's folder could not be opened (on every rank).
    """
    if config.local_dir is None:
        return None
    nodes = Nodes.gather(comm)
    local = NodeTier(config.local_dir, nodes.me, fsync=config.fsync)
    error: BaseException | None = None
    if nodes.is_leader:
        try:
            local.own.create_root()
            local.clean_leftovers()
        except Exception as exc:
            error = exc
    comm.check(error, f"opening the node-local tier {local.root}")
    return TierSaver(config, comm, nodes, local, durable, lock)
