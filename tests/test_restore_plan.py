"""Newest-first restore planning (embckpt/read/plan.py, stage.py, apply.py) equals replaying
the chain in order.

Chains are written by hand: one table, every checkpoint under its own random writer plan (row
and column blocks), diffs of random overlapping rows, row-wise states, raw and additive codecs.
The reference replays them in chain order with numpy, following the "Restoring a step"
section of docs/ARCHITECTURE.md; the reader restores them onto random target blocks.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import delta_codec  # noqa: F401  (registers test_delta)
import numpy as np
import pytest
import torch

from embckpt.read import pool as pool_module
from embckpt.read.apply import apply_staged, read_into
from embckpt.read.plan import plan_reads
from embckpt.read.pool import INLINE_BYTES
from embckpt.read.stage import stage
from embckpt.sharding import TableShard
from embckpt.storage.chain import read_chain
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import MANIFEST_NAME
from embckpt.storage.manifest import FileEntry, Manifest, TableEntry
from embckpt.storage.phases import RESTORE_PHASES, PhaseClock
from embckpt.storage.rowfile_write import encode_file, index_file

ROWS, COLS = 61, 8
STATE = "momentum"


def _cuts(rng: np.random.Generator, size: int, most: int) -> list[int]:
    inner = rng.choice(np.arange(1, size), size=int(rng.integers(0, most)), replace=False)
    return [0, *sorted(int(c) for c in inner), size]


def _write_chain(
    root: Path, rng: np.random.Generator, length: int, codecs: list[str], group_rows: int
) -> list[tuple[int, int, int, int, np.ndarray, np.ndarray, np.ndarray, bool]]:
    """Writes a chain of ``length`` checkpoints; returns every file as (checkpoint, row_offset,
    col_offset, cols, rows, weights, states, delta), in chain order."""
    from embckpt import dense
    from embckpt.codecs import make_codec

    store = CheckpointStore(root, fsync=False)
    empty_dense = dense.encode_tree({"model": {}, "optimizer": None, "fused_scalars": {}})
    written = []
    parent = None
    for position in range(length):
        step = position + 1
        codec = make_codec(codecs[position])
        row_cuts, col_cuts = _cuts(rng, ROWS, 3), _cuts(rng, COLS, 2)
        blocks = [
            (r0, c0, r1 - r0, c1 - c0)
            for r0, r1 in zip(row_cuts, row_cuts[1:], strict=False)
            for c0, c1 in zip(col_cuts, col_cuts[1:], strict=False)
        ]
        files = []
        for r0, c0, nr, nc in blocks:
            if position == 0:
                rows = np.arange(r0, r0 + nr)
            elif rng.random() < 0.3:  # a whole run of rows: older row groups drop out
                lo = int(rng.integers(r0, r0 + nr))
                rows = np.arange(lo, min(r0 + nr, lo + 2 * group_rows))
            else:
                rows = np.sort(rng.choice(np.arange(r0, r0 + nr), int(rng.integers(1, nr + 1))))
                rows = np.unique(rows)
            weights = torch.randn(len(rows), nc)
            states = rng.standard_normal(len(rows)).astype(np.float32)
            data = encode_file(
                rows=rows.astype(np.int64),
                encoded=codec.encode(weights),
                row_states={STATE: states},
                elem_states={},
                metadata={"codec": codec.get_config(), "state_codec": {"id": "raw"}},
                row_group_rows=group_rows,
            )
            w = store.write_file(step, f"tables/t/r{r0}_c{c0}.p0.parquet", data)
            entry = FileEntry(
                w.path, w.bytes, w.checksum, "rows", 0, "t", r0, c0, nr, nc, len(rows)
            )
            files.append(replace(entry, fqn="t.weight", index=index_file(data)))
            written.append(
                (position, r0, c0, nc, rows, weights.numpy(), states, type(codec).additive)
            )
        d = store.write_file(step, "dense/model.safetensors", empty_dense)
        files.append(FileEntry(d.path, d.bytes, d.checksum, "dense", 0))
        table = TableEntry(
            "t", ROWS, COLS, "float32", "row_wise", (STATE,), (), tuple((0, *b) for b in blocks)
        )
        manifest = Manifest(
            step=step,
            kind="full" if parent is None else "diff",
            policy="incremental",
            base_step=1,
            parent_step=parent,
            world_size=1,
            codec=codec.get_config(),
            tables=(table,),
            files=tuple(sorted(files, key=lambda f: f.path)),
        )
        store.write_atomic(store.step_path(step, MANIFEST_NAME), manifest.to_json().encode())
        parent = step
    return written


def _targets(rng: np.random.Generator) -> list[TableShard]:
    shards = []
    row_cuts, col_cuts = _cuts(rng, ROWS, 3), _cuts(rng, COLS, 2)
    for r0, r1 in zip(row_cuts, row_cuts[1:], strict=False):
        for c0, c1 in zip(col_cuts, col_cuts[1:], strict=False):
            shards.append(
                TableShard(
                    table="t",
                    fqn="t.weight",
                    sharding_type="row_wise",
                    row_offset=r0,
                    col_offset=c0,
                    table_rows=ROWS,
                    table_cols=COLS,
                    weight=torch.full((r1 - r0, c1 - c0), 9.0),
                    row_states={STATE: torch.full((r1 - r0,), 5.0)},
                )
            )
    return shards


def _replay(written: list, shard: TableShard) -> tuple[np.ndarray, np.ndarray]:
    """The block's weights and row-wise states after applying the chain in order."""
    weights = np.zeros((ROWS, COLS), dtype=np.float32)
    for _, _, c0, nc, rows, values, _, delta in written:
        if delta:
            weights[rows, c0 : c0 + nc] += values
        else:
            weights[rows, c0 : c0 + nc] = values
    lo, hi = shard.col_offset, shard.col_offset + shard.num_cols
    r_lo, r_hi = shard.row_offset, shard.row_offset + shard.num_rows
    states = shard.row_states[STATE].numpy().copy()
    for position in sorted({w[0] for w in written}):
        total = np.zeros(shard.num_rows)
        weight = np.zeros(shard.num_rows)
        for pos, _, c0, nc, rows, _, values, _ in written:
            overlap = min(hi, c0 + nc) - max(lo, c0)
            if pos != position or overlap <= 0:
                continue
            inside = (rows >= r_lo) & (rows < r_hi)
            np.add.at(total, rows[inside] - r_lo, values[inside].astype(np.float64) * overlap)
            np.add.at(weight, rows[inside] - r_lo, np.full(int(inside.sum()), float(overlap)))
        held = np.greater(weight, 0.0)
        states[held] = (total[held] / weight[held]).astype(np.float32)
    return weights[r_lo:r_hi, lo:hi], states


