"""Packed rows files (format 4): a rank's small blocks share one file, each block in row groups
of its own, listed in the manifest block by block.

A chain of the toy model (five tables: table-, row-, column-, table-row-wise and data-parallel)
is written packed by 2 ranks, then: restored onto the same plan and onto 1 rank, each exactly;
training continued after the restore bit for bit as in the run that never stopped; read
partially (a block's row groups only); damaged inside one block; merged; exported; verified.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import toy_model as tm
from shard_compare import assemble, blocks, differences, state_numpy

from embckpt.examples.launcher import run_ranks

STEPS = (4, 8, 12)  # full, diff, diff (incremental)
HOT = 80


def _config(**overrides: Any) -> Any:
    from embckpt import CheckpointConfig

    options: dict[str, Any] = {
        "policy": "incremental",
        "full_every": 0,
        "pipeline": "off",
        "row_group_rows": 32,
    }
    return CheckpointConfig(**{**options, **overrides})


def _write(rank: int, world_size: int, root: str, codec: str) -> dict:
    from embckpt import Checkpointer

    model, opt = tm.build(world_size, seed=0)
    out: dict[str, Any] = {}
    with Checkpointer(model, root, optimizer=opt, config=_config(codec=codec)) as ckpt:
        for step in range(1, STEPS[-1] + 1):
            tm.train_step(model, opt, step, rank, hot=HOT)
            if step in STEPS:
                ckpt.save(step).wait()
                if step == STEPS[1]:
                    out["at_8"] = blocks(model, opt, rank)
        out["at_save"] = blocks(model, opt, rank)
        tm.train_step(model, opt, STEPS[-1] + 1, rank, hot=HOT)
        out["continued"] = state_numpy(model, opt, rank)
    return out


def _restore(rank: int, world_size: int, root: str, step: int) -> dict:
    from embckpt import Checkpointer

    model, opt = tm.build(world_size, seed=99)
    with Checkpointer(model, root, optimizer=opt, config=_config()) as ckpt:
        result = ckpt.restore(step)
        assert result == step, result
        out: dict[str, Any] = {"restored": blocks(model, opt, rank)}
        tm.train_step(model, opt, STEPS[-1] + 1, rank, hot=HOT)
        out["continued"] = state_numpy(model, opt, rank)
    return out


@pytest.fixture(scope="module")
def packed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("packed") / "ckpt"
    return root, run_ranks(_write, 2, str(root), "raw")


def _manifest(root: Path, step: int) -> dict:
    """The manifest with every rank's part read (format 5 lists rows files in rank files)."""
    from embckpt.storage.chain import read_manifest
    from embckpt.storage.fs import CheckpointStore
    from embckpt.storage.manifest_types import plain

    return plain(read_manifest(CheckpointStore(root), step))


def _rows_files_per_rank(manifest: dict) -> dict[int, int]:
    per_rank: dict[int, set[str]] = {}
    for f in manifest["files"]:
        per_rank.setdefault(f["rank"], set()).add(f["path"])
    return {rank: len(paths) for rank, paths in per_rank.items()}


def test_small_blocks_share_one_file_per_rank(packed_run: tuple[Path, list[dict]]) -> None:
    root, _ = packed_run
    for step in STEPS:
        manifest = _manifest(root, step)
        assert manifest["format_version"] == 5
        rows = [f for f in manifest["files"] if f["role"] == "rows"]
        packed = [f for f in rows if f["block"] is not None]
        assert all(f["path"].startswith("packed/") for f in packed), step
        # Blocks alike share a file; one alone in its schema (the data-parallel table, without
        # fused optimizer state; a column block, narrower) has its own.
        for rank in range(2):
            mine = {f["path"] for f in rows if f["rank"] == rank}
            assert len(mine) <= 3, (step, rank, mine)
            if step == STEPS[0]:  # a full: every block of the rank is written
                assert len([f for f in packed if f["rank"] == rank]) >= 2, (step, rank)
        for path in {f["path"] for f in packed}:
            mine = [f for f in packed if f["path"] == path]
            assert sorted(f["block"] for f in mine) == list(range(len(mine)))
            spans = sorted((f["index"]["first_group"], len(f["index"]["row_groups"])) for f in mine)
            assert [s[0] for s in spans] == list(np.cumsum([0] + [s[1] for s in spans[:-1]]))


