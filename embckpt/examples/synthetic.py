"""A synthetic Criteo-schema click log with skewed ids and a learnable hidden teacher.

Contract: ``make_synthetic_dataset(cfg)`` returns the same ``ClickDataset`` for the same
``cfg.seed``, ``cfg`` shape settings and sample count, on any machine. Per sample it holds
``cfg.num_dense`` dense features and ``cfg.ids_per_feature`` ids for each of the
``len(cfg.cardinalities)`` categorical features (feature-major, see ``ClickDataset``).

* Ids follow a truncated power law over ranks (``P(rank r) ~ (r + 1) ** -zipf_alpha``), mapped to
  row ids through a fixed random permutation per feature, so a few rows get most lookups (as in
  real click logs) but the hot rows are scattered over the table rather than packed at id 0.
* Dense features are non-negative, heavy-tailed integer "counts" (floored log-normals), stored
  ``log1p``-transformed as Criteo pipelines do.
* Labels are Bernoulli draws from a hidden teacher: a random weight per (feature, row) plus a
  linear function of the dense features' latent normals, through a sigmoid whose bias is
  calibrated so the click-through rate is ``_TARGET_CTR``.

The teacher's row weights, id permutations and dense distributions depend only on ``cfg.seed``
and the table shapes, never on the sample count, so datasets of different sizes share them (only
the calibrated bias is fitted to each dataset's own logits).
"""

from __future__ import annotations

import numpy as np

from embckpt import ConfigError
from embckpt.examples.dataset import ClickDataset
from embckpt.examples.workload import WorkloadConfig

__all__ = ["make_synthetic_dataset"]

_TARGET_CTR = 0.25
# Standard deviations of the teacher logit's dense and categorical parts. Together they give a
# logit spread of about 1.8, so the Bayes-optimal AUC is about 0.85 and a DLRM that has learnt
# the hot rows and the dense part clears 0.7 within a few hundred steps.
_DENSE_LOGIT_STD = 1.0
_CATEGORICAL_LOGIT_STD = 1.5

# Stream ids for numpy's SeedSequence: the teacher and the samples draw from separate streams so
# that changing the sample count cannot change the teacher's weights.
_TEACHER_STREAM = 1
_SAMPLE_STREAM = 2


def make_synthetic_dataset(cfg: WorkloadConfig, num_samples: int | None = None) -> ClickDataset:
    """Generates the synthetic click log described in the module docstring.

    Args:
        cfg: the workload; uses ``seed``, ``num_dense``, ``cardinalities``, ``zipf_alpha``,
            ``ids_per_feature`` and ``num_samples``.
        num_samples: samples to generate; ``cfg.num_samples`` if None.

    Returns:
        A dataset whose ``sparse`` is ``[N, num_features * ids_per_feature]``, feature-major.

    Raises:
        ConfigError: a size is not positive or ``zipf_alpha`` is negative.
    """
    n = cfg.num_samples if num_samples is None else num_samples
    k = cfg.ids_per_feature
    if n <= 0 or k <= 0 or cfg.num_dense < 0 or min(cfg.cardinalities, default=0) <= 0:
        raise ConfigError(
            f"synthetic data: num_samples={n}, ids_per_feature={k}, num_dense={cfg.num_dense} "
            f"and every cardinality ({cfg.cardinalities}) must be > 0"
        )
    if cfg.zipf_alpha < 0:
        raise ConfigError(f"synthetic data: zipf_alpha must be >= 0, got {cfg.zipf_alpha}")

    teacher = np.random.default_rng([cfg.seed, _TEACHER_STREAM])
    samples = np.random.default_rng([cfg.seed, _SAMPLE_STREAM])

    dense, logit = _dense_part(cfg.num_dense, n, teacher, samples)
    num_features = len(cfg.cardinalities)
    sparse = np.empty((n, num_features * k), dtype=np.int64)
    row_weight_std = _CATEGORICAL_LOGIT_STD / np.sqrt(num_features)
    # One pass per feature (26 for Criteo), each vectorised over all samples and ids.
    for f, rows in enumerate(cfg.cardinalities):
        rank_to_id = teacher.permutation(rows)
        row_weights = teacher.normal(0.0, row_weight_std, size=rows)
        cdf = np.cumsum((np.arange(rows, dtype=np.float64) + 1.0) ** -cfg.zipf_alpha)
        cdf /= cdf[-1]
        # Inverse-CDF sampling; the clip guards against u landing past cdf[-1] by rounding.
        ranks = np.searchsorted(cdf, samples.random((n, k)), side="right")
        ids = rank_to_id[np.minimum(ranks, rows - 1)]
        sparse[:, f * k : (f + 1) * k] = ids
        logit += row_weights[ids].mean(axis=1)

    probability = _sigmoid(logit + _calibrate_bias(logit, _TARGET_CTR))
    labels = (samples.random(n) < probability).astype(np.float32)
    return ClickDataset(dense=dense, sparse=sparse, labels=labels, ids_per_feature=k)


def _dense_part(
    num_dense: int, n: int, teacher: np.random.Generator, samples: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Returns ``log1p`` dense features ``[n, num_dense]`` and their teacher logit ``[n]``."""
    # Per-feature location and spread, so features differ in scale like Criteo's I1..I13.
    mu = teacher.uniform(0.0, 3.0, size=num_dense)
    sigma = teacher.uniform(0.5, 1.5, size=num_dense)
    weights = teacher.normal(0.0, _DENSE_LOGIT_STD / np.sqrt(max(num_dense, 1)), size=num_dense)
    latent = samples.standard_normal((n, num_dense))
    counts = np.floor(np.exp(mu + sigma * latent))
    # The teacher reads the latent normals, not the counts: the model sees a monotone but lossy
    # (floored) view of them, as a model of real counts would.
    return np.log1p(counts).astype(np.float32), latent @ weights


def _calibrate_bias(logit: np.ndarray, target: float) -> float:
    """Bisects for the bias that makes the mean click probability equal ``target``."""
    low, high = -20.0, 20.0
    # 50 halvings of a width-40 interval reach float64 resolution; each step is one vector pass.
    for _ in range(50):
        mid = 0.5 * (low + high)
        if _sigmoid(logit + mid).mean() < target:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))
