"""What a restore loads into (shared by the restore and its side-state part)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from embckpt import dense
from embckpt.collective import Collective
from embckpt.sharding import ShardedModel
from embckpt.storage.fs import CheckpointStore


@dataclass(frozen=True)
class RestoreTarget:
    """What a restore loads into: the live model and its optimizers, this rank's blocks, the
    stateful objects, the ranks to agree with, and the directory to read from."""

    model: Any
    optimizer: Any | None
    sharded: ShardedModel
    statefuls: Mapping[str, dense.Stateful]
    comm: Collective
    store: CheckpointStore
    # Reader threads of this rank; None: chosen per restore from every rank's planned bytes
    # (``cores.balanced_restore_threads``).
    threads: int | None
    # Only these blocks (``TableShard.key``) get rows; None: all. A partial recovery
    # (``tiers/restore.py``) leaves the lost blocks as an older step restored them.
    blocks: frozenset[str] | None = None

    def row_shards(self) -> list[Any]:
        """This rank's blocks whose rows the restore loads."""
        return [s for s in self.sharded.shards if self.blocks is None or s.key in self.blocks]