def test_packed_chain_restores_exactly_and_continues_bit_for_bit(
    packed_run: tuple[Path, list[dict]],
) -> None:
    root, written = packed_run
    restored = run_ranks(_restore, 2, str(root), STEPS[-1])
    for rank in range(2):
        ours, theirs = restored[rank]["restored"], written[rank]["at_save"]
        for a, b in zip(ours["blocks"], theirs["blocks"], strict=True):
            assert a["table"] == b["table"]
            np.testing.assert_array_equal(a["weight"], b["weight"], err_msg=a["table"])
            for name in b["row_states"]:
                np.testing.assert_array_equal(a["row_states"][name], b["row_states"][name])
        assert differences(restored[rank]["continued"], written[rank]["continued"]) == []


def test_packed_chain_restores_onto_one_rank(packed_run: tuple[Path, list[dict]]) -> None:
    root, written = packed_run
    (one,) = run_ranks(_restore, 1, str(root), STEPS[1])
    truth = assemble([w["at_8"] for w in written])
    got = assemble([one["restored"]])
    for table, arrays in truth.items():
        for name, values in arrays.items():
            if name.startswith("row:") and table.endswith("t_cw"):
                continue  # row-wise states of column blocks are averaged onto one block
            np.testing.assert_array_equal(got[table][name], values, err_msg=f"{table} {name}")


def test_a_partial_read_fetches_only_one_blocks_row_groups(
    packed_run: tuple[Path, list[dict]],
) -> None:
    from embckpt.storage.chain import read_chain
    from embckpt.storage.fs import CheckpointStore

    root, _ = packed_run
    store = CheckpointStore(root)
    (manifest,) = read_chain(store, STEPS[0])
    entry = next(f for f in manifest.files if f.block is not None and f.rows > 100)
    checked = store.open_rows(STEPS[0], entry, [0])  # the block's first row group alone
    try:
        assert checked.bytes_read < entry.bytes
        ids = checked.row_ids()
        assert 0 < len(ids) <= 32
        assert entry.row_offset <= ids.min() and ids.max() < entry.row_offset + entry.shard_rows
        assert checked.header["table"] == entry.table
    finally:
        checked.close()
    whole = store.open_rows(STEPS[0], entry, None)  # every row group of the block
    try:
        batch = whole.read_all()
        assert len(batch.rows) == entry.rows and whole.bytes_read < entry.bytes
        assert batch.header["row_offset"] == entry.row_offset
    finally:
        whole.close()


def test_the_blocks_of_one_packed_file_share_their_codecs_and_its_read(
    packed_run: tuple[Path, list[dict]],
) -> None:
    from embckpt.codecs.base import one_array
    from embckpt.read.plan import plan_reads
    from embckpt.read.stage import _by_file, stage_blocks
    from embckpt.sharding import TableShard
    from embckpt.storage.chain import read_chain
    from embckpt.storage.fs import CheckpointStore

    root, _ = packed_run
    store = CheckpointStore(root)
    chain = read_chain(store, STEPS[1])
    entries = [f for f in chain[-1].files if f.block is not None and f.rank == 0]
    shards = [  # the writer's blocks, as a reader of its plan holds them
        TableShard(
            e.table,
            e.fqn,
            "row_wise",
            e.row_offset,
            e.col_offset,
            e.row_offset + e.shard_rows,
            e.col_offset + e.shard_cols,
            torch.zeros(e.shard_rows, e.shard_cols),
        )
        for e in entries
    ]
    reads = [r for r in plan_reads(chain, shards) if r.position == 1]
    (packed,) = [group for group in _by_file(reads) if len(group) > 1]
    staged, _ = stage_blocks(store, packed)
    try:
        configs = {str(f.codec.get_config()) for f in staged}
        assert len({id(f.codec) for f in staged}) == len(configs)
        assert len({id(f.state_codec) for f in staged}) == 1
        # Each block's payload is a slice of the file's one Parquet read, and a codec takes it
        # as it is (Arrow's combine_chunks would copy even this one chunk).
        payloads = [f.checked.read_all().encoded.columns["payload"] for f in staged]
        assert all(p.num_chunks == 1 for p in payloads)
        data = {one_array(p).buffers()[-1].address for p in payloads}
        assert data == {p.chunk(0).buffers()[-1].address for p in payloads}
        assert len(data) == 1  # one read for the file's blocks
    finally:
        for file in staged:
            file.checked.close()


