"""The chain pass (embckpt/read/chain_pass.py) writes exactly what applying the chain file by
file writes, and what replaying it in order gives; codecs decode many batches as one exactly
as they decode each."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from embckpt.codecs import Codec, make_codec
from embckpt.codecs.delta import DeltaCodec
from embckpt.read import apply as apply_module
from embckpt.read import stage as stage_module
from embckpt.read.apply import read_into
from embckpt.read.plan import FileRead, chained_blocks
from embckpt.sharding import TableShard
from embckpt.storage.chain import read_chain
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import MANIFEST_NAME
from embckpt.storage.manifest import FileEntry, Manifest, TableEntry
from embckpt.storage.rowfile_read import BATCH_BYTES
from embckpt.storage.rowfile_write import encode_file, index_file

ROWS, COLS, STATE = 400, 16, "momentum"
INNER = {"id": "adaptive", "bits": 4, "entropy": "none"}


def _file(store, step, name, rows, encoded, states, codec) -> FileEntry:
    data = encode_file(
        rows=rows.astype(np.int64),
        encoded=encoded,
        row_states={STATE: states},
        elem_states={},
        metadata={"codec": codec.get_config(), "state_codec": {"id": "raw"}},
        row_group_rows=64,
    )
    w = store.write_file(step, f"tables/t/{name}.parquet", data)
    entry = FileEntry(w.path, w.bytes, w.checksum, "rows", 0, "t", 0, 0, ROWS, COLS, len(rows))
    return FileEntry(**{**entry.__dict__, "fqn": "t.weight", "index": index_file(data)})


def _write_chain(
    root: Path, links: int, seed: int, full_codec: Codec | None = None, lossless: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """A full (``full_codec``, raw by default) then ``links`` diffs, each a delta file (added)
    and a whole-row file (replaced) of random rows that repeat along the chain, as the
    writer's split writes them (``lossless``: one raw file of replaced rows); returns the
    weights and row-wise states replaying the chain in order gives."""
    from embckpt import dense

    rng = np.random.default_rng(seed)
    store = CheckpointStore(root, fsync=False)
    empty = dense.encode_tree({"model": {}, "optimizer": None, "fused_scalars": {}})
    delta = make_codec("delta", {"inner": INNER})
    whole, raw = make_codec("adaptive", {"bits": 4, "entropy": "none"}), make_codec("raw")
    weights = np.zeros((ROWS, COLS), dtype=np.float32)
    states = np.zeros(ROWS, dtype=np.float32)
    hot = rng.choice(ROWS, 40, replace=False)  # in every link: the same cells added again
    parent = None
    for position in range(links + 1):
        step = position + 1
        files = []
        if position == 0:
            rows = np.arange(ROWS)
            values = torch.randn(ROWS, COLS)
            s = rng.random(ROWS).astype(np.float32)
            base = full_codec or raw
            encoded = base.encode(values)
            files.append(_file(store, step, "full", rows, encoded, s, base))
            weights[:] = base.decode(encoded, COLS).numpy()
            states[:] = s
        elif lossless:
            picked = np.union1d(hot, rng.choice(ROWS, 60, replace=False))
            values = torch.randn(len(picked), COLS)
            s = rng.random(len(picked)).astype(np.float32)
            files.append(_file(store, step, "rows", picked, raw.encode(values), s, raw))
            weights[picked] = values.numpy()
            states[picked] = s
        else:
            picked = np.union1d(hot, rng.choice(ROWS, 60, replace=False))
            added, replaced = picked[: len(picked) * 2 // 3], picked[len(picked) * 2 // 3 :]
            live = torch.from_numpy(weights[added]) + 0.01 * torch.randn(len(added), COLS)
            encoded = delta.encode_delta(live, torch.from_numpy(weights[added]))
            s = rng.random(len(added)).astype(np.float32)
            files.append(_file(store, step, "delta", added, encoded, s, delta))
            weights[added] += delta.decode(encoded, COLS).numpy()  # in place: the same adds
            states[added] = s
            values = torch.randn(len(replaced), COLS)
            encoded = whole.encode(values)
            s = rng.random(len(replaced)).astype(np.float32)
            files.append(_file(store, step, "whole", replaced, encoded, s, whole))
            weights[replaced] = whole.decode(encoded, COLS).numpy()
            states[replaced] = s
        d = store.write_file(step, "dense/model.safetensors", empty)
        files.append(FileEntry(d.path, d.bytes, d.checksum, "dense", 0))
        table = TableEntry(
            "t", ROWS, COLS, "float32", "row_wise", (STATE,), (), ((0, 0, 0, ROWS, COLS),)
        )
        manifest = Manifest(
            step=step,
            kind="full" if parent is None else "diff",
            policy="incremental",
            base_step=1,
            parent_step=parent,
            world_size=1,
            codec=raw.get_config() if parent is None or lossless else delta.get_config(),
            tables=(table,),
            files=tuple(sorted(files, key=lambda f: f.path)),
        )
        store.write_atomic(store.step_path(step, MANIFEST_NAME), manifest.to_json().encode())
        parent = step
    return weights, states


def _shard(device: str = "cpu") -> TableShard:
    return TableShard(
        "t",
        "t.weight",
        "row_wise",
        0,
        0,
        ROWS,
        COLS,
        torch.full((ROWS, COLS), 7.0, device=device),
        row_states={STATE: torch.full((ROWS,), 3.0, device=device)},
    )


@pytest.mark.parametrize("seed", range(3))
def test_chain_pass_equals_replay_and_file_by_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    weights, states = _write_chain(tmp_path, links=6, seed=seed)
    store = CheckpointStore(tmp_path)
    chain = read_chain(store, None)
    passes = []
    original = apply_module.apply_block_chain

    def counted(files, clock):
        passes.append(len(files))
        return original(files, clock)

    monkeypatch.setattr(apply_module, "apply_block_chain", counted)
    batched = _shard()
    read_into(store, chain, [batched], threads=2)
    assert passes == [12]  # the block's 12 diff files, in one pass
    # No block chained: staging masks every diff by what newer ones give, applied file by file.
    monkeypatch.setattr(stage_module, "chained_blocks", lambda reads: set())
    by_file = _shard()
    read_into(store, chain, [by_file], threads=2)
    assert len(passes) == 1
    for shard in (batched, by_file):
        assert np.array_equal(shard.weight.numpy().view(np.int32), weights.view(np.int32))
        assert np.array_equal(shard.row_states[STATE].numpy(), states)


def test_a_block_is_chained_when_its_every_diff_is_small_and_its_alone() -> None:
    blocks = [_shard() for _ in range(4)]

    def read(position: int, size: int, *targets: TableShard) -> FileRead:
        entry = FileEntry("f.parquet", size, "0", "rows", 0, "t", 0, 0, ROWS, COLS, 1)
        return FileRead(position, position + 1, position > 0, entry, targets, None)

    small, large = 1 << 10, BATCH_BYTES + 1
    reads = [
        read(0, large, *blocks),  # the base, whatever its size or targets
        read(1, small, blocks[0]),
        read(2, small, blocks[0]),
        read(1, large, blocks[1]),  # one large diff: file by file
        read(2, small, blocks[1]),
        read(1, small, blocks[2], blocks[3]),  # a diff of two blocks: neither chained
        read(2, small, blocks[3]),
    ]
    assert chained_blocks(reads) == {id(blocks[0])}


@pytest.mark.parametrize("name", ["delta", "adaptive", "raw", "log8", "kmeans"])
def test_decode_many_equals_each_decode(name: str) -> None:
    options = {"inner": INNER} if name == "delta" else {}
    codec = make_codec(name, options)
    batches = [torch.randn(n, COLS) for n in (5, 33, 1)]
    if name == "delta":
        encoded = [codec.encode_delta(b, b * 0.9) for b in batches]
    else:
        encoded = [codec.encode(b) for b in batches]
    encoded.append(encoded[1])  # equal metadata: decoded together where the codec allows
    together = codec.decode_many(encoded, COLS)
    assert len(together) == len(encoded)
    for one, many in zip(encoded, together, strict=True):
        assert torch.equal(codec.decode(one, COLS), many)


def test_decode_many_refuses_a_delta_row_of_no_width() -> None:
    from embckpt.codecs.base import EncodedRows
    from embckpt.errors import CodecError

    codec = make_codec("delta", {"inner": INNER})
    good = codec.encode_delta(torch.randn(4, COLS), torch.zeros(4, COLS))
    bad = EncodedRows(good.columns, {**good.metadata, "widths": []})
    with pytest.raises(CodecError, match="match no width"):
        codec.decode_many([good, bad], COLS)


def test_restore_threads_take_twice_the_rank_share(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from embckpt.read.stage import THREADS_ENV, default_threads

    monkeypatch.delenv(THREADS_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert default_threads() == 2  # a rank's one core, and the one the other rank leaves idle
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(96)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert default_threads() == 8  # at most 8
    monkeypatch.setenv(THREADS_ENV, "3")
    assert default_threads() == 3  # as the environment says


def test_restore_threads_take_the_cores_the_other_ranks_leave_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os
    from types import SimpleNamespace

    from embckpt.cores import balanced_restore_threads
    from embckpt.read.restore import _threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert balanced_restore_threads(100, [100]) == 1  # both ranks busy: no core to spare
    assert balanced_restore_threads(100, [90]) == 1
    assert balanced_restore_threads(100, [5]) == 2  # the other rank's core is soon idle
    assert balanced_restore_threads(5, [100]) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(8)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert balanced_restore_threads(100, [100, 100, 100]) == 2  # the rank's share
    assert balanced_restore_threads(100, [0, 0, 50]) == 4  # at most twice the share

    from embckpt.read.restore import host_work
    from embckpt.storage.manifest_types import PartEntry

    def link(world_size: int, wrote: list[int]) -> SimpleNamespace:  # a manifest's fields
        parts = tuple(PartEntry(r, 0, "", 0, "", n, 0) for r, n in enumerate(wrote))
        return SimpleNamespace(world_size=world_size, parts=parts, total_bytes=sum(wrote))

    chain = [link(2, [900, 10]), link(2, [100, 0])]
    assert host_work(chain, 0, 2, 2, planned=5) == (1000, [10])  # what each rank wrote
    assert host_work(chain, 1, 2, 2, planned=5) == (10, [1000])
    assert host_work(chain, 0, 2, 1, planned=5) == (1000, [])  # one rank per host
    # Onto another world size: this rank's plan, and an even share of the rest for the others.
    assert host_work(chain, 1, 4, 2, planned=210) == (210, [800 / 3])
    assert host_work(chain, 3, 4, 4, planned=10) == (10, [1000 / 3] * 3)

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    local, remote = SimpleNamespace(is_local=True), SimpleNamespace(is_local=False)
    ranks = [SimpleNamespace(rank=r, world_size=2) for r in range(2)]
    skewed = [link(2, [1000, 10])]
    assert _threads(SimpleNamespace(comm=ranks[0], store=local, threads=None), 0, skewed) == 2
    assert _threads(SimpleNamespace(comm=ranks[1], store=local, threads=None), 0, skewed) == 1
    even = [link(2, [1000, 1000])]
    assert _threads(SimpleNamespace(comm=ranks[0], store=local, threads=None), 0, even) == 1
    assert _threads(SimpleNamespace(comm=ranks[0], store=remote, threads=None), 0, even) == 2
    assert _threads(SimpleNamespace(comm=ranks[0], store=local, threads=5), 0, even) == 5


def test_needed_bytes_and_membership_equal_their_per_row_definitions() -> None:
    from types import SimpleNamespace

    from embckpt.read.plan import Keep, _Rows
    from embckpt.read.stage import StagedFile

    rng = np.random.default_rng(3)
    for _ in range(50):
        counts = rng.integers(1, 20, size=int(rng.integers(1, 6)))
        sizes = rng.integers(10, 1000, size=len(counts)).astype(float)
        per_row = np.repeat(sizes / counts, counts)  # each row's share, as defined
        n = int(counts.sum())
        first = int(rng.integers(0, n))
        last = int(rng.integers(first, n + 1))
        mask = rng.random(last - first) < 0.5
        segments = ((0, 3, None), (3, 8, mask))
        entry = SimpleNamespace(shard_cols=8)
        file = StagedFile(
            SimpleNamespace(entry=entry),  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            np.arange(n),
            np.cumsum(counts),
            sizes / counts,
            [Keep(first, last, segments, None)],
        )
        share = per_row[first:last]
        expected = share.sum() * 3 / 8 + share[mask].sum() * 5 / 8
        assert np.isclose(file.needed_bytes(), expected)
        # A block of global rows [100, 300): the set of rows newer files gave, as a mask.
        given = _Rows(TableShard("t", "t", "row_wise", 100, 0, 300, 8, torch.zeros(200, 8)))
        found = np.unique(rng.integers(100, 300, size=int(rng.integers(0, 40))))
        given.add(found)
        values = np.arange(int(rng.integers(100, 150)), int(rng.integers(150, 300)))  # a run
        assert np.array_equal(given.member(values), np.isin(values, found))
        sparse = np.unique(rng.integers(100, 300, size=30))
        assert np.array_equal(given.member(sparse), np.isin(sparse, found))
        lo = rng.integers(100, 300, size=5)
        hi = lo + rng.integers(-3, 60, size=5).clip(max=299 - lo)
        counts = [((found >= a) & (found <= b)).sum() for a, b in zip(lo, hi, strict=True)]
        assert given.count_in(lo, hi).tolist() == counts


def test_a_damaged_diff_fails_naming_it_and_every_staged_file_is_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A diff staged early (with every small diff, before the newer ones finished) that fails
    its checks fails the restore naming the file; whatever was staged is closed."""
    from embckpt.errors import CheckpointCorruptError
    from embckpt.storage import rowfile_ranges

    _write_chain(tmp_path, links=5, seed=7)
    damaged = tmp_path / "step_000000000004" / "tables" / "t" / "delta.parquet"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 3] ^= 0xFF
    damaged.write_bytes(bytes(data))
    balance = {"use": 0, "release": 0}
    use, release = rowfile_ranges.FetchedFile.use, rowfile_ranges.FetchedFile.release

    def counted_use(self):
        balance["use"] += 1
        use(self)

    def counted_release(self):
        balance["release"] += 1
        release(self)

    monkeypatch.setattr(rowfile_ranges.FetchedFile, "use", counted_use)
    monkeypatch.setattr(rowfile_ranges.FetchedFile, "release", counted_release)
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointCorruptError, match="delta.parquet"):
        read_into(store, read_chain(store, None), [_shard()], threads=3)
    assert balance["use"] > 0 and balance["use"] == balance["release"], balance


