"""A resumable, rank-aware sampler: which samples each rank trains on, checkpointable.

Contract:

* ``ResumableSampler`` yields, forever, this rank's sample indices one batch at a time. Epoch ``e``
  is a permutation of ``range(num_samples)`` that depends only on ``(seed, e)``, so any position of
  the stream can be recomputed without replaying history. The permutation is cut into global
  batches of ``batch_size * world_size`` samples (the last incomplete one is dropped) and rank
  ``r`` takes the ``r``-th contiguous slice of ``batch_size`` of each.
* The sampler's state (``state_dict``) is a small dict of JSON-able ints and bools that does not
  depend on the rank; restoring it into a fresh sampler continues the stream exactly, so every
  sample is still seen exactly once per epoch across a checkpoint restore.
* Training pipelines read batches ahead of the model (TorchRec's ``TrainPipelineSparseDist``
  holds two in flight). With ``count_trained=True`` the saved position is the one after the
  last batch reported by ``mark_trained()`` (call it after each ``pipeline.progress()``), not
  after the last batch handed out, so a resume neither skips nor repeats a batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from embckpt.errors import ConfigError

__all__ = ["ResumableSampler"]


# Keys that must match between a saved sampler state and the sampler it is loaded into: a
# different value would silently change which samples an epoch contains.
_FIXED_KEYS = ("num_samples", "batch_size", "world_size", "seed", "shuffle")


class ResumableSampler:
    """An infinite, deterministic, checkpointable stream of this rank's batch indices.

    Call order: construct, optionally ``load_state_dict``, then iterate; ``state_dict`` may be
    taken between any two batches and describes the position after the last batch yielded, or,
    with ``count_trained``, after the last batch ``mark_trained`` reported.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        count_trained: bool = False,
    ) -> None:
        """Creates a sampler positioned at the start of epoch 0.

        Args:
            num_samples: samples in one epoch.
            batch_size: samples per rank per batch.
            rank: this process's rank in ``[0, world_size)``.
            world_size: ranks sharing each global batch.
            seed: seed of the per-epoch permutations.
            shuffle: False yields samples in index order (epochs are then all alike).
            count_trained: save the position of the batches reported by ``mark_trained``
                (for training pipelines that read ahead), not of those handed out.

        Raises:
            ConfigError: a size is not positive, the rank is out of range, or one epoch holds
                no complete global batch.
        """
        if batch_size <= 0 or world_size <= 0 or num_samples <= 0:
            raise ConfigError(
                f"sampler: num_samples={num_samples}, batch_size={batch_size} and "
                f"world_size={world_size} must all be > 0"
            )
        if not 0 <= rank < world_size:
            raise ConfigError(f"sampler: rank {rank} is outside [0, {world_size})")
        if num_samples < batch_size * world_size:
            raise ConfigError(
                f"sampler: num_samples={num_samples} is smaller than one global batch "
                f"({batch_size} x {world_size} ranks)"
            )
        self._num_samples = int(num_samples)
        self._batch_size = int(batch_size)
        self._rank = int(rank)
        self._world_size = int(world_size)
        self._seed = int(seed)
        self._shuffle = bool(shuffle)
        self._epoch = 0
        self._position = 0
        self._perm: np.ndarray | None = None
        self._perm_epoch = -1
        self._count_trained = bool(count_trained)
        self._trained = (0, 0)  # (epoch, position) after the last batch marked trained
        # (epoch, position) after each batch handed out but not yet marked trained
        self._ahead: deque[tuple[int, int]] = deque()

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (before rolling over)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Global batches already yielded in the current epoch."""
        return self._position

    @property
    def batches_per_epoch(self) -> int:
        """Complete global batches per epoch; the remainder of each permutation is dropped."""
        return self._num_samples // (self._batch_size * self._world_size)

    def __iter__(self) -> Iterator[np.ndarray]:
        return self

    def __next__(self) -> np.ndarray:
        if self._position >= self.batches_per_epoch:
            self._epoch += 1
            self._position = 0
        global_batch = self._batch_size * self._world_size
        start = self._position * global_batch + self._rank * self._batch_size
        indices = self._permutation(self._epoch)[start : start + self._batch_size]
        self._position += 1
        if self._count_trained:
            self._ahead.append((self._epoch, self._position))
        return indices.copy()

    @property
    def read_ahead(self) -> int:
        """Batches handed out but not yet reported by :meth:`mark_trained`."""
        return len(self._ahead)

    def mark_trained(self, batches: int = 1) -> None:
        """Reports that the model has trained on the next ``batches`` batches handed out.

        Raises:
            ConfigError: the sampler was built without ``count_trained``, or fewer batches
                were handed out than are reported.
        """
        if not self._count_trained:
            raise ConfigError("sampler: mark_trained() needs ResumableSampler(count_trained=True)")
        if not 0 <= batches <= len(self._ahead):
            raise ConfigError(
                f"sampler: mark_trained({batches}) but only {len(self._ahead)} batch(es) were "
                "handed out and not yet marked"
            )
        for _ in range(batches):
            self._trained = self._ahead.popleft()

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch or self._perm is None:
            if self._shuffle:
                # Seeding from (seed, epoch) rather than advancing one generator makes any epoch
                # reproducible on its own, which is what lets a restore skip replaying history.
                mixed = np.random.SeedSequence([self._seed, epoch]).generate_state(1, np.uint64)
                generator = torch.Generator().manual_seed(int(mixed[0]))
                perm = torch.randperm(self._num_samples, generator=generator).numpy()
            else:
                perm = np.arange(self._num_samples)
            self._perm = perm.astype(np.int64, copy=False)
            self._perm_epoch = epoch
        return self._perm

    def state_dict(self) -> dict[str, Any]:
        """Returns the stream position and the settings it depends on (JSON-able, rank-free)."""
        epoch, position = self._trained if self._count_trained else (self._epoch, self._position)
        return {
            "epoch": epoch,
            "position": position,
            "seed": self._seed,
            "batch_size": self._batch_size,
            "world_size": self._world_size,
            "num_samples": self._num_samples,
            "shuffle": self._shuffle,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues the stream from a saved ``state_dict``.

        Args:
            state: a ``state_dict()`` of a sampler with the same settings (any rank's).

        Raises:
            ConfigError: a key is missing, a setting differs from this sampler's, or the position
                is outside the epoch; the message names the field.
        """
        mine = self.state_dict()
        for key in ("epoch", "position", *_FIXED_KEYS):
            if key not in state:
                raise ConfigError(f"sampler state: missing field {key!r}")
        for key in _FIXED_KEYS:
            if state[key] != mine[key]:
                raise ConfigError(
                    f"sampler state: field {key!r} is {state[key]!r} in the checkpoint but "
                    f"{mine[key]!r} in this sampler"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0:
            raise ConfigError(f"sampler state: field 'epoch' is negative ({epoch})")
        if not 0 <= position <= self.batches_per_epoch:
            raise ConfigError(
                f"sampler state: field 'position' is {position}, outside "
                f"[0, {self.batches_per_epoch}]"
            )
        self._epoch = epoch
        self._position = position
        self._trained = (epoch, position)
        self._ahead.clear()
