"""Tests of the fault-injecting filesystem (tests/faultfs.py): it must pass data through intact
when no fault is planned, and fail exactly the planned calls, leaving nothing half-written."""

from __future__ import annotations

import inspect
import pickle
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from faultfs import TMP_MARKER, FaultPlan, FaultyHandler, LogEntry, faulty_filesystem

from embckpt.errors import CheckpointCorruptError
from embckpt.storage.fs import CheckpointStore


def _put(fs: pafs.FileSystem, path: Path | str, data: bytes) -> None:
    """Writes as CheckpointStore does on an object store: one stream, one write, close."""
    with fs.open_output_stream(str(path)) as out:
        out.write(data)


def _get(fs: pafs.FileSystem, path: Path | str) -> bytes:
    with fs.open_input_file(str(path)) as src:
        return src.read_buffer().to_pybytes()


def _store(fs: pafs.FileSystem, root: Path) -> CheckpointStore:
    """A store without write retries, whether or not this CheckpointStore has them."""
    kwargs: dict[str, Any] = {}
    if "write_retries" in inspect.signature(CheckpointStore).parameters:
        kwargs["write_retries"] = 0
    return CheckpointStore(str(root), filesystem=fs, **kwargs)


# -- pass-through -----------------------------------------------------------------------------
def test_round_trip_listing_and_delete(tmp_path: Path) -> None:
    fs = pafs.PyFileSystem(FaultyHandler())
    fs.create_dir(str(tmp_path / "d" / "sub"), recursive=True)
    payload = bytes(range(256)) * 1000
    _put(fs, tmp_path / "d" / "a.bin", payload)
    _put(fs, tmp_path / "d" / "sub" / "b.bin", b"bee")

    assert _get(fs, tmp_path / "d" / "a.bin") == payload
    assert (tmp_path / "d" / "a.bin").read_bytes() == payload  # really on the base filesystem
    with fs.open_input_file(str(tmp_path / "d" / "a.bin")) as src:
        assert src.size() == len(payload)
        assert src.read_at(4, 300) == payload[300:304]
        src.seek(1000)
        assert src.read(3) == payload[1000:1003]
    with fs.open_input_stream(str(tmp_path / "d" / "sub" / "b.bin")) as src:
        assert src.read() == b"bee"

    infos = fs.get_file_info(pafs.FileSelector(str(tmp_path / "d"), recursive=True))
    found = {Path(info.path).relative_to(tmp_path).as_posix(): info.type for info in infos}
    assert found == {
        "d/a.bin": pafs.FileType.File,
        "d/sub": pafs.FileType.Directory,
        "d/sub/b.bin": pafs.FileType.File,
    }
    [info] = fs.get_file_info([str(tmp_path / "d" / "a.bin")])
    assert info.size == len(payload)

    fs.move(str(tmp_path / "d" / "a.bin"), str(tmp_path / "d" / "c.bin"))
    fs.copy_file(str(tmp_path / "d" / "c.bin"), str(tmp_path / "d" / "e.bin"))
    assert _get(fs, tmp_path / "d" / "e.bin") == payload
    fs.delete_file(str(tmp_path / "d" / "c.bin"))
    assert not (tmp_path / "d" / "c.bin").exists()
    fs.delete_dir_contents(str(tmp_path / "d" / "sub"))
    assert list((tmp_path / "d" / "sub").iterdir()) == []
    fs.delete_dir(str(tmp_path / "d"))
    assert not (tmp_path / "d").exists()


def test_append_and_type_name(tmp_path: Path) -> None:
    fs, handler = faulty_filesystem()
    with fs.open_append_stream(str(tmp_path / "log")) as out:
        out.write(b"one,")
    with fs.open_append_stream(str(tmp_path / "log")) as out:
        out.write(b"two")
    assert (tmp_path / "log").read_bytes() == b"one,two"
    assert handler.writes == 2
    assert fs.type_name.endswith("faulty+local")