def test_a_lossless_chain_restores_without_loading_a_compiled_kernel(tmp_path: Path) -> None:
    """A lossless restore loads no numba kernel: a relaunched rank's first kernel load cost it
    0.4-0.5 s (``benchmarks/recovery.py``), so scattered rows are copied by numpy there."""
    weights, states = _write_chain(tmp_path / "ckpt", links=3, seed=4, lossless=True)
    code = (
        "import sys\n"
        "import numpy as np, torch\n"
        "from embckpt.blocks import TableShard\n"
        "from embckpt.read.apply import read_into\n"
        "from embckpt.storage.chain import read_chain\n"
        "from embckpt.storage.fs import CheckpointStore\n"
        f"rows, cols = {ROWS}, {COLS}\n"
        "shard = TableShard('t', 't.weight', 'row_wise', 0, 0, rows, cols,\n"
        "    torch.full((rows, cols), 7.0),\n"
        f"    row_states={{'{STATE}': torch.full((rows,), 3.0)}})\n"
        "store = CheckpointStore(sys.argv[1])\n"
        "read_into(store, read_chain(store, None), [shard], threads=1)\n"
        "np.save(sys.argv[2], shard.weight.numpy())\n"
        f"np.save(sys.argv[3], shard.row_states['{STATE}'].numpy())\n"
        # A kernel module may be imported (its dispatchers are cheap); none may have loaded
        # a compiled kernel.
        "kernels = [sys.modules[m] for m in list(sys.modules) if m.endswith('_kernels')]\n"
        "print(sorted(n for k in kernels for n, f in vars(k).items()\n"
        "    if getattr(f, 'overloads', None)))\n"
    )
    out_w, out_s = tmp_path / "w.npy", tmp_path / "s.npy"
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "ckpt"), str(out_w), str(out_s)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
    assert np.array_equal(np.load(out_w), weights)
    assert np.array_equal(np.load(out_s), states)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_kernels_equal_numpy(dtype: type) -> None:
    from embckpt.codecs import row_kernels

    rng = np.random.default_rng(5)
    block = rng.standard_normal((50, 12)).astype(dtype)
    rows = np.sort(rng.choice(50, size=17, replace=False)).astype(np.int64)
    values = rng.standard_normal((17, 5)).astype(dtype)
    expected = block.copy()
    expected[rows, 3:8] += values
    row_kernels.add_rows(block[:, 3:8], rows, values)  # a column segment: a strided view
    assert np.array_equal(block.view(np.uint8), expected.view(np.uint8))
    whole = rng.standard_normal((17, 12)).astype(dtype)
    expected[rows] += whole
    row_kernels.add_rows(block, rows, whole)  # whole rows: the C-ordered signature
    assert np.array_equal(block.view(np.uint8), expected.view(np.uint8))
    if dtype != np.float32:
        return
    # Rows replaced (more rows than the kernels prefetch ahead), whole and a column segment,
    # from read-only values as Arrow's buffers are.
    whole.flags.writeable = False
    expected[rows] = whole
    row_kernels.copy_rows(block, rows, whole)
    assert np.array_equal(block.view(np.uint8), expected.view(np.uint8))
    expected[rows[::2], 3:8] = values[::2]
    row_kernels.copy_rows(block[:, 3:8], rows[::2], values[::2])
    assert np.array_equal(block.view(np.uint8), expected.view(np.uint8))

    data = np.frombuffer(rng.integers(0, 256, size=300, dtype=np.uint8).tobytes(), np.uint8)
    starts = rng.integers(0, 290, size=9).astype(np.int64)  # a read-only buffer, as Arrow's
    gathered = row_kernels.gather_entries(data, starts, 7)
    assert np.array_equal(gathered, data[starts[:, None] + np.arange(7)])


