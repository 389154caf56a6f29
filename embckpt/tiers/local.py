"""A node's local folder: ``<local_dir>/<node>/`` holds the node's own checkpoints (its ranks'
files and a copy of each manifest, in the same ``step_*`` layout as the durable directory) and,
under ``replicas/<peer>/``, the replica of one peer node's files.

A step folder there counts only once its manifest is in it: the node's part of the checkpoint is
then whole. Every other file of the checkpoint is elsewhere (other nodes, the durable tier).
"""

from __future__ import annotations

import pyarrow.fs as pafs

from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import REPLICAS_DIR, node_folder, replica_folder

# (store label, step) -> {relative path: bytes}: what a node holds of its committed steps.
Inventory = dict[tuple[str, int], dict[str, int]]
OWN = "own"  # the label of a node's own store; a replica's is ``replicas/<its node>``


class NodeTier:
    """The local folder of node ``node``.

    Args:
        local_dir: ``CheckpointConfig.local_dir``; the node's folder is ``<local_dir>/<node>``.
        node: the node's id (``tiers/nodes.py``).
        fsync: as the durable store's.
    """

    def __init__(self, local_dir: str, node: str, *, fsync: bool = True) -> None:
        self.root = f"{local_dir.rstrip('/')}/{node_folder(node)}"
        self.node = node
        self.fsync = fsync
        self.own = CheckpointStore(self.root, fsync=fsync)

    def replica(self, node: str) -> CheckpointStore:
        """The store of the replica of peer ``node``'s files kept here."""
        return CheckpointStore(f"{self.root}/{replica_folder(node)}", fsync=self.fsync)

    def replica_nodes(self) -> list[str]:
        """The peers whose replicas this node keeps."""
        selector = pafs.FileSelector(f"{self.root}/{REPLICAS_DIR}", allow_not_found=True)
        infos = self.own.fs.get_file_info(selector)
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)

    def stores(self) -> dict[str, CheckpointStore]:
        """Every store here by label: ``own`` first, then each replica by its node."""
        replicas = {f"{REPLICAS_DIR}/{node}": self.replica(node) for node in self.replica_nodes()}
        return {OWN: self.own, **replicas}

    def clean_leftovers(self) -> None:
        """Drops folders of interrupted saves and replica copies (no manifest)."""
        for store in self.stores().values():
            store.clean_leftovers()

    def inventory(self) -> Inventory:
        """Every file of every committed step here, with its size, by store and step."""
        held: Inventory = {}
        for label, store in self.stores().items():
            for step in store.committed_steps():
                base = store.step_path(step) + "/"
                infos = store.fs.get_file_info(pafs.FileSelector(base, recursive=True))
                held[(label, step)] = {
                    i.path[len(base) :]: i.size for i in infos if i.type == pafs.FileType.File
                }
        return held