@pytest.mark.parametrize("seed", range(12))
def test_newest_first_equals_chain_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    length = int(rng.integers(1, 6))
    delta = seed % 3 == 2
    codecs = ["raw"] + [
        "test_delta" if delta and rng.random() < 0.7 else "raw" for _ in range(length - 1)
    ]
    written = _write_chain(tmp_path, rng, length, codecs, group_rows=int(rng.integers(2, 6)))
    store = CheckpointStore(tmp_path)
    chain = read_chain(store, length)
    # One thread; three with the small files on the calling thread (the default); three with
    # the few smallest there and the rest on the threads (a budget of about one test file,
    # with cores to spare); three with every file on the threads (as files above
    # ``pool.INLINE_BYTES`` go).
    monkeypatch.setattr(pool_module, "rank_cores", lambda: 2)
    for threads, inline_bytes in ((1, INLINE_BYTES), (3, INLINE_BYTES), (3, 4096), (3, -1)):
        monkeypatch.setattr(pool_module, "INLINE_BYTES", inline_bytes)
        shards = _targets(rng)
        expected = [_replay(written, s) for s in shards]
        read_into(store, chain, shards, threads=threads)
        for shard, (weights, states) in zip(shards, expected, strict=True):
            assert np.array_equal(shard.weight.numpy().view(np.int32), weights.view(np.int32))
            assert np.array_equal(shard.row_states[STATE].numpy(), states), shard.key