def _delta_items(
    rng: np.random.Generator, sizes: tuple[int, ...], inner: dict | None = None
) -> tuple[Codec, list]:
    """A delta codec (of ``inner``, else INNER with fp32 parameters) and batches of its
    changes at every width (2 to 8 bits, raw, zero)."""
    delta = make_codec("delta", {"inner": inner or {**INNER, "param_dtype": "float32"}})
    assert isinstance(delta, DeltaCodec)
    items = []
    for n in sizes:
        reference = torch.from_numpy(rng.standard_normal((n, COLS)).astype(np.float32))
        scale = torch.logspace(-7, 1, n)[:, None]
        live = reference + torch.randn(n, COLS, generator=torch.Generator().manual_seed(n)) * scale
        live[::9] = 0.25  # no error budget: their change crosses raw
        items.append(delta.encode_delta(live, reference))
    return delta, items


_INNERS = {
    "adaptive, fp32 parameters": {**INNER, "param_dtype": "float32"},
    "asymmetric, fp16 parameters": {"id": "asymmetric", "bits": 4, "param_dtype": "float16"},
    "symmetric (no bias stored)": {"id": "symmetric", "bits": 4, "param_dtype": "float16"},
    "kmeans (decoded first)": {"id": "kmeans", "bits": 4},
}


