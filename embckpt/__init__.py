"""embckpt: differential, compressed checkpoints for TorchRec embedding tables.

Public API::

    ckpt = embckpt.Checkpointer(dmp, "ckpts/", optimizer=dense_opt,
                                config=embckpt.CheckpointConfig(policy="one_shot"))
    step = ckpt.restore()          # None on a fresh directory
    ckpt.save(step).wait()         # every rank, together

Names are imported on first use (PEP 562), so ``import embckpt`` and the command line's
``--help`` do not pay for torch and TorchRec until something needs them. ``embckpt.report``
holds the storage-cost reports. Importing checks the installed release set (``versions.py``).
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from embckpt import versions as _versions

_versions.check()  # an unsupported torch / fbgemm-gpu / torchrec set fails here, by name

# name -> module that defines it
_EXPORTS = {
    "Checkpointer": "embckpt.checkpointer",
    "PendingCheckpoint": "embckpt.save.pending",
    "CheckpointConfig": "embckpt.config",
    "load_yaml": "embckpt.config",
    "ResumableSampler": "embckpt.data",
    "ChainIncompleteError": "embckpt.errors",
    "CheckpointCorruptError": "embckpt.errors",
    "ConfigError": "embckpt.errors",
    "DirectoryLockedError": "embckpt.errors",
    "EmbckptError": "embckpt.errors",
    "LeaseLostError": "embckpt.errors",
    "ModelMismatchError": "embckpt.errors",
    "RankError": "embckpt.errors",
    "RestoreError": "embckpt.errors",
    "RestoreRankError": "embckpt.errors",
    "SaveError": "embckpt.errors",
    "SaveRankError": "embckpt.errors",
    "UnknownCodecError": "embckpt.errors",
    "UntrustedCheckpointError": "embckpt.errors",
    "Follower": "embckpt.serve.follower",
    "Update": "embckpt.serve.follower",
    "View": "embckpt.serve.view",
    "generate_key_pair": "embckpt.storage.signing",
    "RestoreResult": "embckpt.read.restore",
    "merge": "embckpt.read.merge",
    "reconstruct": "embckpt.read.export",
    "export_dcp": "embckpt.read.export",
    "export_safetensors": "embckpt.read.export",
    "CheckpointStore": "embckpt.storage.fs",
    "Manifest": "embckpt.storage.manifest",
    "VerifyReport": "embckpt.storage.verify",
    "verify": "embckpt.storage.verify",
    "start_writer_zygote": "embckpt.save.writer_zygote",
}

# Deprecated names -> the module that defines them now. The example workload's settings are no
# part of the library, which does not depend on examples/: ``embckpt.DemoConfig`` still
# resolves, with a DeprecationWarning naming the import to use, and loads examples/ only then.
_MOVED = {
    "DemoConfig": "embckpt.examples.workload",
    "WorkloadConfig": "embckpt.examples.workload",
}

__all__ = [
    "ChainIncompleteError",
    "CheckpointConfig",
    "CheckpointCorruptError",
    "CheckpointStore",
    "Checkpointer",
    "ConfigError",
    "DirectoryLockedError",
    "EmbckptError",
    "Follower",
    "LeaseLostError",
    "Manifest",
    "ModelMismatchError",
    "PendingCheckpoint",
    "RankError",
    "RestoreError",
    "RestoreRankError",
    "RestoreResult",
    "ResumableSampler",
    "SaveError",
    "SaveRankError",
    "UnknownCodecError",
    "UntrustedCheckpointError",
    "Update",
    "VerifyReport",
    "View",
    "export_dcp",
    "export_safetensors",
    "generate_key_pair",
    "load_yaml",
    "merge",
    "reconstruct",
    "start_writer_zygote",
    "verify",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None and name in _MOVED:
        warnings.warn(
            f"embckpt.{name} is deprecated and will be removed: "
            f"use `from {_MOVED[name]} import {name}`",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(_MOVED[name]), name)
    if module is None:
        raise AttributeError(f"module 'embckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:
    from embckpt.checkpointer import Checkpointer
    from embckpt.config import CheckpointConfig, load_yaml
    from embckpt.data import ResumableSampler
    from embckpt.errors import (
        ChainIncompleteError,
        CheckpointCorruptError,
        ConfigError,
        DirectoryLockedError,
        EmbckptError,
        LeaseLostError,
        ModelMismatchError,
        RankError,
        RestoreError,
        RestoreRankError,
        SaveError,
        SaveRankError,
        UnknownCodecError,
    )
    from embckpt.read.export import export_dcp, export_safetensors, reconstruct
    from embckpt.read.merge import merge
    from embckpt.read.restore import RestoreResult
    from embckpt.save.pending import PendingCheckpoint
    from embckpt.save.writer_zygote import start_writer_zygote
    from embckpt.storage.fs import CheckpointStore
    from embckpt.storage.manifest import Manifest
    from embckpt.storage.verify import VerifyReport, verify
