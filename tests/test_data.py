"""Tests of embckpt.data: dataset validation and the resumable sampler's stream."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from embckpt.data import ResumableSampler
from embckpt.errors import ConfigError
from embckpt.examples.dataset import ClickDataset


def _take(sampler: ResumableSampler, batches: int) -> list[np.ndarray]:
    return list(itertools.islice(sampler, batches))


def _dataset(n: int = 4, features: int = 3, ids_per_feature: int = 1) -> ClickDataset:
    return ClickDataset(
        dense=np.zeros((n, 2), np.float32),
        sparse=np.zeros((n, features * ids_per_feature), np.int64),
        labels=np.zeros(n, np.float32),
        ids_per_feature=ids_per_feature,
    )


def test_dataset_len_and_features() -> None:
    data = _dataset(n=5, features=3, ids_per_feature=2)
    assert len(data) == 5
    assert data.num_features == 3


@pytest.mark.parametrize(
    "change",
    [
        {"labels": np.zeros(3, np.float32)},
        {"dense": np.zeros((4, 2), np.float64)},
        {"sparse": np.zeros((4, 3), np.int32)},
        {"sparse": np.zeros(4, np.int64)},
        {"sparse": np.zeros((4, 5), np.int64), "ids_per_feature": 2},
    ],
)
def test_dataset_rejects_inconsistent_arrays(change: dict) -> None:
    fields = {
        "dense": np.zeros((4, 2), np.float32),
        "sparse": np.zeros((4, 3), np.int64),
        "labels": np.zeros(4, np.float32),
    }
    with pytest.raises(ConfigError, match="ClickDataset"):
        ClickDataset(**{**fields, **change})


def test_sampler_is_deterministic_and_seeded() -> None:
    first = _take(ResumableSampler(100, 10, seed=3), 25)
    again = _take(ResumableSampler(100, 10, seed=3), 25)
    other = _take(ResumableSampler(100, 10, seed=4), 25)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))
    assert all(batch.dtype == np.int64 and batch.shape == (10,) for batch in first)


def test_epochs_roll_over_drop_the_remainder_and_differ() -> None:
    sampler = ResumableSampler(100, 16, seed=0)
    assert sampler.batches_per_epoch == 6
    epoch0 = np.concatenate(_take(sampler, 6))
    assert (sampler.epoch, sampler.position) == (0, 6)
    epoch1 = np.concatenate(_take(sampler, 6))
    assert (sampler.epoch, sampler.position) == (1, 6)
    for epoch in (epoch0, epoch1):
        assert len(np.unique(epoch)) == 96
        assert epoch.min() >= 0 and epoch.max() < 100
    assert not np.array_equal(epoch0, epoch1)


def test_unshuffled_sampler_yields_index_order() -> None:
    batches = _take(ResumableSampler(10, 3, shuffle=False), 4)
    assert np.array_equal(np.concatenate(batches[:3]), np.arange(9))
    assert np.array_equal(batches[3], np.arange(3))


def test_ranks_partition_each_global_batch() -> None:
    ranks = [ResumableSampler(100, 8, rank=r, world_size=2, seed=7) for r in range(2)]
    single = ResumableSampler(100, 16, seed=7)
    for _ in range(13):  # crosses two epoch boundaries
        parts = [next(sampler) for sampler in ranks]
        assert np.array_equal(np.concatenate(parts), next(single))
        assert not set(parts[0]) & set(parts[1])


def test_restore_mid_epoch_sees_every_sample_once() -> None:
    world_size, batch_size, n = 2, 8, 100
    live = [ResumableSampler(n, batch_size, rank=r, world_size=world_size) for r in range(2)]
    before = [b for sampler in live for b in _take(sampler, 2)]
    # The state is rank-free: rank 0's state, through JSON, restores both ranks.
    state = json.loads(json.dumps(live[0].state_dict()))
    assert state == live[1].state_dict()
    restored = [ResumableSampler(n, batch_size, rank=r, world_size=world_size) for r in range(2)]
    for sampler in restored:
        sampler.load_state_dict(state)
        assert (sampler.epoch, sampler.position) == (0, 2)
    rest = [_take(sampler, sampler.batches_per_epoch - 2) for sampler in restored]
    seen = np.concatenate(before + [b for batches in rest for b in batches])
    assert len(seen) == len(np.unique(seen)) == 96
    # The restored stream is the one the live samplers go on to yield, into the next epoch too.
    for live_sampler, sampler, restored_rest in zip(live, restored, rest, strict=True):
        expected = _take(live_sampler, 6)
        actual = restored_rest + _take(sampler, 2)
        assert all(np.array_equal(a, b) for a, b in zip(expected, actual, strict=True))
    assert restored[0].epoch == 1


def test_restore_into_a_later_epoch_matches_an_uninterrupted_run() -> None:
    uninterrupted = ResumableSampler(50, 5, seed=1)
    expected = _take(uninterrupted, 33)[-3:]  # epoch 3, positions 0..2
    resumed = ResumableSampler(50, 5, seed=1)
    resumed.load_state_dict({**resumed.state_dict(), "epoch": 3, "position": 0})
    assert all(np.array_equal(a, b) for a, b in zip(expected, _take(resumed, 3), strict=True))


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_samples", 99), ("batch_size", 4), ("world_size", 1), ("seed", 9), ("shuffle", False)],
)
def test_mismatched_state_names_the_field(field: str, value: object) -> None:
    saved = ResumableSampler(100, 8, world_size=2, seed=0).state_dict()
    target = ResumableSampler(100, 8, world_size=2, seed=0)
    with pytest.raises(ConfigError, match=field):
        target.load_state_dict({**saved, field: value})


def test_invalid_state_is_rejected() -> None:
    sampler = ResumableSampler(100, 10)
    state = sampler.state_dict()
    with pytest.raises(ConfigError, match="position"):
        sampler.load_state_dict({**state, "position": 11})
    with pytest.raises(ConfigError, match="epoch"):
        sampler.load_state_dict({k: v for k, v in state.items() if k != "epoch"})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_samples": 10, "batch_size": 0},
        {"num_samples": 10, "batch_size": 4, "rank": 2, "world_size": 2},
        {"num_samples": 10, "batch_size": 6, "world_size": 2},
    ],
)
def test_sampler_rejects_bad_settings(kwargs: dict) -> None:
    with pytest.raises(ConfigError, match="sampler"):
        ResumableSampler(**kwargs)
