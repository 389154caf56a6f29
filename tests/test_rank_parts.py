"""Format 5 (issue 40): the manifest holds one part per rank, each rank file's header indexes
its rows files, tables are columns of block runs, and a diff names the full that lists its
tables. A reader fetches the manifests and the parts of the ranks whose blocks overlap its own,
nothing more; a damaged index fails naming its rank file; format-4 checkpoints still read."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from embckpt import dense
from embckpt.blocks import TableShard
from embckpt.errors import ChainIncompleteError, CheckpointCorruptError
from embckpt.read.export import reconstruct
from embckpt.read.plan import plan_reads, writer_ranks
from embckpt.storage.chain import read_chain, read_manifest, read_root
from embckpt.storage.checksum import checksum
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import MANIFEST_NAME, rank_file
from embckpt.storage.manifest import FileEntry, Manifest
from embckpt.storage.manifest_types import ShardRuns, from_runs
from embckpt.storage.rank_parts import header_span, index_metadata
from embckpt.storage.table_columns import to_runs
from embckpt.storage.verify import verify

STEPS = (5, 10, 15)


class CountingStore(CheckpointStore):
    """Counts what a reader fetches."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.fetched: list[tuple[int, str, int]] = []

    def read_file(self, step: int, relative: str) -> pa.Buffer:
        data = super().read_file(step, relative)
        self.fetched.append((step, relative, data.size))
        return data

    def read_head(self, step: int, relative: str, length: int) -> bytes:
        data = super().read_head(step, relative, length)
        self.fetched.append((step, relative, len(data)))
        return data


def _body(directory: Path, step: int) -> dict:
    return json.loads((directory / f"step_{step:012d}" / MANIFEST_NAME).read_text())


def _shards_of(manifest: Manifest, rank: int) -> list[TableShard]:
    """Rank ``rank``'s blocks under the writer's plan, as a restore on that plan holds them."""
    return [
        TableShard(
            table=t.name,
            fqn=f"{t.name}.weight",
            sharding_type=t.sharding_type,
            row_offset=row,
            col_offset=col,
            table_rows=t.rows,
            table_cols=t.cols,
            weight=torch.empty((rows, cols), device="meta"),
        )
        for t in manifest.tables
        for r, row, col, rows, cols in t.shards
        if r == rank or t.sharding_type == "data_parallel"  # every rank holds a replica
    ]


def test_the_manifest_holds_parts_and_each_rank_file_indexes_its_rows(saved_runs: Path) -> None:
    directory = saved_runs / "incremental"
    store = CheckpointStore(directory)
    for step in STEPS:
        body = _body(directory, step)
        assert body["format_version"] == 5
        assert [f["role"] for f in body["files"]] == ["dense"]  # rows and rank files in parts
        assert [p[0] for p in body["parts"]] == [0, 1]
        assert (body["tables"] is None) == (step != STEPS[0])
        assert body.get("tables_from") == (None if step == STEPS[0] else STEPS[0])
        whole = read_manifest(store, step)
        assert whole.complete and whole.tables == read_manifest(store, STEPS[0]).tables
        for part in whole.parts:
            data = (directory / f"step_{step:012d}" / rank_file(part.rank)).read_bytes()
            assert part.bytes == len(data) and part.index_bytes == header_span(data)
            rows = [f for f in whole.files if f.role == "rows" and f.rank == part.rank]
            assert rows and part.rows == sum(f.rows for f in rows)
        # Nothing in the folder but the manifest, the dense file and each rank's files.
        folder = directory / f"step_{step:012d}"
        on_disk = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
        assert on_disk == {MANIFEST_NAME} | {f.path for f in whole.files}


@pytest.mark.parametrize("rank", [0, 1])
def test_a_restoring_rank_fetches_the_manifests_and_the_parts_it_needs(
    saved_runs: Path, rank: int
) -> None:
    directory = saved_runs / "incremental"
    whole = read_chain(CheckpointStore(directory), 15)
    shards = _shards_of(whole[-1], rank)
    store = CountingStore(directory)
    chain = read_chain(store, 15, lambda m: writer_ranks(m, shards))
    needed = writer_ranks(whole[-1], shards)
    assert rank in needed
    assert needed == ({0, 1} if rank == 1 else {0})  # rank 1 also reads rank 0's replica
    # Per link: its manifest, and the header of each needed rank's rank file, no more.
    expected = []
    for m in whole:
        size = (directory / f"step_{m.step:012d}" / MANIFEST_NAME).stat().st_size
        expected.append((m.step, MANIFEST_NAME, size))
        by_rank = {p.rank: p for p in m.parts}
        expected += [(m.step, rank_file(r), by_rank[r].index_bytes) for r in sorted(needed)]
    assert sorted(store.fetched) == sorted(expected)
    assert all(m.loaded == frozenset(needed) for m in chain)
    # It plans exactly what it would plan from every part.
    assert plan_reads(chain, shards) == plan_reads(whole, shards)


def _rewrite_part(directory: Path, step: int, rank: int, entries: list[FileEntry]) -> None:
    """Rewrites rank ``rank``'s rank file of ``step`` with ``entries`` as its index, and the
    manifest to match it (size, checksums), as anyone can without a signing key."""
    path = directory / f"step_{step:012d}" / rank_file(rank)
    tree = dense.decode_tree(path.read_bytes())
    data = dense.encode_tree(tree, metadata=index_metadata(entries))
    path.write_bytes(data)
    body = _body(directory, step)
    body.pop("checksum")
    part = body["parts"][rank]
    part[1], part[2], part[3], part[4] = len(data), checksum(data), header_span(data), None
    part[4] = checksum(data[: header_span(data)])
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    body["checksum"] = hashlib.sha256(canonical.encode()).hexdigest()
    (directory / f"step_{step:012d}" / MANIFEST_NAME).write_text(json.dumps(body))


