"""embckpt: differential, compressed checkpoints for TorchRec embedding tables.

Public API::

    ckpt = embckpt.Checkpointer(dmp, "ckpts/", optimizer=dense_opt,
                                config=embckpt.CheckpointConfig(policy="one_shot"))
    step = ckpt.restore()          # None on a fresh directory
    ckpt.save(step).wait()         # every rank, together
"""

from embckpt.checkpointer import Checkpointer, PendingCheckpoint
from embckpt.config import CheckpointConfig, DemoConfig, WorkloadConfig, load_yaml
from embckpt.errors import (
    ChainIncompleteError,
    CheckpointCorruptError,
    ConfigError,
    EmbckptError,
    ModelMismatchError,
    RankError,
    SaveError,
    UnknownCodecError,
)
from embckpt.storage.manifest import Manifest

__all__ = [
    "ChainIncompleteError",
    "CheckpointConfig",
    "CheckpointCorruptError",
    "Checkpointer",
    "ConfigError",
    "DemoConfig",
    "EmbckptError",
    "Manifest",
    "ModelMismatchError",
    "PendingCheckpoint",
    "RankError",
    "SaveError",
    "UnknownCodecError",
    "WorkloadConfig",
    "load_yaml",
]