def test_a_write_appears_only_when_closed(tmp_path: Path) -> None:
    """Like an object store's PUT: nothing under the name, nor in listings, before close."""
    fs, _ = faulty_filesystem()
    target = tmp_path / "obj"
    out = fs.open_output_stream(str(target))
    out.write(b"partial")
    assert not target.exists()
    assert fs.get_file_info(str(target)).type == pafs.FileType.NotFound
    assert fs.get_file_info(pafs.FileSelector(str(tmp_path))) == []
    assert any(TMP_MARKER in p.name for p in tmp_path.iterdir())  # the upload is in progress
    out.close()
    assert target.read_bytes() == b"partial"
    assert [p.name for p in tmp_path.iterdir()] == ["obj"]


def test_no_plan_injects_nothing_and_counts(tmp_path: Path) -> None:
    fs, handler = faulty_filesystem()
    for i in range(5):
        _put(fs, tmp_path / f"f{i}", b"x" * i)
    for i in range(5):
        assert _get(fs, tmp_path / f"f{i}") == b"x" * i
    assert (handler.writes, handler.reads) == (5, 5)
    assert (handler.write_faults, handler.read_faults) == (0, 0)
    assert not any(entry.injected for entry in handler.log)
    assert handler.log[0] == LogEntry("open_output_stream", str(tmp_path / "f0"), False)


# -- planned faults ---------------------------------------------------------------------------
@pytest.mark.parametrize("fail_at", ["open", "close"])
def test_fail_writes_fails_exactly_the_second_write(tmp_path: Path, fail_at: str) -> None:
    fs, handler = faulty_filesystem(FaultPlan(fail_writes={1}, fail_at=fail_at))  # type: ignore[arg-type]
    _put(fs, tmp_path / "a", b"first")
    with pytest.raises(OSError, match=r"injected fault: 503 Slow Down \(write #1 of .*/b\)"):
        _put(fs, tmp_path / "b", b"second" * 1000)
    _put(fs, tmp_path / "c", b"third")

    assert not (tmp_path / "b").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "c"]  # no temporary left over
    assert (tmp_path / "a").read_bytes() == b"first"
    assert (tmp_path / "c").read_bytes() == b"third"
    assert (handler.writes, handler.write_faults) == (3, 1)
    assert [entry.injected for entry in handler.log] == [False, True, False]


def test_a_write_failed_at_close_accepts_bytes_then_raises(tmp_path: Path) -> None:
    fs, handler = faulty_filesystem(FaultPlan(fail_writes={0}, fail_at="close"))
    out = fs.open_output_stream(str(tmp_path / "x"))  # opening succeeds...
    out.write(b"a" * 10)
    out.write(pa.py_buffer(b"b" * 5))
    assert out.tell() == 15
    with pytest.raises(OSError, match="write #0"):  # ...the completion fails
        out.close()
    assert list(tmp_path.iterdir()) == []
    assert handler.write_faults == 1


def test_a_failed_overwrite_keeps_the_previous_object(tmp_path: Path) -> None:
    fs, _ = faulty_filesystem(FaultPlan(fail_writes={1}, fail_at="close"))
    _put(fs, tmp_path / "x", b"old")
    with pytest.raises(OSError):
        _put(fs, tmp_path / "x", b"new")
    assert (tmp_path / "x").read_bytes() == b"old"


def test_fail_reads_fails_at_open(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"aaa")
    fs, handler = faulty_filesystem(FaultPlan(fail_reads={0, 2}))
    with pytest.raises(OSError, match=r"read #0 of .*/a"):
        fs.open_input_file(str(tmp_path / "a"))
    assert _get(fs, tmp_path / "a") == b"aaa"
    with pytest.raises(OSError, match="read #2"):
        fs.open_input_stream(str(tmp_path / "a"))
    assert _get(fs, tmp_path / "a") == b"aaa"
    assert (handler.reads, handler.read_faults, handler.writes) == (4, 2, 0)
    assert (tmp_path / "a").read_bytes() == b"aaa"  # a failed read changes nothing