@pytest.mark.parametrize("inner", list(_INNERS))
@pytest.mark.parametrize("together", [True, False])
def test_changes_added_file_by_file_equal_the_dense_decode(together: bool, inner: str) -> None:
    """A chain's delta changes added file by file, each file in one kernel call
    (read/changes.py: a uniform inner codec's entries decoded as they are added, by
    ``delta_kernels.add_coded``; another's width groups decoded first; zero changes without
    a buffer), leave the block's bytes as the dense decode added file by file through each
    keep mask does, -0.0 cells included (a zero change makes them +0.0 both ways). The
    files' rows overlap in the block, so a wrong order of a row's additions changes its
    bits. ``together``: the files decoded as one (their values in one array), else each on
    its own."""
    from embckpt.read.changes import ChangeCells, add_changes, decode_changes

    rng = np.random.default_rng(9)
    delta, items = _delta_items(rng, (70, 45, 60), _INNERS[inner])
    dense = delta.decode_many(items, COLS)
    if together:
        sparse = decode_changes(delta, items, COLS)
    else:
        sparse = [decode_changes(delta, [item], COLS)[0] for item in items]
    widths = {g.bits for g in delta.width_groups(items)[1]}
    assert len(widths) >= 3 and any((c.index < 0).any() for c in sparse)
    for changes, values in zip(sparse, dense, strict=True):
        assert (changes.coded is None) == inner.startswith("kmeans")
        picked = changes.index >= 0
        assert not values[~picked].any()
        if changes.values is not None:
            assert np.array_equal(changes.values[changes.index[picked]], values[picked].numpy())
    # A column segment (a strided block) and whole rows (C-ordered: the kernel's own loop).
    for masked, (width, lo, hi) in itertools.product((True, False), ((COLS + 4, 4, 10), (6, 0, 6))):
        block = rng.standard_normal((80, width)).astype(np.float32)
        block[::3, 2:6] = -0.0
        block[1::5] *= 1e-7  # small rows, where the order of additions shows in their bits
        expected, cells = block.copy(), []
        for changes, values in zip(sparse, dense, strict=True):
            span = slice(5, len(values) - 3)  # the file's rows this block holds
            local = np.sort(rng.choice(80, size=span.stop - span.start, replace=False))
            mask = rng.random(len(local)) < 0.7 if masked else None
            keeps = np.ones(len(local), dtype=bool) if mask is None else mask
            expected[local[keeps], lo:hi] += values[span][keeps][:, 3:9].numpy()
            cells.append(ChangeCells(changes, span, mask, local, 3))
        out = block[:, lo:hi]
        assert out.flags.c_contiguous == (width == hi - lo)
        for cell in cells:  # in chain order, as the chain pass adds them
            add_changes(cell, out)
        assert np.array_equal(block.view(np.int32), expected.view(np.int32)), (masked, width)


@pytest.mark.parametrize("inner", list(_INNERS))
def test_changes_of_another_row_width_are_refused(inner: str) -> None:
    """Changes decoded for a row width their entries do not hold raise CodecError, whether
    left coded (``DeltaCodec.kernel_parts`` checks each width's entry length, which the
    kernel then trusts) or decoded first."""
    from embckpt.errors import CodecError
    from embckpt.read.changes import decode_changes

    delta, items = _delta_items(np.random.default_rng(3), (20,), _INNERS[inner])
    assert isinstance(delta, DeltaCodec)
    with pytest.raises(CodecError, match="bytes"):
        decode_changes(delta, items, COLS + 8)