def test_a_damaged_index_fails_naming_the_rank_file(run_copy: Path) -> None:
    directory = run_copy / "incremental"
    path = directory / "step_000000000010" / rank_file(1)
    data = bytearray(path.read_bytes())
    data[20] ^= 0x01  # inside the header's JSON
    path.write_bytes(bytes(data))
    store = CheckpointStore(directory)
    with pytest.raises(CheckpointCorruptError) as caught:
        read_chain(store, 15)
    assert caught.value.path == str(path) and "CRC32C does not match" in str(caught.value)
    read_chain(store, 15, lambda m: {0})  # rank 0 alone does not need it
    with pytest.raises(CheckpointCorruptError, match="rank_00001"):
        reconstruct(directory, 15)
    report = verify(store)
    assert not report.ok and any(p == str(path) for p, _ in report.problems)


def test_an_index_may_list_only_its_own_ranks_rows_inside_the_folder(run_copy: Path) -> None:
    directory = run_copy / "incremental"
    rows = [f for f in read_manifest(CheckpointStore(directory), 10).files if f.role == "rows"]
    own = [f for f in rows if f.rank == 1]
    stolen = [f for f in rows if f.rank == 0][0]
    _rewrite_part(directory, 10, 1, own)  # the same index, rewritten: still reads
    reread = read_manifest(CheckpointStore(directory), 10).files
    assert [f for f in reread if f.role == "rows" and f.rank == 1] == own
    _rewrite_part(directory, 10, 1, [*own, stolen])
    with pytest.raises(CheckpointCorruptError, match="not a rows file of rank 1"):
        read_manifest(CheckpointStore(directory), 10)
    _rewrite_part(directory, 10, 1, [dataclasses.replace(own[0], path="../../x.parquet")])
    with pytest.raises(CheckpointCorruptError, match="x.parquet"):
        read_manifest(CheckpointStore(directory), 10)


def test_a_diff_without_its_full_is_incomplete(run_copy: Path) -> None:
    directory = run_copy / "incremental"
    (directory / "step_000000000005" / MANIFEST_NAME).unlink()
    with pytest.raises(ChainIncompleteError, match="step_000000000005"):
        read_manifest(CheckpointStore(directory), 10)
    assert read_root(CheckpointStore(directory), 10).tables == ()
    report = verify(CheckpointStore(directory))  # reports the diffs, does not raise
    assert not report.ok
    assert any("step_000000000005" in path for path, _ in report.problems), report.problems


def test_a_diff_keeps_its_tables_when_a_merge_and_retention_remove_its_full(
    run_copy: Path,
) -> None:
    """Step 15 names step 5 as the manifest listing its tables; step 10 merged into a full
    makes step 5 unneeded, and retention deletes it: 15 still reads, from 10's tables."""
    from embckpt.read.merge import merge
    from embckpt.storage.retention import apply_retention

    directory = run_copy / "incremental"
    store = CheckpointStore(directory)
    before = reconstruct(directory, 15)
    assert _body(directory, 15)["tables_from"] == 5
    merge(store, 10)
    assert apply_retention(store, keep_last=2) == [5]
    assert read_manifest(store, 15).tables == read_manifest(store, 10).tables != ()
    after = reconstruct(directory, 15)
    assert after.chain == (10, 15)
    for key, value in before.tables.items():
        assert torch.equal(after.tables[key], value), key
    assert verify(store).ok


def test_format_4_checkpoints_still_restore(run_copy: Path) -> None:
    """A chain rewritten as format 4 wrote it (every file in the manifest, tables as a list)
    reads as the same checkpoint."""
    directory = run_copy / "incremental"
    before = reconstruct(directory, 15)
    store = CheckpointStore(directory)
    for step in STEPS:
        old = dataclasses.replace(
            read_manifest(store, step), parts=(), tables_from=None, loaded=None, format_version=4
        )
        text = old.to_json()
        body = json.loads(text)
        assert "parts" not in body and isinstance(body["tables"], list)
        assert len([f for f in body["files"] if f["role"] == "rank"]) == 2
        (directory / f"step_{step:012d}" / MANIFEST_NAME).write_text(text)
    assert read_manifest(store, 15).format_version == 4
    after = reconstruct(directory, 15)
    assert after.chain == before.chain
    for key, value in before.tables.items():
        assert torch.equal(after.tables[key], value), key
    assert verify(store).ok


def test_block_runs_round_trip_any_plan() -> None:
    rng = random.Random(0)
    for _ in range(300):
        shards: list[tuple[int, int, int, int, int]] = []
        for _ in range(rng.randint(0, 12)):
            last = shards[-1] if shards else None
            pick = rng.random()
            if last and pick < 0.4:  # the next rank, the next rows
                shards.append((last[0] + 1, last[1] + last[3], last[2], last[3], last[4]))
            elif last and pick < 0.7:  # the next rank, the next columns
                shards.append((last[0] + 1, last[1], last[2] + last[4], last[3], last[4]))
            else:
                shards.append(tuple(rng.randint(0, 99) for _ in range(5)))  # type: ignore[misc]
        runs = to_runs(shards)
        assert from_runs(runs) == tuple(shards)
        lazy = ShardRuns(runs)
        assert lazy == tuple(shards) and tuple(shards) == lazy and len(lazy) == len(shards)
        assert np.array_equal(lazy.array(), np.asarray(shards, dtype=np.int64).reshape(-1, 5))
    row_wise = [(r, r * 2442, 0, 2442, 128) for r in range(4095)] + [(4095, 9999990, 0, 10, 128)]
    assert len(to_runs(row_wise)) == 2  # 4,096 blocks of a table: two runs
