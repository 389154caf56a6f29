"""Merged checkpoints restore bit for bit what their chains restore, for every codec and entropy
stage (weights, row-wise and element-wise optimizer states, later diffs on top); merge takes
the directory lock; a merge killed with SIGKILL at any point leaves the step restorable."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from embckpt.examples.launcher import rank_context, run_ranks
from embckpt.read.export import reconstruct
from embckpt.read.merge import merge
from embckpt.storage.chain import read_chain
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import MANIFEST_NAME
from embckpt.storage.lock import LOCK_NAME, DirectoryLockedError
from embckpt.storage.verify import verify

pytestmark = pytest.mark.slow(55)  # seconds here, on 2 cores: see conftest.py

HEAD, LATER = 4, 5  # a step and a save each: 1 (full), 2, 3, 4, 5; merge 4; 5 is a diff on top
# name: codec, bits, entropy, policy, optimizer (element-wise states with exact_adagrad),
# (max_file_rows, row_group_rows): small values split blocks into parts and row groups.
CASES: dict[str, tuple[str, int | None, str, str, str, tuple[int, int]]] = {
    "raw": ("raw", None, "auto", "incremental", "rowwise", (64, 32)),
    "fp16": ("fp16", None, "auto", "incremental", "adagrad", (1 << 20, 65536)),
    "bf16": ("bf16", None, "huffman", "incremental", "rowwise", (1 << 20, 65536)),
    "asymmetric": ("asymmetric", 4, "auto", "incremental", "adagrad", (1 << 20, 65536)),
    "symmetric": ("symmetric", 4, "lz4", "incremental", "rowwise", (1 << 20, 65536)),
    "adaptive-huffman": ("adaptive", 4, "huffman", "incremental", "adagrad", (64, 32)),
    "adaptive-zstd": ("adaptive", 4, "zstd", "incremental", "rowwise", (1 << 20, 65536)),
    "adaptive-lz4": ("adaptive", 4, "lz4", "one_shot", "rowwise", (1 << 20, 65536)),
    "adaptive-none": ("adaptive", 4, "none", "incremental", "adagrad", (1 << 20, 65536)),
    "kmeans": ("kmeans", 4, "auto", "incremental", "adagrad", (1 << 20, 65536)),
    "exponent": ("exponent", 4, "auto", "incremental", "adagrad", (64, 32)),
    "exponent-one_shot": ("exponent", 3, "huffman", "one_shot", "rowwise", (1 << 20, 65536)),
}
KEPT = ("adaptive-huffman", "exponent")  # pristine copies for the lock and SIGKILL tests


def _config(name: str) -> Any:
    from embckpt import CheckpointConfig

    codec, bits, entropy, policy, _, (file_rows, group_rows) = CASES[name]
    return CheckpointConfig(
        policy=policy,
        full_every=0,
        codec=codec,
        bits=bits,
        entropy=entropy,
        max_file_rows=file_rows,
        row_group_rows=group_rows,
        fsync=False,
    )


def _merge_cases(rank: int, world_size: int, root: str) -> dict:
    import torch.distributed as dist
    import toy_model as tm
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from embckpt import Checkpointer

    optimizers = {
        "rowwise": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "adagrad": EmbOptimType.EXACT_ADAGRAD,
    }
    out: dict[str, dict] = {}
    for name, case in CASES.items():
        config, directory = _config(name), f"{root}/{name}"
        model, opt = tm.build(world_size, seed=0, optimizer=optimizers[case[4]])
        with Checkpointer(model, directory, optimizer=opt, config=config) as ckpt:
            for step in range(1, LATER + 1):
                tm.train_step(model, opt, step, rank, hot=120)
                ckpt.save(step).wait()
            chain = {}
            for step in (HEAD, LATER):
                ckpt.restore(step)
                chain[step] = tm.snapshot_state(model, opt, rank)
        r: dict[str, Any] = {}
        if rank == 0:
            if name in KEPT:
                shutil.copytree(directory, f"{root}/pristine/{name}")
            store = CheckpointStore(directory)
            r["chain"] = [m.step for m in read_chain(store, HEAD)]
            merged = merge(store, HEAD, row_group_rows=32)
            r["kind"], r["merged_from"] = merged.kind, merged.stats["merged_from"]
            rows_files = [f for f in merged.files if f.role == "rows"]
            r["unindexed"] = [f.path for f in rows_files if f.partial_index is None]
            r["verify_ok"] = verify(store).ok
            r["later_chain"] = [m.step for m in read_chain(store, LATER)]
            folder = Path(store.step_path(HEAD))
            on_disk = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
            r["unlisted"] = sorted(on_disk - {f.path for f in merged.files} - {MANIFEST_NAME})
        dist.barrier()
        with Checkpointer(model, directory, optimizer=opt, config=config) as ckpt:
            r["diffs"] = {}
            for step in (HEAD, LATER):
                ckpt.restore(step)
                r["diffs"][step] = tm.differences(chain[step], tm.snapshot_state(model, opt, rank))
        r["keys"] = len(chain[HEAD])
        r["elem_states"] = any(k[:2] == "s:" and v.dim() == 2 for k, v in chain[HEAD].items())
        r["head_vs_later"] = len(tm.differences(chain[HEAD], chain[LATER]))
        out[name] = r
    return out


@pytest.fixture(scope="module")
def merged_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """Every case written, restored, merged and restored again on 2 ranks (one launch)."""
    root = tmp_path_factory.mktemp("merge")
    return root, run_ranks(_merge_cases, 2, str(root))


@pytest.mark.parametrize("name", sorted(CASES))
def test_merged_step_restores_bit_identically(merged_runs, name: str) -> None:
    _, results = merged_runs
    incremental = CASES[name][3] == "incremental"
    for rank, out in enumerate(results):
        r = out[name]
        assert r["diffs"][HEAD] == [], (rank, r["diffs"][HEAD][:5])
        assert r["diffs"][LATER] == [], (rank, r["diffs"][LATER][:5])
        assert r["keys"] > 0 and r["head_vs_later"] > 0, rank  # the comparisons can fail
        assert r["elem_states"] == (CASES[name][4] == "adagrad"), rank
    head = results[0][name]
    assert head["chain"] == ([1, 2, 3, 4] if incremental else [1, 4])
    assert head["kind"] == "full" and head["merged_from"] == head["chain"]
    assert head["unindexed"] == [] and head["verify_ok"] and head["unlisted"] == []
    # A later incremental diff now stands on the merged step; a one-shot one on its base.
    assert head["later_chain"] == ([HEAD, LATER] if incremental else [1, LATER])


# -- lock and crash safety (single process, on copies of chains written above) ---------------
def _tables(directory: Path, step: int) -> dict[str, torch.Tensor]:
    rebuilt = reconstruct(directory, step, threads=1)
    return {**rebuilt.tables, **{f"dense:{k}": v for k, v in rebuilt.dense.items()}}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_merge_is_refused_while_a_live_job_holds_the_lock(merged_runs, tmp_path: Path) -> None:
    root, _ = merged_runs
    directory = tmp_path / "chain"
    shutil.copytree(root / "pristine" / "exponent", directory)
    manifest = directory / f"step_{HEAD:012d}" / MANIFEST_NAME
    before = manifest.read_bytes()
    owner = subprocess.Popen(["sleep", "60"])
    try:
        lock = f'{{"host": "{socket.gethostname()}", "pid": {owner.pid}, "since": 0}}'
        (directory / LOCK_NAME).write_text(lock)
        with pytest.raises(DirectoryLockedError, match=str(owner.pid)):
            merge(CheckpointStore(directory), HEAD)
        assert manifest.read_bytes() == before
        assert not (directory / f"step_{HEAD:012d}" / "merged").exists()
    finally:
        owner.kill()
        owner.wait()
    # The owner is gone: its lock is stale, taken over, and released after the merge.
    assert merge(CheckpointStore(directory), HEAD).kind == "full"
    assert not (directory / LOCK_NAME).exists()


def test_merge_removes_debris_but_not_what_a_listed_file_links_to(
    merged_runs, tmp_path: Path
) -> None:
    root, _ = merged_runs
    directory = tmp_path / "chain"
    shutil.copytree(root / "pristine" / "exponent", directory)
    expected = _tables(directory, HEAD)
    folder = directory / f"step_{HEAD:012d}"
    # A listed dense file that is a link to an unlisted one in the same folder.
    (folder / "dense" / "model.safetensors").rename(folder / "dense" / "real.safetensors")
    (folder / "dense" / "model.safetensors").symlink_to("real.safetensors")
    # Debris of a merge killed before its commit.
    (folder / "merged" / "tables" / "t_x").mkdir(parents=True)
    (folder / "merged" / "tables" / "t_x" / "r0_c0.s2.f0.parquet").write_bytes(b"half")
    (folder / "MANIFEST.json.tmp-dead").write_bytes(b"{")
    merged = merge(CheckpointStore(directory), HEAD)
    on_disk = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    listed = {f.path for f in merged.files} | {MANIFEST_NAME}
    assert on_disk == listed | {"dense/real.safetensors"}
    assert not (folder / "merged" / "tables" / "t_x").exists()
    assert verify(CheckpointStore(directory)).ok
    assert _same(_tables(directory, HEAD), expected)


class _KillingFs:
    """A filesystem that SIGKILLs this process at its nth ``delete_file``."""

    def __init__(self, fs: Any, nth: int) -> None:
        self._fs, self._left = fs, nth

    def delete_file(self, path: str) -> None:
        self._fs.delete_file(path)
        self._left -= 1
        if self._left == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


def _merge_and_die(directory: str, step: int, point: str, nth: int, started: Any) -> None:
    """Child process: merges ``step``, SIGKILLed at the nth ``point`` ("none": not at all);
    sets the event ``started`` as the merge starts.

    file: after a new rows file is written; partial: half-way through writing one (a
    temporary file left behind); manifest: just before the new manifest's rename;
    delete: after deleting a replaced file (the new manifest is committed).
    """
    store = CheckpointStore(directory)
    count = {"n": 0}

    def hit() -> bool:
        count["n"] += 1
        return count["n"] == nth

    write_file, write_atomic = store.write_file, store.write_atomic

    def file_then_die(step: int, relative: str, data: Any, *checksum: Any, **timing: Any) -> Any:
        written = write_file(step, relative, data, *checksum, **timing)
        if point == "file" and hit():
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    def atomic(path: str, data: Any, **timing: Any) -> None:
        is_manifest = path.endswith(MANIFEST_NAME)
        if point == "partial" and not is_manifest and hit():
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(f"{path}.tmp-killed", "wb") as out:
                out.write(bytes(memoryview(data))[: len(memoryview(data)) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        if point == "manifest" and is_manifest and hit():
            os.kill(os.getpid(), signal.SIGKILL)
        write_atomic(path, data, **timing)

    store.write_file = file_then_die  # type: ignore[method-assign]
    store.write_atomic = atomic  # type: ignore[method-assign]
    if point == "delete":
        store.fs = _KillingFs(store.fs, nth)
    started.set()
    merge(store, step)


KILLS = (("file", 1), ("file", 4), ("partial", 2), ("manifest", 1), ("delete", 1), ("delete", 6))


@pytest.mark.parametrize("name", KEPT)
def test_merge_killed_at_any_point_leaves_the_step_restorable(
    merged_runs, tmp_path: Path, name: str
) -> None:
    root, _ = merged_runs
    pristine = root / "pristine" / name
    expected = {step: _tables(pristine, step) for step in (HEAD, LATER)}
    ctx = rank_context()

    def run(directory: Path, point: str, nth: int, delay: float | None = None) -> tuple:
        """The child's exit code and the seconds from the start of its merge to its end."""
        shutil.copytree(pristine, directory)
        merging = ctx.Event()  # timed from the merge's start: a kill lands inside the merge
        child = ctx.Process(target=_merge_and_die, args=(str(directory), HEAD, point, nth, merging))
        child.start()
        assert merging.wait(120), f"{directory.name}: the merge never started"
        started = time.perf_counter()
        if delay is not None:
            time.sleep(delay)
            child.kill()  # SIGKILL, unless it already finished
        child.join(120)
        return child.exitcode, time.perf_counter() - started

    def check(directory: Path, where: str) -> None:
        store = CheckpointStore(directory)
        assert verify(store).ok, (where, verify(store).problems)
        for step, tables in expected.items():
            assert _same(_tables(directory, step), tables), (where, step)

    code, duration = run(tmp_path / "complete", "none", 0)
    assert code == 0
    check(tmp_path / "complete", "complete")
    trials = [(f"{p}{n}", p, n, None) for p, n in KILLS]
    rng = random.Random(0)
    trials += [(f"timed{i}", "none", 0, rng.uniform(0, duration)) for i in range(4)]
    for label, point, nth, delay in trials:
        directory = tmp_path / label
        code, _ = run(directory, point, nth, delay)
        if delay is None:
            assert code == -signal.SIGKILL, (label, code)  # the kill point was reached
        check(directory, label)
    # A merge after a killed one completes and leaves no debris in the step folder.
    last = tmp_path / trials[-1][0]
    merged = merge(CheckpointStore(last), HEAD)
    folder = last / f"step_{HEAD:012d}"
    on_disk = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    assert on_disk == {f.path for f in merged.files} | {MANIFEST_NAME}
    check(last, "merged after a kill")
