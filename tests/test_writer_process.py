"""The rank's writer process (save/writer_process.py, save/writer_worker.py), on 2 gloo ranks.

Copy-on-write saves with ``writer="process"`` must hold exactly what the thread writer's do,
whatever the steps did in the window, and a job restored from them must train on like the
writer. A writer process that fails or dies mid-save fails that save on every rank, naming the
cause, leaves the previous checkpoint restorable, never stops training, and the next save
works (a new process; a full where the codec needed the old one's reference). A rank that dies
takes its writer process with it. Ranks of the launcher fork their writer processes from its
writer zygote (save/writer_zygote.py), each taking what its rank would give a child; without
one (torchrun, or a zygote that has ended) each is a fresh interpreter.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import toy_model as tm
from compiled_kernels import kernel_signatures
from faultfs import FaultyHandler

from embckpt.examples.launcher import run_ranks

pytestmark = pytest.mark.slow(90)  # seconds here, on 2 cores: see conftest.py

# The headline codec (adaptive 4-bit deltas) under a policy that takes diffs on a toy model.
LOSSY = {"policy": "one_shot", "full_every": 0, "codec": "adaptive", "bits": 4}
SMALL_SLABS = {"staging_budget_bytes": 20000, "pack_below_bytes": 0}  # steps run in windows


def _off(expected: dict, live: dict) -> list[str]:
    return sorted(
        f"{key}:{name}"
        for key, values in expected.items()
        for name, value in values.items()
        if not torch.equal(value, live[key][name])
    )


def _step(model, opt, step: int, rank: int, hot: int | None = None) -> None:
    """toy_model's step, on the model's device."""
    device = next(model.parameters()).device
    dense, kjt, labels = tm.batch(step, rank, hot=hot)
    opt.zero_grad()
    logits = model(dense.to(device), kjt.to(device)).squeeze(-1)
    torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to(device)).backward()
    opt.step()


def _chain(rank: int, world_size: int, root: str, options: dict, device: str = "cpu") -> dict:
    """Saves a chain with steps trained in every window, then restores each step in a fresh
    model and trains on; everything compared exactly (the writer processes forked from the
    launcher's zygote: a fresh interpreter's start is tested below)."""
    from embckpt import CheckpointConfig, Checkpointer

    config = CheckpointConfig(writer="process", **SMALL_SLABS, **options)
    model, opt = tm.build(world_size, seed=0, device=device)
    out: dict = {"kinds": [], "copied": [], "windows": 0}
    expected, live = {}, {}
    with Checkpointer(model, root, optimizer=opt, config=config) as ckpt:
        ckpt.track_reconstruction()
        out["pid"] = ckpt._saver.process.pid
        out["parent_is_rank"] = _parent(out["pid"]) == os.getpid()
        step = 0
        for save in range(4):
            for _ in range(3):
                step += 1
                _step(model, opt, step, rank, hot=120 if save else None)
            state = tm.snapshot_state(model, opt, rank)
            handle = ckpt.save(step)
            for _ in range(3):  # the window: these steps update rows being copied
                out["windows"] += int(not handle.done())
                step += 1
                _step(model, opt, step, rank, hot=120)
            manifest = handle.wait()
            out["kinds"].append((manifest.kind, manifest.stats["reason"]))
            out["copied"].append(handle.copied_s)
            expected[manifest.step] = ckpt.reconstruction()
            live[manifest.step] = state
            if options.get("codec", "raw") == "raw":
                out.setdefault("lossless", []).extend(
                    _off(expected[manifest.step], _blocks_of(state))
                )
    fresh, fresh_opt = tm.build(world_size, seed=7, device=device)
    out["restored"] = {}
    with Checkpointer(fresh, root, optimizer=fresh_opt, config=config) as other:
        for saved in sorted(expected, reverse=True):
            restored = other.restore(saved, discard_newer=True)
            blocks = tm.writer_blocks(fresh, rank)
            # Data-parallel tables' rows are checked as blocks (the row codec encodes them).
            dense = {
                k: v
                for k, v in tm.snapshot_state(fresh, fresh_opt, rank).items()
                if k[0] in "do" and "embedding_bags" not in k
            }
            out["restored"][saved] = (
                restored,
                _off(expected[saved], blocks),
                [k for k, v in dense.items() if not torch.equal(v, live[saved][k])],
            )
        # Continuation: train on from the first checkpoint, save through the new process.
        other.track_reconstruction()
        step = min(expected)
        other.restore(step)
        for _ in range(3):
            step += 1
            _step(fresh, fresh_opt, step, rank, hot=120)
        other.save(step).wait()
        meant = other.reconstruction()
        other.restore(step)
        out["continued"] = _off(meant, tm.writer_blocks(fresh, rank))
    return out


def _blocks_of(state: dict) -> dict:
    """snapshot_state's weights and optimizer states as reconstruction() keys them."""
    blocks: dict = {}
    for key, value in state.items():
        kind, _, rest = key.partition(":")
        if kind == "w":
            blocks.setdefault(rest, {})["weight"] = value.float().cpu()
        elif kind == "s":
            block, _, name = rest.rpartition(":")
            prefix = "row" if value.dim() == 1 else "elem"
            blocks.setdefault(block, {})[f"{prefix}:{name}"] = value.float().cpu()
    return blocks


