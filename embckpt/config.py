"""Frozen settings for the checkpointer and the reference workload, loadable from YAML.

Every knob of embckpt lives in one of these dataclasses so that a run is described by one
YAML file (see ``configs/``) and unknown keys fail loudly instead of being ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from embckpt.errors import ConfigError

POLICIES = ("full", "one_shot", "incremental", "intermittent")
PIPELINES = ("full", "persist", "off")
ENTROPY_STAGES = ("auto", "none", "huffman", "zstd", "lz4")
CODE_BITS = (2, 3, 4, 8)
SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")


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

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"policy {self.policy!r} is not one of {POLICIES}")
        if self.keep_last < 0:
            raise ConfigError(f"keep_last must be >= 0, got {self.keep_last}")
        if self.expected_restores is not None and self.expected_restores < 1:
            raise ConfigError(f"expected_restores must be >= 1, got {self.expected_restores}")
        if self.entropy not in ENTROPY_STAGES:
            raise ConfigError(f"entropy {self.entropy!r} is not one of {ENTROPY_STAGES}")
        if self.bits is not None and (isinstance(self.bits, bool) or self.bits not in CODE_BITS):
            raise ConfigError(f"bits must be one of {CODE_BITS} or None, got {self.bits!r}")
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


@dataclass(frozen=True)
class WorkloadConfig:
    """The reference DLRM workload: Criteo schema, synthetic or real data, sharding plan.

    Attributes:
        num_dense: dense features per sample (Criteo: 13).
        cardinalities: rows of each categorical feature's table (Criteo: 26 features).
        embedding_dim: columns of every table.
        zipf_alpha: skew of the synthetic ids (larger: a few rows get most lookups).
        ids_per_feature: ids looked up per feature per sample (pooling factor).
        num_samples: size of the synthetic dataset (one epoch).
        batch_size: samples per rank per step.
        dense_arch: hidden sizes of DLRM's bottom MLP (its last size must equal embedding_dim).
        over_arch: hidden sizes of DLRM's top MLP (must end in 1).
        learning_rate: fused embedding optimizer learning rate.
        dense_learning_rate: dense optimizer (Adagrad) learning rate.
        embedding_optimizer: fused optimizer: exact_rowwise_adagrad, exact_adagrad or exact_sgd.
        sharding: table name -> sharding type (``table_wise`` may name a rank as
            ``table_wise:1``); tables not named are spread table-wise round-robin.
        seed: seed of data generation, the teacher and the model's initialisation.
        data_path: Criteo TSV file or folder; None means the synthetic generator.
    """

    num_dense: int = 13
    cardinalities: tuple[int, ...] = (
        2000, 500, 4000, 3000, 300, 24, 1200, 600, 3, 2500,
        3500, 4000, 3000, 27, 2000, 4000, 10, 1500, 900, 4,
        4000, 15, 15, 3000, 100, 2500,
    )  # fmt: skip
    embedding_dim: int = 16
    zipf_alpha: float = 1.1
    ids_per_feature: int = 1
    num_samples: int = 65536
    batch_size: int = 256
    dense_arch: tuple[int, ...] = (64, 16)
    over_arch: tuple[int, ...] = (64, 32, 1)
    learning_rate: float = 0.05
    dense_learning_rate: float = 0.05
    embedding_optimizer: str = "exact_rowwise_adagrad"
    sharding: Mapping[str, str] = field(default_factory=dict)
    seed: int = 0
    data_path: str | None = None

    def __post_init__(self) -> None:
        if self.dense_arch[-1] != self.embedding_dim:
            raise ConfigError(
                f"dense_arch must end in embedding_dim={self.embedding_dim}, got {self.dense_arch}"
            )
        if self.over_arch[-1] != 1:
            raise ConfigError(f"over_arch must end in 1, got {self.over_arch}")
        for table, kind in self.sharding.items():
            if kind.split(":")[0] not in SHARDING_TYPES:
                raise ConfigError(
                    f"table {table}: sharding {kind!r} is not one of {SHARDING_TYPES}"
                )

    @property
    def table_names(self) -> list[str]:
        return [f"t_cat_{i}" for i in range(len(self.cardinalities))]

    @property
    def feature_names(self) -> list[str]:
        return [f"cat_{i}" for i in range(len(self.cardinalities))]


@dataclass(frozen=True)
class DemoConfig:
    """A whole demo or benchmark run: the workload, the checkpointer, and the schedule."""

    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    steps: int = 60
    checkpoint_every: int = 10
    world_size: int = 2


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
    for name, value in values.items():
        target = known[name].type
        nested = _NESTED.get(name)
        if nested is not None and isinstance(value, Mapping):
            kwargs[name] = from_mapping(nested, value, f"{where}.{name}")
        elif isinstance(value, list) and "tuple" in str(target):
            kwargs[name] = tuple(value)
        else:
            kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


_NESTED: dict[str, type] = {"workload": WorkloadConfig, "checkpoint": CheckpointConfig}


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
