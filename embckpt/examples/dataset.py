"""An in-memory click dataset: one epoch of samples as numpy arrays (dense features,
categorical ids already mapped into each table's row range, labels), validated on creation."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embckpt import ConfigError


@dataclass(frozen=True)
class ClickDataset:
    """One epoch of click samples.

    Attributes:
        dense: float32 ``[N, num_dense]`` dense features (already transformed, e.g. ``log1p``).
        sparse: int64 ``[N, num_features * ids_per_feature]`` categorical ids, each already inside
            its table's row range. Per sample the layout is feature-major: columns
            ``f * ids_per_feature ... (f + 1) * ids_per_feature - 1`` are feature ``f``'s ids.
        labels: float32 ``[N]`` click labels in {0, 1}.
        ids_per_feature: ids looked up per feature per sample (the pooling factor).
    """

    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray
    ids_per_feature: int = 1

    def __post_init__(self) -> None:
        expected = {"dense": np.float32, "sparse": np.int64, "labels": np.float32}
        for name, dtype in expected.items():
            value = getattr(self, name)
            if not isinstance(value, np.ndarray) or value.dtype != dtype:
                found = getattr(value, "dtype", type(value).__name__)
                raise ConfigError(
                    f"ClickDataset.{name}: expected a {dtype.__name__} array, got {found}"
                )
        if self.dense.ndim != 2 or self.sparse.ndim != 2 or self.labels.ndim != 1:
            raise ConfigError(
                "ClickDataset: expected dense [N, D], sparse [N, F] and labels [N], got shapes "
                f"{self.dense.shape}, {self.sparse.shape} and {self.labels.shape}"
            )
        n = self.labels.shape[0]
        if self.dense.shape[0] != n or self.sparse.shape[0] != n:
            raise ConfigError(
                f"ClickDataset: sample counts disagree: dense {self.dense.shape[0]}, "
                f"sparse {self.sparse.shape[0]}, labels {n}"
            )
        if self.ids_per_feature < 1 or self.sparse.shape[1] % self.ids_per_feature != 0:
            raise ConfigError(
                f"ClickDataset: sparse has {self.sparse.shape[1]} columns, not a multiple of "
                f"ids_per_feature={self.ids_per_feature}"
            )

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_features(self) -> int:
        """Categorical features per sample (each with ``ids_per_feature`` ids)."""
        return int(self.sparse.shape[1] // self.ids_per_feature)