def test_small_tasks_run_here_up_to_the_budget_the_rest_on_the_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With cores to spare, the calling thread takes the smallest tasks that may run there
    while they add up to at most ``INLINE_BYTES``; the others, and those that may not, go to
    the pool; with one core per rank it takes every small one. The futures come back in the
    tasks' order, with a task's error kept in its future."""
    import threading

    monkeypatch.setattr(pool_module, "INLINE_BYTES", 100)
    monkeypatch.setattr(pool_module, "rank_cores", lambda: 2)  # cores to spare: the budget holds

    def where(name: str) -> tuple[str, bool]:
        if name == "bad":
            raise ValueError("bad task")
        return name, threading.get_ident() == here

    here = threading.get_ident()
    sizes = {"a": 60, "b": 30, "c": 30, "d": 50, "remote": 10, "large": 500, "bad": 5}
    tasks = [
        (pool_module.inline_size(size, local=name != "remote"), where, (name,))
        for name, size in sizes.items()
    ]
    with pool_module.worker_pool(2, "test") as pool:
        futures = pool_module.submit_all(pool, tasks)
        with pytest.raises(ValueError, match="bad task"):
            futures[-1].result()
        ran = dict(f.result() for f in futures[:-1])
    assert list(ran) == ["a", "b", "c", "d", "remote", "large"]
    # bad (5), b (30), c (30) fit in 100; d (50) and a (60) would not.
    assert {name for name, inline in ran.items() if inline} == {"b", "c"}
    monkeypatch.setattr(pool_module, "rank_cores", lambda: 1)
    with pool_module.worker_pool(2, "test") as pool:
        futures = pool_module.submit_all(pool, tasks)
        ran = dict(f.result() for f in futures[:-1])
    assert {name for name, inline in ran.items() if inline} == {"a", "b", "c", "d"}


def test_row_groups_that_newer_diffs_replace_are_not_fetched(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    written = _write_chain(tmp_path, rng, 1, ["raw"], group_rows=4)
    store = CheckpointStore(tmp_path)
    # A diff rewriting rows [0, 16) whole: the full's first four row groups drop out.
    base = read_chain(store, 1)[0]
    from embckpt.codecs import make_codec

    codec = make_codec("raw")
    rows = np.arange(16)
    weights = torch.randn(16, COLS)
    states = np.ones(16, dtype=np.float32)
    data = encode_file(
        rows=rows,
        encoded=codec.encode(weights),
        row_states={STATE: states},
        elem_states={},
        metadata={"codec": codec.get_config(), "state_codec": {"id": "raw"}},
        row_group_rows=4,
    )
    w = store.write_file(2, "tables/t/r0_c0.p0.parquet", data)
    entry = FileEntry(w.path, w.bytes, w.checksum, "rows", 0, "t", 0, 0, ROWS, COLS, 16)
    dense_file = next(f for f in base.files if f.role == "dense")
    d = store.write_file(
        2, dense_file.path, (tmp_path / "step_000000000001" / dense_file.path).read_bytes()
    )
    table = replace(base.tables[0], shards=((0, 0, 0, ROWS, COLS),))
    diff = replace(
        base,
        step=2,
        kind="diff",
        parent_step=1,
        tables=(table,),
        files=(
            FileEntry(d.path, d.bytes, d.checksum, "dense", 0),
            replace(entry, fqn="t.weight", index=index_file(data)),
        ),
    )
    store.write_atomic(store.step_path(2, MANIFEST_NAME), diff.to_json().encode())
    chain = read_chain(store, 2)
    shards = _targets(np.random.default_rng(5))
    reads = plan_reads(chain, shards)
    planned = sum(len(r.groups or ()) for r in reads)
    clock = PhaseClock(RESTORE_PHASES)
    staged, cost = stage(store, len(chain), reads, threads=2, progress=False, clock=clock)
    apply_staged(staged, 2, clock)
    assert cost.row_groups < planned  # the full's groups of rows 0-15 were never fetched
    written.append((1, 0, 0, COLS, rows, weights.numpy(), states, False))
    for shard in shards:
        expected_weights, expected_states = _replay(written, shard)
        assert torch.equal(shard.weight, torch.from_numpy(expected_weights))
        assert np.array_equal(shard.row_states[STATE].numpy(), expected_states)
    seconds = clock.seconds()
    assert set(seconds) == {"plan", "fetch", "verify", "decode", "apply"}
    assert seconds["decode"] > 0 and seconds["apply"] > 0


@pytest.mark.parametrize("enabled", [True, False])
def test_a_restore_pauses_the_collector_and_gives_it_back(
    monkeypatch: pytest.MonkeyPatch, enabled: bool
) -> None:
    """``restore_checkpoint`` runs with Python's cyclic collector off, and leaves it as it
    found it, on failure too (a job that turned it off keeps it off)."""
    import gc

    from embckpt.read import restore

    seen: list[bool] = []

    def failing(*_: object) -> None:
        seen.append(gc.isenabled())
        raise RuntimeError("reading failed")

    monkeypatch.setattr(restore, "_restore", failing)
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        with pytest.raises(RuntimeError, match="reading failed"):
            restore.restore_checkpoint(None, 5)  # type: ignore[arg-type]
        assert seen == [False] and gc.isenabled() == enabled
    finally:
        gc.enable() if was else gc.disable()
