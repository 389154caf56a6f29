"""Streamed rows files and the staging budget: a save streams each Parquet file into its
destination (``storage/sink.py``), indexes it on the way, and counts its encoded buffers against
``staging_budget_bytes``; a stream failing part-way leaves nothing under the file's name and the
previous checkpoint restorable."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
import toy_model as tm
from faultfs import TMP_MARKER, FaultPlan, faulty_filesystem

from embckpt.codecs import make_codec
from embckpt.examples.launcher import run_ranks
from embckpt.storage import rowfile_write as rw
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.sink import ChecksumSink, StreamedFile


def _block(n: int, table: str = "t", codec: str = "raw") -> rw.BlockColumns:
    rows = np.arange(n, dtype=np.int64) * 3
    states = {"momentum1": np.random.rand(n).astype(np.float32)}
    encoded = make_codec(codec).encode(torch.randn(n, 8))
    return rw.block_columns(rows, encoded, states, {}, {"table": table, "cols": 8})


@pytest.mark.parametrize("rows", [1, 100, 1024, 5000])
def test_a_streamed_file_is_the_in_memory_file_and_its_index(rows: int) -> None:
    block = _block(rows)
    data = rw.encode_block(block, 1024)
    out = pa.BufferOutputStream()
    streamed = rw.RowsFile([block], 1024)
    streamed.write_to(ChecksumSink(out.write))
    assert out.getvalue().equals(data)
    assert streamed.index == rw.index_file(data)
    assert (streamed.size, streamed.checksum) == (data.size, rw.index_file(data).file_checksum)


def test_a_streamed_packed_file_is_the_in_memory_one() -> None:
    blocks = [_block(300, "a"), _block(2000, "b"), _block(5, "c")]
    data = rw.encode_packed(blocks, 1024)
    out = pa.BufferOutputStream()
    streamed = rw.RowsFile(blocks, 1024, packed=True)
    streamed.write_to(ChecksumSink(out.write))
    assert out.getvalue().equals(data)
    assert streamed.index == rw.index_file(data)


class _Failing(StreamedFile):
    """Streams ``inner`` but raises ``error`` once ``after`` bytes went through, ``times``
    times (then streams whole)."""

    def __init__(self, inner: StreamedFile, error: BaseException, times: int = 1) -> None:
        self.inner, self.error, self.times = inner, error, times
        self.attempts = 0

    def produce(self, sink: ChecksumSink) -> None:
        self.attempts += 1
        if self.attempts > self.times:
            self.inner.produce(sink)
            return
        write = sink.write

        def failing(data: Any) -> int:
            written = write(data)
            if sink.tell() > 4:
                raise self.error
            return written

        sink.write = failing  # type: ignore[method-assign]
        self.inner.produce(sink)


def _stores(tmp_path: Path) -> list[CheckpointStore]:
    fs, _ = faulty_filesystem(FaultPlan())  # an object store: no temporary names, one PUT
    return [
        CheckpointStore(tmp_path / "local", retry_backoff_s=0),
        CheckpointStore(str(tmp_path / "object"), filesystem=fs, retry_backoff_s=0),
    ]


@pytest.mark.parametrize("kind", ["local", "object"])
def test_a_stream_failing_part_way_is_retried_from_its_start(tmp_path: Path, kind: str) -> None:
    store = _stores(tmp_path)[kind == "object"]
    block = _block(3000)
    streamed = _Failing(rw.RowsFile([block], 1024), OSError("injected: connection reset"), 2)
    written = store.write_file(1, "tables/t/r0.parquet", streamed)
    assert streamed.attempts == 3
    data = rw.encode_block(block, 1024)
    assert (written.bytes, written.checksum) == (data.size, rw.index_file(data).file_checksum)
    assert store.read_file(1, "tables/t/r0.parquet").equals(data)
    assert sorted(os.listdir(store.step_path(1, "tables/t"))) == ["r0.parquet"]


@pytest.mark.parametrize("kind", ["local", "object"])
def test_a_stream_failing_for_good_leaves_nothing(tmp_path: Path, kind: str) -> None:
    store = _stores(tmp_path)[kind == "object"]
    store.write_file(1, "tables/t/r0.parquet", b"the previous file")
    for error in (OSError(28, "No space left on device"), ValueError("encoding failed")):
        streamed = _Failing(rw.RowsFile([_block(3000)], 1024), error, times=99)
        with pytest.raises(type(error)):
            store.write_file(1, "tables/t/r0.parquet", streamed)
        assert streamed.attempts == 1  # neither is retried
        folder = store.step_path(1, "tables/t")
        assert sorted(os.listdir(folder)) == ["r0.parquet"], "a temporary file was left"
        assert store.read_file(1, "tables/t/r0.parquet").to_pybytes() == b"the previous file"
        assert not any(TMP_MARKER in name for name in os.listdir(folder))


BUDGET = 48 << 10  # a few hundred toy rows: several pieces and files per save


def _within_budget(rank: int, world_size: int, root: str, codec: str, pipeline: str) -> dict:
    from embckpt import CheckpointConfig, Checkpointer

    config = CheckpointConfig(
        policy="one_shot",
        full_every=2,
        codec=codec,
        staging_budget_bytes=BUDGET,
        pack_below_bytes=0,
        row_group_rows=64,
        pipeline=pipeline,
    )
    model, opt = tm.build(world_size, seed=0)
    out: dict = {"peaks": [], "capacity": [], "files": [], "allocations": []}
    with Checkpointer(model, root, optimizer=opt, config=config) as ckpt:
        # The arena stages piece by piece ("persist"); copy-on-write saves use slabs ("full").
        arena = ckpt._saver.arena if pipeline == "persist" else ckpt._saver.slabs
        allocations: list[int] = []
        if pipeline == "persist":
            allocate = arena._allocate

            def counted(nbytes: int) -> Any:
                allocations.append(nbytes)
                return allocate(nbytes)

            arena._allocate = counted  # type: ignore[method-assign]
        for step in (1, 2):
            tm.train_step(model, opt, step, rank, hot=100)
            manifest = ckpt.save(step).wait()
            made = len(allocations) if pipeline == "persist" else len(arena._made)
            out["allocations"].append(made)
            out["peaks"].append(arena.peak_bytes)
            out["capacity"].append(arena.capacity)
            out["held_after"] = arena.held_bytes
            out["files"].append(sum(f.rank == rank and f.role == "rows" for f in manifest.files))
        saved = tm.snapshot_state(model, opt, rank)
        fresh, fresh_opt = tm.build(world_size, seed=5)
    with Checkpointer(fresh, root, optimizer=fresh_opt, config=config) as other:
        out["restored"] = other.restore()
    if codec == "raw":
        out["diff"] = tm.differences(saved, tm.snapshot_state(fresh, fresh_opt, rank))
    return out


@pytest.mark.parametrize("pipeline", ["full", "persist"])
@pytest.mark.parametrize("codec", ["raw", "asymmetric"])
def test_a_save_counts_its_encoded_buffers_within_the_staging_budget(
    tmp_path: Path, codec: str, pipeline: str
) -> None:
    """Staged rows and the encoded columns of the files being written (a lossless codec's
    views of the staging memory are not counted twice; a quantizing codec's codes are new
    buffers) together stay within the budget, in saves of many pieces and files: the arena's
    pieces ("persist") and the copy-on-write slabs ("full", the default)."""
    results = run_ranks(_within_budget, 2, str(tmp_path / codec), codec, pipeline)
    for rank, out in enumerate(results):
        assert out["restored"] == 2, rank
        assert out.get("diff", []) == [], rank
        assert out["held_after"] == 0, rank  # every held buffer was released
        for peak, capacity in zip(out["peaks"], out["capacity"], strict=True):
            low = capacity if pipeline == "persist" else 0  # the arena's capacity and held
            assert low < peak <= BUDGET and capacity <= BUDGET, (rank, peak, capacity)
        assert out["files"][0] > 4, rank  # the full went in several files
        # The arena is allocated once, by the first save, and reused (test_pipeline's
        # test_the_arena_grows_once_to_the_largest_piece covers pieces that grow); slabs
        # are made by the first save and reused by the next.
        assert out["allocations"][0] > 0 and out["allocations"][1] == out["allocations"][0]


def _fails_mid_stream(rank: int, world_size: int, root: str) -> dict:
    from embckpt import CheckpointConfig, Checkpointer, SaveError

    config = CheckpointConfig(policy="full", pack_below_bytes=0, write_retries=0)
    model, opt = tm.build(world_size, seed=0)
    out: dict = {}
    with Checkpointer(model, root, optimizer=opt, config=config) as ckpt:
        tm.train_step(model, opt, 1, rank, hot=100)
        ckpt.save(1).wait()
        at_1 = tm.snapshot_state(model, opt, rank)
        store = ckpt.store
        write_file = store.write_file

        def failing(step: int, relative: str, data: Any, *args: Any, **kwargs: Any) -> Any:
            if rank == 1 and isinstance(data, StreamedFile):
                data = _Failing(data, OSError(5, "Input/output error"), times=1)
            return write_file(step, relative, data, *args, **kwargs)

        store.write_file = failing  # type: ignore[method-assign]
        tm.train_step(model, opt, 2, rank, hot=100)
        try:
            ckpt.save(2).wait()
        except SaveError as exc:
            out["error"] = str(exc)
        store.write_file = write_file  # type: ignore[method-assign]
        # Rank 0 deletes the failed step's folder before its own wait() raises: list after it.
        torch.distributed.barrier()
        out["committed"] = store.committed_steps()
        out["debris"] = sorted(str(p) for p in Path(root).rglob("*") if ".tmp-" in p.name)
    fresh, fresh_opt = tm.build(world_size, seed=5)
    with Checkpointer(fresh, root, optimizer=fresh_opt, config=config) as other:
        out["restored"] = other.restore()
    out["diff"] = tm.differences(at_1, tm.snapshot_state(fresh, fresh_opt, rank))
    return out


def test_a_save_whose_stream_fails_part_way_keeps_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    results = run_ranks(_fails_mid_stream, 2, str(tmp_path / "ckpt"))
    for rank, out in enumerate(results):
        assert "Input/output error" in out.get("error", ""), rank
        assert out["committed"] == [1], rank
        assert out["debris"] == [], rank
        assert out["restored"] == 1 and out["diff"] == [], rank
