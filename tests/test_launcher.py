"""``run_ranks`` on the fork server: each rank a fresh process with its own process group, the
caller's current environment and output descriptors and its own random state; a rank that
raises, dies or hangs fails the run."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from embckpt.examples.launcher import RankFailed, rank_context, run_ranks

pytestmark = pytest.mark.slow(25)  # seconds here, on 2 cores: see conftest.py


def _identify(rank: int, world_size: int) -> dict:
    import numpy as np
    import torch
    import torch.distributed as dist
    from compiled_kernels import kernel_signatures

    from embckpt.storage import fs

    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "EMBCKPT_TEST_LAUNCHER")
    return {
        "pid": os.getpid(),
        "env": {name: os.environ.get(name) for name in names},
        "group": (dist.get_rank(), dist.get_world_size(), int(total)),
        "threads": torch.get_num_threads(),
        "draws": (random.random(), float(np.random.rand()), fs._JITTER.uniform(0, 1)),
        # What the fork server readied (codecs/preload.py): kernels loaded, scikit-learn imported.
        "kernels": sum(n for k, n in kernel_signatures().items() if ".adaptive_kernels." in k),
        "sklearn": "sklearn.cluster" in sys.modules,
    }


_ERR_LINES = ("warns", "writes to descriptor 2")  # sorted


def _speak(rank: int, world_size: int) -> None:
    for stream, line in ((sys.stdout, "says hello"), (sys.stderr, _ERR_LINES[0])):
        stream.write(f"rank {rank} {line}\n")  # one write: the ranks' lines do not interleave
        stream.flush()
    os.write(2, f"rank {rank} {_ERR_LINES[1]}\n".encode())


def _misbehave(rank: int, world_size: int, how: str) -> int:
    if rank == 1:
        if how == "raise":
            raise ValueError("rank 1 gives up")
        if how == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "hang":
            time.sleep(600)
    return rank


def test_each_rank_is_a_fresh_process_with_the_callers_environment(monkeypatch) -> None:
    run_ranks(_identify, 2)  # the fork server now runs, with the environment of before
    monkeypatch.setenv("EMBCKPT_TEST_LAUNCHER", "set after the fork server started")
    runs = [run_ranks(_identify, 3), run_ranks(_identify, 3)]
    pids = {r["pid"] for ranks in runs for r in ranks}
    assert len(pids) == 6 and os.getpid() not in pids
    for i in range(3):  # unseeded generators: each rank its own entropy, as when spawned
        assert len({r["draws"][i] for ranks in runs for r in ranks}) == 6, i
    for ranks in runs:
        port = ranks[0]["env"]["MASTER_PORT"]
        for rank, r in enumerate(ranks):
            assert r["group"] == (rank, 3, 6)  # a group of this run's ranks only
            assert r["threads"] == 1
            assert r["kernels"] > 0 and r["sklearn"]
            assert r["env"] == {
                "RANK": str(rank),
                "WORLD_SIZE": "3",
                "LOCAL_RANK": str(rank),
                "MASTER_PORT": port,
                "EMBCKPT_TEST_LAUNCHER": "set after the fork server started",
            }


def _output_of(tmp_path: Path, world_size: int) -> tuple[list[str], list[str]]:
    """The lines ``_speak`` ranks write to descriptors 1 and 2, redirected to files now."""
    saved = os.dup(1), os.dup(2)
    out, err = tmp_path / "out", tmp_path / "err"
    try:
        with out.open("wb") as out_file, err.open("wb") as err_file:
            os.dup2(out_file.fileno(), 1)
            os.dup2(err_file.fileno(), 2)
            run_ranks(_speak, world_size)
    finally:
        for fd, kept in zip((1, 2), saved, strict=True):
            os.dup2(kept, fd)
            os.close(kept)
    return sorted(out.read_text().splitlines()), sorted(err.read_text().splitlines())


def test_ranks_write_where_the_callers_output_goes_now(tmp_path: Path) -> None:
    """As spawned ranks did: a test capturing descriptors 1 and 2 (``capfd``) sees the ranks'
    output, not the descriptors the fork server started with."""
    run_ranks(_speak, 1)  # the fork server now runs, with the descriptors of before
    out, err = _output_of(tmp_path, 2)
    assert out == ["rank 0 says hello", "rank 1 says hello"]
    assert err == [f"rank {r} {line}" for r in range(2) for line in _ERR_LINES]


def test_ranks_are_spawned_where_cuda_is_available(tmp_path: Path, monkeypatch) -> None:
    """CUDA cannot start in a process forked from one that asked for it (as importing fbgemm_gpu
    does): ranks are spawned, and keep the descriptors they inherit."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # here only, not in the rank
    assert rank_context().get_start_method() == "spawn"
    assert _output_of(tmp_path, 1) == (["rank 0 says hello"], [f"rank 0 {x}" for x in _ERR_LINES])


@pytest.mark.parametrize(
    "how, match",
    [("raise", "(?s)rank 1:.*ValueError: rank 1 gives up"), ("die", r"ranks died: \[\(1, -9\)\]")],
)
def test_a_rank_that_raises_or_dies_fails_the_run(how: str, match: str) -> None:
    with pytest.raises(RankFailed, match=match):
        run_ranks(_misbehave, 2, how)


def test_a_rank_that_hangs_fails_the_run_at_the_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(RankFailed, match="no result within 1"):
        run_ranks(_misbehave, 2, "hang", timeout_s=1)
    assert time.monotonic() - started < 30  # the hung rank was killed, not waited for


def test_ranks_start_from_a_script_main(tmp_path: Path) -> None:
    """Benchmarks call ``run_ranks`` with functions of their ``__main__``."""
    script = tmp_path / "script.py"
    script.write_text(
        "import os\n"
        "from embckpt.examples.launcher import run_ranks\n"
        "def where(rank, world_size):\n"
        "    return rank, os.getpid()\n"
        "if __name__ == '__main__':\n"
        "    print(run_ranks(where, 2))\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("[(0, ") and ", (1, " in done.stdout