@pytest.mark.parametrize("options", [{"policy": "incremental", "full_every": 3}, LOSSY])
def test_process_writer_chain_restores_what_it_meant(options: dict) -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_chain, 2, root, options, timeout_s=240)
    for rank, out in enumerate(results):
        assert not out["parent_is_rank"], rank  # forked by the zygote
        kinds = [kind for kind, _ in out["kinds"]]
        assert kinds[0] == "full" and "diff" in kinds, (rank, out["kinds"])
        assert out["windows"] > 0  # steps ran while rows were being copied
        assert all(c is not None and 0 < c < 60 for c in out["copied"]), out["copied"]
        assert out.get("lossless", []) == [], rank
        for step, (restored, blocks, dense) in out["restored"].items():
            assert restored == step and blocks == [] and dense == [], (rank, step, blocks, dense)
        assert out["continued"] == [], rank
    assert results[0]["pid"] != results[1]["pid"] != os.getpid()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("options", [{"policy": "incremental", "full_every": 3}, LOSSY])
def test_process_writer_chain_on_a_gpu(options: dict, tmp_path: Path) -> None:
    """The same on CUDA: slabs page-locked in the shared memory, copies on a side stream."""
    (out,) = run_ranks(_chain, 1, str(tmp_path), options, "cuda", timeout_s=240)
    assert out["windows"] > 0 and out.get("lossless", []) == [] and out["continued"] == []
    for step, (restored, blocks, dense) in out["restored"].items():
        assert restored == step and blocks == [] and dense == [], (step, blocks, dense)


def _writer_fails(rank: int, world_size: int, root: str, exit_code: int | None) -> dict:
    """Rank 1's writer process fails (raises, or exits with ``exit_code``) in the second save;
    training goes on, the next save commits, both restore what the writer meant."""
    from embckpt import CheckpointConfig, Checkpointer

    config = CheckpointConfig(writer="process", **LOSSY)
    model, opt = tm.build(world_size, seed=0)
    out: dict = {}
    with Checkpointer(model, root, optimizer=opt, config=config) as ckpt:
        ckpt.track_reconstruction()
        process = ckpt._saver.process
        tm.train_step(model, opt, 1, rank)
        ckpt.save(1).wait()
        meant = {1: ckpt.reconstruction()}
        tm.train_step(model, opt, 2, rank, hot=60)
        out["first_pid"] = process.pid
        if rank == 1:
            process.arm("save.encode", exit_code=exit_code)
        handle = ckpt.save(2)
        for step in range(3, 6):  # training goes on while the save fails
            tm.train_step(model, opt, step, rank, hot=60)
        out["error"] = tm.raised(handle.wait)
        out["committed"] = ckpt.store.committed_steps()
        manifest = ckpt.save(5).wait()
        meant[5] = ckpt.reconstruction()
        out["next"] = (manifest.kind, manifest.stats["reason"])
        out["second_pid"] = process.pid
        tm.train_step(model, opt, 6, rank, hot=60)
        out["off"] = {}
        for step, discard in ((5, False), (1, True)):
            ckpt.restore(step, discard_newer=discard)
            out["off"][step] = _off(meant[step], tm.writer_blocks(model, rank))
        tm.train_step(model, opt, 2, rank, hot=60)
        out["after"] = ckpt.save(2).wait().kind
    return out


