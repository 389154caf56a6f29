"""TorchRec's own training setup: ``TrainPipelineSparseDist`` reading two batches ahead, a
``CombinedOptimizer``, and the example job launched by ``torchrun``; SIGKILLed and resumed, it
trains every batch exactly once and ends bit-identical to a run never killed (2 ranks, gloo)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from embckpt.examples.launcher import RankFailed, run_ranks

pytestmark = pytest.mark.slow(15)  # seconds here, on 2 cores: see conftest.py

STEPS = 40
INTERVAL = 10
KILL_AT = 27  # between checkpoints 20 and 30, with two batches read ahead


def _train(rank: int, world_size: int, directory: str, log: str, kill_at: int | None) -> dict:
    from embckpt.examples.train_torchrun import train

    def on_step(step: int, indices: Any) -> None:
        with open(f"{log}.{rank}", "a") as out:
            out.write(json.dumps([step, indices.tolist()]) + "\n")
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    return train(directory, STEPS, interval=INTERVAL, on_step=on_step)


def _trained(log: Path, rank: int) -> list[tuple[int, list[int]]]:
    return [tuple(json.loads(line)) for line in (log.parent / f"{log.name}.{rank}").open()]


def _torchrun(directory: Path, digest: Path) -> subprocess.CompletedProcess:
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nproc_per_node", "2", "-m", "embckpt.examples.train_torchrun"]
    command += ["--dir", str(directory), "--steps", str(STEPS), "--interval", str(INTERVAL)]
    command += ["--digest", str(digest)]
    env = {**os.environ, "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300
    )


def test_killed_job_resumes_training_every_batch_once(tmp_path: Path) -> None:
    """SIGKILLed at step 27, the job resumes from its last checkpoint, trains the batches after
    it once (the two read ahead included) and ends bit-identical to a run never killed: resumed
    by ``train`` on fresh ranks, and by the example job under ``torchrun`` from a copy of the
    same directory."""
    reference_log = tmp_path / "reference_trained"
    expected = run_ranks(_train, 2, str(tmp_path / "reference"), str(reference_log), None)
    log = tmp_path / "trained"
    with pytest.raises(RankFailed, match="died"):
        run_ranks(_train, 2, str(tmp_path / "ckpt"), str(log), KILL_AT)
    shutil.copytree(tmp_path / "ckpt", tmp_path / "ckpt_torchrun")
    killed = [_trained(log, rank) for rank in range(2)]
    (log.parent / "trained.0").rename(log.parent / "killed.0")
    (log.parent / "trained.1").rename(log.parent / "killed.1")
    resumed = run_ranks(_train, 2, str(tmp_path / "ckpt"), str(log), None)
    for rank in range(2):
        restored = resumed[rank]["restored"]
        assert restored in (10, 20), f"rank {rank}: restored {restored}"
        assert killed[rank][-1][0] == KILL_AT
        # What the resumed model trained on: the killed run up to the checkpoint, then the
        # resumed run. The batches the killed run trained after it (and the two the pipeline
        # had read ahead) are trained again, once.
        trained = [b for b in killed[rank] if b[0] <= restored] + _trained(log, rank)
        reference = _trained(reference_log, rank)
        assert [s for s, _ in trained] == list(range(1, STEPS + 1))
        assert trained == reference, f"rank {rank}: trained other batches than the reference"
        samples = [i for _, batch in trained for i in batch]
        assert len(samples) == len(set(samples)), "a sample was trained twice in one epoch"
        assert resumed[rank]["digest"] == expected[rank]["digest"], f"rank {rank} differs"

    digest = tmp_path / "digest.json"
    job = _torchrun(tmp_path / "ckpt_torchrun", digest)
    assert job.returncode == 0, job.stdout.decode()[-3000:]
    result = json.loads(digest.read_text())
    assert result["restored"] == resumed[0]["restored"]
    assert result["digests"] == [r["digest"] for r in expected], "differs from the reference"


def test_sampler_saves_the_position_of_trained_batches() -> None:
    from embckpt import ConfigError, ResumableSampler

    sampler = ResumableSampler(64, 4, count_trained=True)
    handed = [next(sampler) for _ in range(5)]
    sampler.mark_trained(3)
    assert sampler.read_ahead == 2
    resumed = ResumableSampler(64, 4, count_trained=True)
    resumed.load_state_dict(sampler.state_dict())
    assert (next(resumed) == handed[3]).all()
    with pytest.raises(ConfigError, match="only 2 batch"):
        sampler.mark_trained(3)
    with pytest.raises(ConfigError, match="count_trained=True"):
        ResumableSampler(64, 4).mark_trained()
