"""Shared fixtures. Multi-rank work runs through embckpt's own launcher (gloo on loopback)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from embckpt.examples.launcher import preload_in_ranks

os.environ.setdefault("LOCAL_WORLD_SIZE", "2")
# Without a GPU, Triton's kernels (codecs/device_kernels.py, tested in test_device_encode.py)
# run in its interpreter. It must be on before anything imports triton (torchrec and FBGEMM
# do): Triton's own library functions are built when it is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Imported once by each worker's fork server rather than by every rank: the test modules that
# define rank functions import pytest (0.06 s of CPU a rank, for about 280 ranks a run).
preload_in_ranks("pytest", "toy_model", "faultfs", "fault_schedules", "shard_compare")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules marked ``slow(seconds)`` first, longest first; the rest after, in file order.

    ``make test`` runs each module whole on one worker (``--dist loadfile``), in this order
    (``--no-loadscope-reorder``; pytest-xdist would otherwise start the modules with the most
    tests first). A long module started last would run alone at the end while the other
    workers idle. The seconds are a module's time in a parallel run on 2 cores, rounded.
    """

    def cost(item: pytest.Item) -> float:
        mark = item.get_closest_marker("slow")
        return -float(mark.args[0]) if mark is not None and mark.args else 0.0

    items.sort(key=cost)  # stable: a module's tests stay together and in order


def _save_small_run(rank: int, world_size: int, root: str) -> None:
    import toy_model as tm

    from embckpt import CheckpointConfig, Checkpointer

    model, opt = tm.build(world_size, seed=0)
    for name, policy in (("one_shot", "one_shot"), ("incremental", "incremental")):
        config = CheckpointConfig(policy=policy, full_every=0)
        with Checkpointer(model, f"{root}/{name}", optimizer=opt, config=config) as ckpt:
            for step in range(1, 16):
                tm.train_step(model, opt, step, rank, hot=80)
                if step % 5 == 0:
                    ckpt.save(step).wait()


@pytest.fixture(scope="session")
def saved_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two checkpoint directories written by 2 ranks (steps 5 full, 10 and 15 diffs):
    ``one_shot/`` and ``incremental/``. Read-only: copy before damaging."""
    from embckpt.examples.launcher import run_ranks

    root = tmp_path_factory.mktemp("saved")
    run_ranks(_save_small_run, 2, str(root))
    return root


@pytest.fixture
def run_copy(saved_runs: Path, tmp_path: Path) -> Path:
    """A private copy of :func:`saved_runs` that a test may damage."""
    shutil.copytree(saved_runs, tmp_path / "runs")
    return tmp_path / "runs"