def test_verify_report_and_export_read_packed_files(
    packed_run: tuple[Path, list[dict]],
) -> None:
    from embckpt.read.export import reconstruct
    from embckpt.report.build import build_report
    from embckpt.storage.fs import CheckpointStore
    from embckpt.storage.verify import verify

    root, written = packed_run
    store = CheckpointStore(root)
    report = verify(store)
    assert report.ok, report.problems
    assert report.files_checked == sum(
        sum(_rows_files_per_rank(_manifest(root, s)).values()) for s in STEPS
    )
    checkpoints = build_report(store)["checkpoints"]
    for row in checkpoints:
        manifest = _manifest(root, row["step"])
        rows_paths = {f["path"] for f in manifest["files"] if f["role"] == "rows"}
        folder = root / f"step_{row['step']:012d}"
        on_disk = sum((folder / p).stat().st_size for p in rows_paths)
        assert abs(sum(t["bytes"] for t in row["tables"]) - on_disk) <= len(row["tables"])
        assert row["files"] == len({f["path"] for f in manifest["files"]})
    rebuilt = reconstruct(root, STEPS[-1])
    truth = assemble([w["at_save"] for w in written])
    for key, weight in rebuilt.tables.items():
        table = next(t for t in truth if key.endswith(t.rsplit(".", 1)[-1] + ".weight"))
        np.testing.assert_array_equal(weight.numpy(), truth[table]["weight"], err_msg=key)