@pytest.mark.parametrize("exit_code", [None, 3])
def test_a_failing_writer_process_fails_the_save_on_every_rank(exit_code: int | None) -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_writer_fails, 2, root, exit_code, timeout_s=240)
    cause = "injected fault at save.encode" if exit_code is None else "exited with code 3"
    assert results[1]["error"].startswith("SaveError") and cause in results[1]["error"]
    assert results[0]["error"].startswith("SaveRankError") and cause in results[0]["error"]
    for rank, out in enumerate(results):
        assert "step 2" in out["error"], rank
        assert out["committed"] == [1], rank  # the previous checkpoint, and nothing else
        # Rank 1's reference died with its process: every rank takes the full.
        assert out["next"][0] == ("full" if exit_code else "diff"), (rank, out["next"])
        assert out["off"] == {5: [], 1: []}, rank
        assert out["after"] == "full", rank  # a restore's next save
    # A dead writer process is replaced by a new one; a failing one lives on.
    assert (results[1]["second_pid"] != results[1]["first_pid"]) == (exit_code is not None)
    assert results[0]["second_pid"] == results[0]["first_pid"]


def _dies_with_writer(rank: int, world_size: int, root: str, pid_file: str, fresh: bool) -> None:
    from embckpt import CheckpointConfig, Checkpointer
    from embckpt.save.writer_zygote import ZYGOTE_ENV

    if fresh:  # a fresh interpreter, the rank's child (as under torchrun)
        del os.environ[ZYGOTE_ENV]
    model, opt = tm.build(world_size, seed=0)
    ckpt = Checkpointer(model, root, optimizer=opt, config=CheckpointConfig(writer="process"))
    ckpt.save(0).wait()
    pid = ckpt._saver.process.pid
    Path(pid_file).write_text(f"{pid} {int(_parent(pid) == os.getpid())}")
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no exit handlers


@pytest.mark.parametrize("fresh", [False, True])
def test_the_writer_process_ends_with_its_rank(tmp_path: Path, fresh: bool) -> None:
    """Forked by the zygote (it watches the rank) or the rank's child (it watches its parent)."""
    from embckpt.examples.launcher import RankFailed

    pid_file = tmp_path / "writer.pid"
    with pytest.raises(RankFailed):
        run_ranks(_dies_with_writer, 1, str(tmp_path / "ckpt"), str(pid_file), fresh, timeout_s=120)
    writer, child = map(int, pid_file.read_text().split())
    assert child == fresh
    deadline = time.monotonic() + 10
    while _running(writer) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(writer)


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().split(")")[-1].split()[1])


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_zygote_forks_writers_and_reports_how_they_end() -> None:
    """A writer forked from the zygote is not this process's child; the zygote reports its
    exit code (it exits when the rank closes the connection) or the signal that killed it."""
    from embckpt import start_writer_zygote
    from embckpt.save.shared_memory import SharedMemory
    from embckpt.save.writer_zygote import ZYGOTE_ENV, fork_writer

    path = start_writer_zygote()[ZYGOTE_ENV]
    memory = SharedMemory(1 << 12, pinned=False)
    ends = []
    for how in ("close", "kill"):
        ours, theirs = socket.socketpair()
        child = fork_writer(path, (theirs.fileno(), memory.fd))
        theirs.close()
        assert _parent(child.pid) != os.getpid() and child.poll() is None
        if how == "close":
            ours.close()
        else:
            child.kill()
        ends.append(child.wait(timeout=60))
        ours.close()
    memory.close()
    assert ends == [0, -signal.SIGKILL]


