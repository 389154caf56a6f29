"""Settings of the example workload (the reference DLRM on Criteo-shaped data) and of a whole
demo or benchmark run, loadable from YAML with :func:`embckpt.load_yaml`, which checks every
value against its field's type (``batch_size: '256'`` is an error naming the field); the
ranges are checked here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from embckpt import CheckpointConfig, ConfigError

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")


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
        for name in ("num_dense", "embedding_dim", "ids_per_feature", "num_samples", "batch_size"):
            _positive(self, name)
        for name in ("learning_rate", "dense_learning_rate"):
            _positive(self, name)
        if not self.cardinalities or min(self.cardinalities) < 1:
            raise ConfigError(f"cardinalities must be >= 1 each, got {self.cardinalities}")
        if not self.dense_arch or not self.over_arch:
            raise ConfigError("dense_arch and over_arch need at least one layer each")
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

    def __post_init__(self) -> None:
        for name in ("steps", "checkpoint_every", "world_size"):
            _positive(self, name)


def _positive(config: object, name: str) -> None:
    value = getattr(config, name)
    if not value > 0:
        raise ConfigError(f"{type(config).__name__}.{name} must be > 0, got {value!r}")