def test_a_damaged_byte_in_one_block_is_caught_naming_the_file(
    packed_run: tuple[Path, list[dict]], tmp_path: Path
) -> None:
    from embckpt.errors import CheckpointCorruptError
    from embckpt.read.export import reconstruct
    from embckpt.storage.chain import read_chain
    from embckpt.storage.fs import CheckpointStore
    from embckpt.storage.verify import verify

    source, _ = packed_run
    root = tmp_path / "ckpt"
    shutil.copytree(source, root)
    store = CheckpointStore(root)
    (manifest,) = read_chain(store, STEPS[0])
    packed = [f for f in manifest.files if f.block is not None]
    victim = packed[1]
    assert victim.index is not None
    group = victim.index.row_groups[0]
    path = root / f"step_{STEPS[0]:012d}" / victim.path
    data = bytearray(path.read_bytes())
    data[group.offset + group.length // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError) as caught:
        store.open_rows(STEPS[0], victim, None)
    assert victim.path in str(caught.value) and "row group 0" in str(caught.value)
    # Another block of the same file reads: only what is read is checked.
    other = next(f for f in packed if f.path == victim.path and f.block != victim.block)
    store.open_rows(STEPS[0], other, None).close()
    with pytest.raises(CheckpointCorruptError, match=victim.path):
        reconstruct(root, STEPS[0])
    report = verify(store, STEPS[0])
    assert not report.ok and any(victim.path in where for where, _ in report.problems)


def test_merge_of_a_packed_chain_is_exact(
    packed_run: tuple[Path, list[dict]], tmp_path: Path
) -> None:
    from embckpt.read.export import reconstruct
    from embckpt.read.merge import merge
    from embckpt.storage.fs import CheckpointStore
    from embckpt.storage.verify import verify

    source, _ = packed_run
    root = tmp_path / "ckpt"
    shutil.copytree(source, root)
    before = reconstruct(root, STEPS[-1])
    merged = merge(CheckpointStore(root), STEPS[-1])
    assert merged.kind == "full" and merged.format_version == 5 and not merged.parts
    assert all(f.block is None for f in merged.files)
    after = reconstruct(root, STEPS[-1])
    assert after.chain == (STEPS[-1],)
    for key, weight in before.tables.items():
        assert torch.equal(after.tables[key], weight), key
    assert verify(CheckpointStore(root)).ok


def _diff_files(rank: int, world_size: int, root: str) -> dict:
    """Writes a full and a one-shot diff (delta rows and rows written whole), then restores
    the diff in a fresh model; returns what the writer meant it to hold and what came back."""
    from embckpt import Checkpointer

    model, opt = tm.build(world_size, seed=0)
    config = _config(codec="adaptive", bits=4, policy="one_shot", full_every=4)
    with Checkpointer(model, root, optimizer=opt, config=config) as ckpt:
        ckpt.track_reconstruction()
        for step in range(1, 9):
            tm.train_step(model, opt, step, rank, hot=HOT)
            if step % 4 == 0:
                ckpt.save(step).wait()
        meant = ckpt.reconstruction()
    model, opt = tm.build(world_size, seed=99)
    with Checkpointer(model, root, optimizer=opt, config=config) as ckpt:
        assert ckpt.restore(8) == 8
    got = tm.writer_blocks(model, rank)
    return {key: (meant[key]["weight"].numpy(), got[key]["weight"].numpy()) for key in meant}


def test_adaptive_diffs_are_a_few_files_per_rank(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    ranks = run_ranks(_diff_files, 2, str(root))
    diff = _manifest(root, 8)
    assert diff["kind"] == "diff"
    # A block's delta rows and rows written whole share its packed file (the whole rows'
    # payload written binary, as the delta's); tables with and without row-wise optimizer
    # state (the data-parallel one) do not: at most two packed files.
    for rank, count in _rows_files_per_rank(diff).items():
        assert count - (3 if rank == 0 else 2) <= 2, (rank, count)
    packed = [f for f in diff["files"] if f["role"] == "rows" and f["block"] is not None]
    parts: dict[tuple[str, str], int] = {}
    for f in packed:
        parts[f["path"], f["table"]] = parts.get((f["path"], f["table"]), 0) + 1
    assert max(parts.values()) == 2, parts  # a block's two parts, in one file
    for compared in ranks:
        assert compared
        for key, (meant, got) in compared.items():
            np.testing.assert_array_equal(got, meant, err_msg=key)
    # The offline readers take such files too: verify, export, and a merge that restores as
    # the chain does.
    from embckpt.read.export import reconstruct
    from embckpt.read.merge import merge
    from embckpt.storage.fs import CheckpointStore
    from embckpt.storage.verify import verify

    assert verify(CheckpointStore(root)).ok
    before = reconstruct(root, 8)
    merge(CheckpointStore(root), 8)
    after = reconstruct(root, 8)
    assert before.chain == (4, 8) and after.chain == (8,)
    for key, weight in before.tables.items():
        assert torch.equal(after.tables[key], weight), key


def _failing_packed_write(rank: int, world_size: int, root: str) -> dict:
    from embckpt import Checkpointer

    model, opt = tm.build(world_size, seed=0)
    with Checkpointer(model, root, optimizer=opt, config=_config(policy="full")) as ckpt:
        tm.train_step(model, opt, 1, rank, hot=HOT)
        ckpt.save(1).wait()
        saved = blocks(model, opt, rank)
        write_file = ckpt.store.write_file

        def failing(step: int, relative: str, data: Any, *args: Any, **kwargs: Any) -> Any:
            if rank == 1 and relative.startswith("packed/"):
                raise OSError(28, "No space left on device")
            return write_file(step, relative, data, *args, **kwargs)

        ckpt.store.write_file = failing  # type: ignore[method-assign]
        tm.train_step(model, opt, 2, rank, hot=HOT)
        error = tm.raised(lambda: ckpt.save(2).wait())
        ckpt.store.write_file = write_file  # type: ignore[method-assign]
        committed = ckpt.store.committed_steps()
        assert ckpt.restore(1) == 1
    return {
        "error": error,
        "committed": committed,
        "saved": saved,
        "restored": blocks(model, opt, rank),
    }


def test_a_failed_packed_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    results = run_ranks(_failing_packed_write, 2, str(tmp_path / "ckpt"))
    for r in results:
        assert r["error"] is not None and "No space left" in r["error"], r["error"]
        assert r["committed"] == [1]
        for a, b in zip(r["restored"]["blocks"], r["saved"]["blocks"], strict=True):
            np.testing.assert_array_equal(a["weight"], b["weight"])


def _entry(path: str, block: int | None, first: int, checksum: str = "crc32c:00000001") -> Any:
    from embckpt.storage.manifest import FileEntry, FileIndex, RowGroupEntry

    group = RowGroupEntry(0, 9, 10, 4 + 100 * first, 100, "crc32c:00000002")
    index = FileIndex(checksum, 304, "crc32c:00000003", (group,), first)
    return FileEntry(path, 400, checksum, "rows", 0, "t", 0, 0, 10, 4, 10, "", index, block)


def _parsed(*entries: Any) -> Any:
    from embckpt.storage.manifest import Manifest

    manifest = Manifest(
        step=1,
        kind="full",
        policy="full",
        base_step=1,
        parent_step=None,
        world_size=1,
        codec={"id": "raw"},
        tables=(),
        files=entries,
    )
    return Manifest.from_json(manifest.to_json(), "MANIFEST.json")


def test_a_path_listed_twice_is_refused_unless_blocks_of_one_packed_file() -> None:
    from embckpt.errors import CheckpointCorruptError

    assert len(_parsed(_entry("p", 0, 0), _entry("p", 1, 1)).files) == 2
    for twice in (
        (_entry("p", None, 0), _entry("p", None, 0)),  # one file, written twice
        (_entry("p", 0, 0), _entry("p", 0, 1)),  # the same block twice
        (_entry("p", 0, 0), _entry("p", 1, 0)),  # blocks sharing a row group
        (_entry("p", 0, 0), _entry("p", 1, 1, "crc32c:00000009")),  # two different files
        (_entry("p", 0, 0), _entry("p", None, 1)),  # a packed block and a whole file
    ):
        with pytest.raises(CheckpointCorruptError, match="listed more than once"):
            _parsed(*twice)