def _without_zygote(rank: int, world_size: int, root: str, gone: str) -> dict:
    """The zygote's socket refuses (it has ended): the writer is a fresh interpreter."""
    from embckpt import CheckpointConfig, Checkpointer
    from embckpt.save.writer_zygote import ZYGOTE_ENV

    os.environ[ZYGOTE_ENV] = gone
    model, opt = tm.build(world_size, seed=0)
    with Checkpointer(model, root, optimizer=opt, config=CheckpointConfig(writer="process")) as c:
        tm.train_step(model, opt, 1, rank)
        kind = c.save(1).wait().kind
        return {"kind": kind, "parent_is_rank": _parent(c._saver.process.pid) == os.getpid()}


def test_a_zygote_that_has_ended_leaves_fresh_interpreters(tmp_path: Path) -> None:
    gone = str(tmp_path / "zygote.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(gone)  # a socket file nobody listens on
    (out,) = run_ranks(_without_zygote, 1, str(tmp_path / "ckpt"), gone, timeout_s=120)
    assert out == {"kind": "full", "parent_is_rank": True}


class _NotingHandler(FaultyHandler):
    """Notes, for every rows file it opens, the process that opens it and what that process
    inherited: the environment variable ``MARK`` and the working directory."""

    def open_output_stream(self, path: str, metadata: Any = None) -> Any:
        if "/tables/" in path:
            notes = Path(os.environ["NOTES"]) / f"{os.getpid()}"
            notes.write_text(f"{os.environ.get('MARK')} {os.getcwd()}")
            print(f"noted by {os.getpid()}", file=sys.stderr, flush=True)
        return super().open_output_stream(path, metadata)


def _inherits(rank: int, world_size: int, root: str) -> dict:
    """Set after the launcher started the zygote: the rank's environment, directory and
    stderr."""
    import pyarrow.fs as pafs

    from embckpt import CheckpointConfig, Checkpointer

    os.environ.update(MARK=f"rank {rank}", NOTES=f"{root}/notes")
    os.chdir(f"{root}/cwd{rank}")
    with open(f"{root}/stderr{rank}", "w") as err:  # the rank's stderr from now on
        os.dup2(err.fileno(), 2)
    model, opt = tm.build(world_size, seed=0)
    store = pafs.PyFileSystem(_NotingHandler())
    config = CheckpointConfig(writer="process", pipeline="full")
    with Checkpointer(
        model, f"{root}/ckpt", optimizer=opt, config=config, filesystem=store
    ) as ckpt:
        tm.train_step(model, opt, 1, rank)
        ckpt.save(1).wait()
        writer = ckpt._saver.process.pid
        return {"writer": writer, "forked": _parent(writer) != os.getpid()}


def test_a_forked_writer_takes_what_its_rank_would_give_a_child(tmp_path: Path) -> None:
    for name in ("notes", "cwd0", "cwd1"):
        (tmp_path / name).mkdir()
    results = run_ranks(_inherits, 2, str(tmp_path), timeout_s=120)
    for rank, out in enumerate(results):
        assert out["forked"], rank  # by the zygote, not started by the rank
        noted = (tmp_path / "notes" / str(out["writer"])).read_text()
        assert noted == f"rank {rank} {tmp_path}/cwd{rank}", (rank, noted)
        assert f"noted by {out['writer']}" in (tmp_path / f"stderr{rank}").read_text(), rank


def _kernels_before_save(rank: int, world_size: int, root: str) -> dict:
    """The codec's kernels are loaded when the Checkpointer is built: the saves after load
    none (the thread writer encodes in this process)."""
    from embckpt import CheckpointConfig, Checkpointer

    model, opt = tm.build(world_size, seed=0)
    before = kernel_signatures()
    config = CheckpointConfig(writer="thread", **LOSSY)
    with Checkpointer(model, root, optimizer=opt, config=config) as ckpt:
        built = kernel_signatures()
        for step in (1, 2, 3):
            tm.train_step(model, opt, step, rank, hot=60)
            ckpt.save(step).wait()
    return {"before": before, "built": built, "saved": kernel_signatures()}


def test_the_codec_kernels_are_ready_before_the_first_save(tmp_path: Path) -> None:
    # A fresh interpreter, as torchrun starts a rank: the launcher's fork server has loaded
    # the kernels already in the ranks it forks.
    (out,) = run_ranks(_kernels_before_save, 1, str(tmp_path), timeout_s=240, spawn=True)
    loaded = {k for k, n in out["built"].items() if n > out["before"].get(k, 0)}
    assert loaded, "building the Checkpointer loaded no kernel"
    assert out["saved"] == out["built"]  # a full and two diffs compiled nothing more


def test_io_threads_follow_the_cores_of_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from embckpt.cores import writer_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert writer_threads(None) == 15  # one core kept for the training thread
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert writer_threads(None) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert writer_threads(None) == 3
    assert writer_threads(5) == 5  # as configured
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(64)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert writer_threads(None) == 16


def test_shared_memory_views_and_offsets() -> None:
    from embckpt.save.shared_memory import SharedMemory, attach

    memory = SharedMemory(1 << 16, pinned=False)
    slab = memory.slab(4096, 8192)
    slab.view(torch.float32)[:4] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert memory.offset_of(slab) == 4096
    assert memory.offset_of(slab[64:128]) == 4096 + 64
    assert memory.offset_of(torch.zeros(4)) is None
    # Another mapping of the same descriptor sees the same bytes (as the writer process does).
    mapping, other = attach(os.dup(memory.fd), memory.nbytes)
    assert other[4096:4112].view(torch.float32).tolist() == [1.0, 2.0, 3.0, 4.0]
    del other, slab
    mapping.close()
    memory.close()
    assert memory.fd == -1


def test_writer_worker_starts_without_torchrec() -> None:
    """The writer process's imports: no TorchRec, and no FBGEMM, whose ops its codecs' kernels
    replace (imported, they were a third of the process's start)."""
    code = (
        "import sys, embckpt.save.writer_worker; "
        "assert 'torchrec' not in sys.modules, 'torchrec imported'; "
        "assert 'fbgemm_gpu' not in sys.modules, 'fbgemm_gpu imported'; print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


def _tiered(rank: int, world_size: int, root: str) -> dict:
    """A node-local tier with a peer replica and a durable copy every second checkpoint, the
    rows written by the writer process into the node's folder."""
    from embckpt import CheckpointConfig, Checkpointer

    os.environ["EMBCKPT_NODE"] = f"n{rank}"
    config = CheckpointConfig(
        policy="one_shot", writer="process", local_dir=f"{root}/local", replicas=1
    )
    model, opt = tm.build(world_size, seed=0)
    expected = {}
    with Checkpointer(model, f"{root}/durable", optimizer=opt, config=config) as ckpt:
        for step in range(1, 16):
            tm.train_step(model, opt, step, rank, hot=60)
            if step % 5 == 0:
                ckpt.save(step).wait()
                expected[step] = tm.snapshot_state(model, opt, rank)
    fresh, fresh_opt = tm.build(world_size, seed=3)
    restoring = dataclasses.replace(config, writer="thread")  # loads only: no writer process
    with Checkpointer(fresh, f"{root}/durable", optimizer=fresh_opt, config=restoring) as other:
        result = other.load()
    return {
        "step": result.manifest.step,
        "tiers": sorted(result.bytes_by_tier),
        "diff": tm.differences(expected[15], tm.snapshot_state(fresh, fresh_opt, rank)),
        "replica": sorted(p.name for p in Path(root, "local/n0/replicas/n1").glob("step_*")),
    }


def test_the_writer_process_writes_into_the_node_local_tier(tmp_path: Path) -> None:
    results = run_ranks(_tiered, 2, str(tmp_path), timeout_s=240)
    for rank, out in enumerate(results):
        assert out["step"] == 15 and out["diff"] == [], (rank, out)
    assert results[0]["replica"] == ["step_000000000005", "step_000000000010", "step_000000000015"]
