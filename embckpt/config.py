"""Frozen settings of the checkpointer, loadable from YAML.

Every knob of embckpt lives in :class:`CheckpointConfig` so that a run is described by one YAML
file (see ``configs/``) and unknown keys fail loudly instead of being ignored. Names of
policies and codecs are checked against their registries (``policy.POLICIES``, the codec
registry), never against lists kept here.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from embckpt.codecs import Codec, make_codec
from embckpt.errors import ConfigError
from embckpt.policy import make_policy

PIPELINES = ("full", "persist", "off")


@dataclass(frozen=True)
class CheckpointConfig:
    """How checkpoints are taken and encoded.

    Attributes:
        policy: ``full`` (every checkpoint full), ``one_shot`` (diffs against the last full) or
            ``incremental`` (diffs against the previous checkpoint).
        full_every: a full checkpoint every this many checkpoints (0: only the first one).
        policy_options: settings of the policy (``intermittent``: ``rule`` = ``cost`` or
            ``checknrun``, ``restore_weight``).
        expected_restores: if set, the bit width of quantizing codecs follows the restores the
            job expects (Check-N-Run: 2 bits for 1, 3 for 3, 4 for 20, 8 beyond), widening once
            more restores happened than planned; overrides ``bits``.
        keep_last: keep the last N committed checkpoints and everything they need; older ones
            are deleted after each commit (0 keeps everything).
        codec: registry id of the row codec (``raw`` is lossless fp32).
        bits: code width of quantizing codecs (2, 3, 4 or 8); None for the codec's default.
        entropy: entropy stage over the codes: ``none``, ``huffman``, ``zstd`` or ``lz4``;
            ``auto`` keeps the codec's own default (the stage measured best for it).
        codec_options: extra settings passed to the codec.
        optimizer_codec: codec of row-wise optimizer state (lossless by default).
        base_codec: codec of full checkpoints when ``codec`` is a delta codec (``exponent``):
            deltas need a base to be deltas against.
        row_group_rows: Parquet row-group size; smaller groups make row-range reads finer.
        max_file_rows: rows per Parquet file; a larger block is split into several files so
            that encoding one file never holds more than this many rows in memory.
        fsync: fsync files and the manifest before a checkpoint counts as committed.
        pipeline: ``full`` (snapshot copy and persist in the background; the next weight
            update waits for the copy), ``persist`` (copy on the training thread, persist in the
            background) or ``off`` (``save`` returns once committed).
        staging_budget_bytes: the most staging buffers may hold; larger checkpoints are staged
            and written in pieces.
        io_threads: threads encoding and writing files in parallel.
        interval: checkpoint interval (iterations) ``maybe_save`` starts with.
        adaptive_interval: re-choose the interval from measured costs at every checkpoint.
        stall_bound: share of training time checkpointing may cost (adaptive interval).
        lock_lease_s: seconds the directory lock lasts unrenewed (renewed every third of it);
            a job gone this long without releasing it is taken over by the next one.
    """

    policy: str = "one_shot"
    full_every: int = 4
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    expected_restores: int | None = None
    keep_last: int = 0
    codec: str = "raw"
    bits: int | None = None
    entropy: str = "auto"
    codec_options: Mapping[str, Any] = field(default_factory=dict)
    optimizer_codec: str = "raw"
    base_codec: str = "raw"
    row_group_rows: int = 65536
    max_file_rows: int = 1 << 20
    fsync: bool = True
    pipeline: str = "full"
    staging_budget_bytes: int = 4 << 30
    io_threads: int = 2
    interval: int = 100
    adaptive_interval: bool = True
    stall_bound: float = 0.02
    lock_lease_s: float = 60.0

    def __post_init__(self) -> None:
        if self.keep_last < 0:
            raise ConfigError(f"keep_last must be >= 0, got {self.keep_last}")
        if self.expected_restores is not None and self.expected_restores < 1:
            raise ConfigError(f"expected_restores must be >= 1, got {self.expected_restores}")
        if isinstance(self.bits, bool):
            raise ConfigError(f"bits must be a code width or None, got {self.bits!r}")
        if self.full_every < 0:
            raise ConfigError(f"full_every must be >= 0, got {self.full_every}")
        if self.pipeline not in PIPELINES:
            raise ConfigError(f"pipeline {self.pipeline!r} is not one of {PIPELINES}")
        if not 0 < self.stall_bound < 1:
            raise ConfigError(f"stall_bound must be in (0, 1), got {self.stall_bound}")
        for name in (
            "row_group_rows",
            "max_file_rows",
            "staging_budget_bytes",
            "io_threads",
            "interval",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        # Names are checked by the registries themselves, so a newly registered policy or
        # codec is accepted and the lists are written once.
        make_policy(self)
        for name in (self.optimizer_codec, self.base_codec):
            make_codec(name)
        if self.expected_restores is None:
            codec_for(self)


_T = TypeVar("_T")


def from_mapping(cls: type[_T], values: Mapping[str, Any], where: str = "config") -> _T:
    """Builds dataclass ``cls`` from a mapping, recursing into nested dataclasses.

    Raises:
        ConfigError: a key is unknown or a value is invalid; the message names ``where``.
    """
    known = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
    kwargs: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        target = known[name].type
        nested = hints.get(name)
        if (
            isinstance(nested, type)
            and dataclasses.is_dataclass(nested)
            and isinstance(value, Mapping)
        ):
            kwargs[name] = from_mapping(nested, value, f"{where}.{name}")
        elif isinstance(value, list) and "tuple" in str(target):
            kwargs[name] = tuple(value)
        else:
            kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def load_yaml(path: str | Path, cls: type[_T]) -> _T:
    """Loads a YAML file into dataclass ``cls``.

    Raises:
        ConfigError: the file is missing, is not a mapping, or holds unknown keys.
    """
    path = Path(path)
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from exc
    if not isinstance(values, Mapping):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return from_mapping(cls, values, str(path))


def codec_for(config: CheckpointConfig) -> Codec:
    """The row codec a checkpoint configuration asks for.

    ``config.codec`` names the codec; ``config.codec_options`` are its keyword options;
    ``config.bits`` and ``config.entropy`` (unless ``"auto"``) are added to them as ``bits`` and
    ``entropy``. ``entropy="auto"`` leaves the codec's own default: the stage measured best for
    it (see each codec's signature and benchmarks/results/codecs.json).

    Raises:
        ConfigError: ``bits`` or ``entropy`` conflict with the same key in ``codec_options``, or
            the codec does not take an option (e.g. ``bits`` for ``raw``) or rejects its value.
        UnknownCodecError: no codec is registered under ``config.codec``.
    """
    options: dict[str, Any] = dict(config.codec_options)
    given = {"bits": config.bits, "entropy": None if config.entropy == "auto" else config.entropy}
    for name, value in given.items():
        if value is None:
            continue
        if name in options and options[name] != value:
            raise ConfigError(
                f"codec {config.codec!r}: {name}={value!r} conflicts with "
                f"codec_options[{name!r}]={options[name]!r}"
            )
        options[name] = value
    return make_codec(config.codec, options)
