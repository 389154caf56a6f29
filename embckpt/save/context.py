"""What a save works on: the model, its directory and settings, built once by the
``Checkpointer`` and shared by the saver and its persist."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from embckpt import dense
from embckpt.collective import Collective
from embckpt.config import CheckpointConfig
from embckpt.policy import Policy
from embckpt.sharding import ShardedModel
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.lock import DirectoryLock
from embckpt.storage.manifest import TableEntry
from embckpt.storage.signing import SigningKey


@dataclass(frozen=True)
class SaveContext:
    """What the saver works on, built by the ``Checkpointer``."""

    model: nn.Module
    optimizer: Any | None
    statefuls: Mapping[str, dense.Stateful]
    config: CheckpointConfig
    comm: Collective
    store: CheckpointStore
    lock: DirectoryLock
    sharded: ShardedModel
    policy: Policy
    tables: tuple[TableEntry, ...]
    full_fp32_bytes: int
    tiers: Any = None  # a ``tiers.save.TierSaver`` with a node-local tier: runs after each commit
    signing_key: SigningKey | None = None  # signs each manifest (``storage/signing.py``)
