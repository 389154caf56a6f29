"""The error tree of embckpt. Every message names the file, table, shard, rank or step at fault."""

from __future__ import annotations

import importlib
from types import ModuleType


class EmbckptError(Exception):
    """Base of every error embckpt raises on purpose."""


class ConfigError(EmbckptError, ValueError):
    """A setting is unknown or out of range."""


class SaveError(EmbckptError, RuntimeError):
    """A save failed on some rank; every rank raises it, and nothing that a later save or
    restore reads was changed (the previous committed checkpoint is untouched)."""


class RestoreError(EmbckptError, RuntimeError):
    """A restore failed on some rank; every rank raises it (the message names the rank, step
    and file)."""


class CheckpointCorruptError(RestoreError):
    """A checkpoint file is missing, truncated, altered or unreadable."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class ChainIncompleteError(CheckpointCorruptError):
    """A differential checkpoint depends on a checkpoint that is not (or no longer) committed."""


class UntrustedCheckpointError(CheckpointCorruptError):
    """A reader holding verify keys refused a checkpoint: unsigned, signed by a key it does
    not trust, a signature that does not verify, or a file whose SHA-256 digest differs."""


class ModelMismatchError(RestoreError, ValueError):
    """The model being restored does not match the checkpoint (tables, rows, dims, dtypes)."""


class UnknownCodecError(EmbckptError, ValueError):
    """A codec id or codec format version that this version of embckpt cannot read."""


class RankError(EmbckptError, RuntimeError):
    """Ranks failed a collective checkpoint operation; the message says which and why."""


class SaveRankError(SaveError, RankError):
    """Raised on the ranks whose own part of a save went well while another rank's failed."""


class RestoreRankError(RestoreError, RankError):
    """Raised on the ranks whose own part of a restore went well while another rank's failed."""


class DirectoryLockedError(EmbckptError, RuntimeError):
    """Another live job holds the checkpoint directory."""


class LeaseLostError(EmbckptError, RuntimeError):
    """This job's lease on the directory expired or was taken over: it must not commit."""


class CodecError(EmbckptError, ValueError):
    """Rows a codec cannot encode faithfully (NaN, infinity, out of range), or encoded columns
    that do not match what the codec's metadata describes."""


def as_error(kind: type[EmbckptError], error: BaseException, context: str) -> BaseException:
    """``error`` as a ``kind``: as it is if it already is one (it names its file or table),
    else a ``kind`` saying ``context`` (the step and rank at fault), caused by ``error``."""
    if isinstance(error, kind):
        return error
    wrapped = kind(f"{context}: {error}")
    wrapped.__cause__ = error
    return wrapped


class MissingExtraError(EmbckptError, ImportError):
    """An optional part of embckpt needs a package that is not installed."""


def import_extra(module: str, extra: str) -> ModuleType:
    """Imports ``module``, which only the ``embckpt[extra]`` install brings.

    Raises:
        MissingExtraError: ``module`` is missing; the message says which extra installs it.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise MissingExtraError(
            f"{module} is not installed: pip install 'embckpt[{extra}]'"
        ) from exc