def test_match_filters_which_calls_count(tmp_path: Path) -> None:
    plan = FaultPlan(fail_writes={0}, write_match="MANIFEST", fail_reads={1}, read_match=".bin")
    fs, handler = faulty_filesystem(plan)
    _put(fs, tmp_path / "a.bin", b"1")  # not counted as a write: would be #0 otherwise
    _put(fs, tmp_path / "b.bin", b"2")
    with pytest.raises(OSError, match=r"write #0 of .*/MANIFEST\.json"):
        _put(fs, tmp_path / "MANIFEST.json", b"{}")
    _put(fs, tmp_path / "MANIFEST.json", b"{}")  # counted as #1: goes through
    assert handler.writes == 2

    assert _get(fs, tmp_path / "MANIFEST.json") == b"{}"  # not counted as a read
    assert _get(fs, tmp_path / "a.bin") == b"1"  # read #0
    with pytest.raises(OSError, match=r"read #1 of .*/b\.bin"):
        _get(fs, tmp_path / "b.bin")
    assert (handler.reads, handler.read_faults, handler.write_faults) == (2, 1, 1)


def test_plan_changes_and_reset(tmp_path: Path) -> None:
    fs, handler = faulty_filesystem()
    _put(fs, tmp_path / "a", b"a")
    handler.plan = FaultPlan(fail_writes={1})  # indices keep counting: the next write is #1
    with pytest.raises(OSError, match="write #1"):
        _put(fs, tmp_path / "b", b"b")
    handler.reset()
    assert (handler.writes, handler.write_faults, handler.log) == (0, 0, [])
    _put(fs, tmp_path / "c", b"c")  # #0
    with pytest.raises(OSError, match="write #1"):
        _put(fs, tmp_path / "d", b"d")
    handler.reset(FaultPlan())
    _put(fs, tmp_path / "d", b"d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "c", "d"]


def test_plan_validation() -> None:
    with pytest.raises(ValueError, match="fail_at"):
        FaultPlan(fail_at="middle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="write_probability"):
        FaultPlan(write_probability=1.5)
    with pytest.raises(ValueError, match="0-based"):
        FaultPlan(fail_writes={-1})
    plan = FaultPlan(fail_writes=[3, 1], fail_reads=range(2))  # type: ignore[arg-type]
    assert plan.fail_writes == frozenset({1, 3}) and plan.fail_reads == frozenset({0, 1})
    assert hash(plan) == hash(FaultPlan(fail_writes={1, 3}, fail_reads={0, 1}))


# -- random mode ------------------------------------------------------------------------------
def _random_run(root: Path, seed: int) -> tuple[list[bool], list[bool]]:
    root.mkdir()
    fs, handler = faulty_filesystem(FaultPlan.random(seed, write_p=0.3, read_p=0.3))
    for i in range(60):
        try:
            _put(fs, root / f"f{i}", b"x")
        except OSError:
            pass
    for i in range(60):
        try:
            _get(fs, root / "f0" if i % 2 else root / f"f{i}")
        except OSError:
            pass
    writes = [e.injected for e in handler.log if e.op == "open_output_stream"]
    reads = [e.injected for e in handler.log if e.op == "open_input_file"]
    assert handler.write_faults == sum(writes) and handler.read_faults == sum(reads)
    return writes, reads


def test_random_mode_is_reproducible(tmp_path: Path) -> None:
    first = _random_run(tmp_path / "one", seed=7)
    assert first == _random_run(tmp_path / "two", seed=7)
    other = _random_run(tmp_path / "three", seed=8)
    assert first != other
    for decisions in (*first, *other):
        assert len(decisions) == 60
        assert 5 <= sum(decisions) <= 35  # about 30% fail: neither none nor all
    # the files whose writes failed are absent, the others present
    present = [(tmp_path / "one" / f"f{i}").exists() for i in range(60)]
    assert present == [not failed for failed in first[0]]


def test_random_decisions_do_not_depend_on_interleaving() -> None:
    plan = FaultPlan.random(3, write_p=0.5, read_p=0.5)
    writes = [plan.decides_fault("write", i) for i in range(200)]
    assert writes == [FaultPlan.random(3, 0.5, 0.5).decides_fault("write", i) for i in range(200)]
    assert 50 < sum(writes) < 150
    assert writes != [plan.decides_fault("read", i) for i in range(200)]
    assert not any(FaultPlan.random(3, 0.0, 0.0).decides_fault("write", i) for i in range(200))
    assert all(FaultPlan.random(3, 1.0, 1.0).decides_fault("read", i) for i in range(200))


# -- concurrency and pickling -----------------------------------------------------------------
def test_concurrent_writes_get_distinct_indices(tmp_path: Path) -> None:
    fs, handler = faulty_filesystem(FaultPlan(fail_writes=range(0, 200, 4)))
    errors: list[OSError] = []

    def worker(k: int) -> None:
        for i in range(25):
            try:
                _put(fs, tmp_path / f"w{k}_{i}", b"z")
            except OSError as exc:
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert handler.writes == 200
    assert handler.write_faults == len(errors) == 50
    assert len(list(tmp_path.iterdir())) == 150


def test_pickled_filesystem_keeps_plan_with_fresh_counters(tmp_path: Path) -> None:
    fs, handler = faulty_filesystem(FaultPlan(fail_writes={0}))
    with pytest.raises(OSError):
        _put(fs, tmp_path / "a", b"a")
    copy = pickle.loads(pickle.dumps(fs))
    assert isinstance(copy, pafs.PyFileSystem) and copy.equals(fs)
    copy_handler = copy.handler
    assert copy_handler is not handler and copy_handler.plan == handler.plan
    assert copy_handler.writes == 0
    with pytest.raises(OSError, match="write #0"):  # its own count starts at 0
        _put(copy, tmp_path / "a", b"a")
    _put(copy, tmp_path / "a", b"a")
    assert not fs.equals(faulty_filesystem(FaultPlan(fail_writes={5}))[0])


# -- with embckpt's storage layer and parquet -------------------------------------------------
def test_checkpoint_store_round_trip(tmp_path: Path) -> None:
    fs, handler = faulty_filesystem()
    store = _store(fs, tmp_path / "ckpt")
    assert not store.is_local  # treated as an object store: one PUT per file
    store.create_root()
    written = store.write_file(1, "dense/x.bin", b"abc")
    assert store.read_file(1, "dense/x.bin").to_pybytes() == b"abc"
    assert store.read_checked(1, written).to_pybytes() == b"abc"
    assert (tmp_path / "ckpt" / "step_000000000001" / "dense" / "x.bin").read_bytes() == b"abc"
    assert store.leftover_steps() == [1]  # listed through FileSelector
    assert handler.writes == 1 and handler.reads == 2


@pytest.mark.parametrize("fail_at", ["open", "close"])
def test_checkpoint_store_write_fault(tmp_path: Path, fail_at: str) -> None:
    plan = FaultPlan(fail_writes={0}, write_match="x.bin", fail_at=fail_at)  # type: ignore[arg-type]
    fs, handler = faulty_filesystem(plan)
    store = _store(fs, tmp_path / "ckpt")
    store.create_root()
    with pytest.raises(OSError, match="injected fault"):
        store.write_file(1, "dense/x.bin", b"abc")
    assert handler.write_faults == 1
    assert not (tmp_path / "ckpt" / "step_000000000001" / "dense" / "x.bin").exists()
    with pytest.raises(CheckpointCorruptError):  # missing, so unreadable
        store.read_file(1, "dense/x.bin")
    store.write_file(1, "dense/x.bin", b"abc")  # write #1: goes through
    assert store.read_file(1, "dense/x.bin").to_pybytes() == b"abc"


def test_checkpoint_store_read_fault(tmp_path: Path) -> None:
    fs, handler = faulty_filesystem(FaultPlan(fail_reads={0}))
    store = _store(fs, tmp_path / "ckpt")
    store.create_root()
    store.write_file(1, "dense/x.bin", b"abc")
    # CheckpointStore.read_file reports unreadable files as corrupt, naming the cause.
    with pytest.raises((OSError, CheckpointCorruptError), match="injected fault"):
        store.read_file(1, "dense/x.bin")
    assert store.read_file(1, "dense/x.bin").to_pybytes() == b"abc"
    assert handler.read_faults == 1


def test_parquet_through_the_filesystem(tmp_path: Path) -> None:
    fs, handler = faulty_filesystem()
    table = pa.table(
        {"id": pa.array(range(1000), pa.int64()), "v": [float(i) for i in range(1000)]}
    )
    path = str(tmp_path / "t.parquet")
    pq.write_table(table, path, filesystem=fs, row_group_size=100)
    assert pq.read_table(path, filesystem=fs).equals(table)
    assert pq.ParquetFile(fs.open_input_file(path)).metadata.num_row_groups == 10
    assert handler.writes == 1 and handler.reads >= 2

    handler.reset(FaultPlan(fail_writes={0}, fail_at="close"))
    with pytest.raises(OSError, match="injected fault"):
        pq.write_table(table, str(tmp_path / "u.parquet"), filesystem=fs)
    assert not (tmp_path / "u.parquet").exists()
    handler.reset(FaultPlan(fail_reads={0}))
    with pytest.raises(OSError, match="injected fault"):
        pq.read_table(path, filesystem=fs)


def test_checkpoint_store_retries_ride_out_faults(tmp_path: Path) -> None:
    """With retries (when CheckpointStore has them), a write failing twice is tried again."""
    if "write_retries" not in inspect.signature(CheckpointStore).parameters:
        pytest.skip("this CheckpointStore does not retry writes")
    fs, handler = faulty_filesystem(FaultPlan(fail_writes={0, 1}, fail_at="close"))
    store = CheckpointStore(
        str(tmp_path / "ckpt"), filesystem=fs, write_retries=2, retry_backoff_s=0
    )
    store.write_file(1, "dense/x.bin", b"abc")
    assert (handler.writes, handler.write_faults) == (3, 2)
    assert store.read_file(1, "dense/x.bin").to_pybytes() == b"abc"


# -- a whole Checkpointer on 2 ranks ----------------------------------------------------------
def _save_through(rank: int, world_size: int, fs: pafs.PyFileSystem, root: str) -> dict:
    import toy_model as tm

    from embckpt import CheckpointConfig, Checkpointer

    handler = fs.handler  # this process's own copy: its counters are this rank's calls
    out: dict[str, Any] = {}
    model, opt = tm.build(world_size, seed=0)
    config = CheckpointConfig(policy="one_shot", full_every=0)
    with Checkpointer(model, root, optimizer=opt, config=config, filesystem=fs) as ckpt:
        for step in range(1, 11):
            tm.train_step(model, opt, step, rank, hot=80)
            if step % 5 == 0:
                ckpt.save(step).wait()
        saved_10 = tm.snapshot_state(model, opt, rank)
        out["writes"] = handler.writes
        # Every write of step 15 fails, retries included: the save must fail and leave no step.
        handler.reset(FaultPlan(write_probability=1.0, write_match="step_000000000015"))
        for step in range(11, 16):
            tm.train_step(model, opt, step, rank, hot=80)
        try:
            ckpt.save(15).wait()
            out["save_15"] = None
        except Exception as exc:  # SaveError on the rank that failed, a quote on the other
            out["save_15"] = str(exc)
        out["write_faults"] = handler.write_faults
        handler.reset(FaultPlan())
    fresh, fresh_opt = tm.build(world_size, seed=3)
    out["differences_before"] = tm.differences(saved_10, tm.snapshot_state(fresh, fresh_opt, rank))
    with Checkpointer(fresh, root, optimizer=fresh_opt, config=config, filesystem=fs) as ckpt:
        out["restored"] = ckpt.restore()
        # Compared here: tensors sent back to the parent would race with this process's exit.
        out["differences"] = tm.differences(saved_10, tm.snapshot_state(fresh, fresh_opt, rank))
        out["reads"] = handler.reads
        out["committed"] = ckpt.store.committed_steps()
    return out


def test_checkpointer_through_faulty_filesystem(tmp_path: Path) -> None:
    from embckpt.examples.launcher import run_ranks

    fs, _ = faulty_filesystem()
    results = run_ranks(_save_through, 2, fs, str(tmp_path / "job"))
    for out in results:
        assert out["writes"] > 0 and out["reads"] > 0  # the ranks really went through fs
        assert out["save_15"] is not None and "injected fault" in out["save_15"]
        assert out["restored"] == 10
        assert out["committed"] == [5, 10]
        assert out["differences_before"] != [] and out["differences"] == []
    assert sum(out["write_faults"] for out in results) >= 1
    assert not (tmp_path / "job" / "step_000000000015" / "MANIFEST.json").exists()
