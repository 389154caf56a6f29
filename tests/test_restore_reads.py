"""A chain restore reads each rows file once: one fetch (footer checked and parsed once, each
row group checked once) for every block it serves, one Parquet read of a small file's rows,
and its source closed once, after the last block applied; a file read group by group
builds one Parquet reader for all its reads. Raw rows are applied from the
file's bytes without a decoded copy."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_packed import STEPS, packed_run  # noqa: F401 - the fixture, written once here
from test_reshard import assemble


def test_a_chain_restore_fetches_and_reads_each_file_once(
    packed_run: tuple[Path, list[dict]],  # noqa: F811 - the fixture imported above
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from embckpt.read.export import reconstruct
    from embckpt.storage.chain import read_chain
    from embckpt.storage.fs import CheckpointStore
    from embckpt.storage.rowfile_ranges import FetchedFile

    root, written = packed_run
    opened: Counter[tuple[int, str]] = Counter()
    reads: Counter[int] = Counter()
    closed: Counter[int] = Counter()
    open_rows, release = CheckpointStore.open_rows, FetchedFile.release

    def counted_open(self: CheckpointStore, step: int, entry: Any, *args: Any) -> Any:
        opened[(step, entry.path)] += 1
        return open_rows(self, step, entry, *args)

    def counted_release(self: FetchedFile) -> None:
        had_source = self.source is not None
        release(self)
        if had_source and self.source is None:
            closed[id(self)] += 1

    monkeypatch.setattr(CheckpointStore, "open_rows", counted_open)
    _count_readers(monkeypatch, Counter(), reads)
    monkeypatch.setattr(FetchedFile, "release", counted_release)
    rebuilt = reconstruct(root, STEPS[-1], threads=2)

    entries = [
        (m.step, f.path) for m in read_chain(CheckpointStore(root), STEPS[-1]) for f in m.files
    ]
    assert opened and set(opened.values()) == {1}, opened  # each file fetched once...
    assert len(opened) < len([e for e in entries if e in opened])  # ...for several blocks
    assert len(closed) == len(opened) and set(closed.values()) == {1}, closed
    assert set(reads.values()) == {1}, reads  # the files are small: one Parquet read each
    truth = assemble([w["at_save"] for w in written])
    for key, weight in rebuilt.tables.items():
        table = next(t for t in truth if key.endswith(t.rsplit(".", 1)[-1] + ".weight"))
        np.testing.assert_array_equal(weight.numpy(), truth[table]["weight"], err_msg=key)


def test_a_large_file_read_block_by_block_builds_its_parquet_reader_once(
    packed_run: tuple[Path, list[dict]],  # noqa: F811 - the fixture imported above
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Files read group by group (none small here) reuse one Parquet reader across their
    blocks' row-id and row reads, and still restore every weight exactly."""
    from embckpt.read.export import reconstruct
    from embckpt.storage import rowfile_ranges

    root, written = packed_run
    built: Counter[int] = Counter()
    reads: Counter[int] = Counter()
    monkeypatch.setattr(rowfile_ranges, "SMALL_BYTES", -1)
    _count_readers(monkeypatch, built, reads)
    rebuilt = reconstruct(root, STEPS[-1], threads=1)
    assert built and set(built.values()) == {1}, built  # one reader per file...
    assert sum(reads.values()) > 2 * len(built), reads  # ...for its row ids and rows, per block
    truth = assemble([w["at_save"] for w in written])
    for key, weight in rebuilt.tables.items():
        table = next(t for t in truth if key.endswith(t.rsplit(".", 1)[-1] + ".weight"))
        np.testing.assert_array_equal(weight.numpy(), truth[table]["weight"], err_msg=key)


@pytest.mark.parametrize("small_bytes", [None, -1])
def test_a_full_s_row_ids_come_from_its_footer_and_its_row_column_is_never_decoded(
    packed_run: tuple[Path, list[dict]],  # noqa: F811 - the fixture imported above
    monkeypatch: pytest.MonkeyPatch,
    small_bytes: int | None,
) -> None:
    """Where each row group holds one run of ids (a full's), the footer's statistics give
    them and no read decodes the row column; elsewhere (a diff's scattered rows) it is
    decoded. Either way the ids are those stored, and every weight restores exactly; with
    files small (one read each) or read group by group."""
    from embckpt.read.export import reconstruct
    from embckpt.storage import rowfile_ranges
    from embckpt.storage.rowfile import ROW_COLUMN

    root, written = packed_run
    if small_bytes is not None:
        monkeypatch.setattr(rowfile_ranges, "SMALL_BYTES", small_bytes)
    asked: dict[int, list[list[str]]] = {}
    runs: dict[int, bool] = {}
    new_reader = rowfile_ranges.FetchedFile._new_reader

    def watched_reader(self: rowfile_ranges.FetchedFile) -> Any:
        reader = new_reader(self)
        read = reader.read_row_groups
        ids = np.concatenate(
            [read([g], columns=[ROW_COLUMN])[ROW_COLUMN].to_numpy() for g in self.groups]
        )
        told = self.contiguous_rows(self.groups)  # from the manifest's index
        runs[id(self)] = told is not None
        footer = rowfile_ranges.FetchedFile(
            self.path, self.size, self.footer, self.segments, self.groups, None
        ).contiguous_rows(self.groups)  # from the footer's statistics (a file without index)
        assert (footer is None) == (told is None), self.path
        if told is not None:
            np.testing.assert_array_equal(footer, told, err_msg=self.path)
        if told is not None:
            np.testing.assert_array_equal(told, ids, err_msg=self.path)
        else:
            assert np.any(np.diff(ids) != 1), self.path  # a run would have been told

        def watched_read(groups: Any, columns: Any = None, **kwargs: Any) -> Any:
            asked.setdefault(id(self), []).append(list(columns or []))
            return read(groups, columns=columns, **kwargs)

        reader.read_row_groups = watched_read
        return reader

    monkeypatch.setattr(rowfile_ranges.FetchedFile, "_new_reader", watched_reader)
    rebuilt = reconstruct(root, STEPS[-1], threads=1)
    told = [f for f, run in runs.items() if run]
    decoded = [f for f, run in runs.items() if not run]
    assert told and decoded, runs  # the chain has both kinds of files
    assert all(ROW_COLUMN not in c for f in told for c in asked.get(f, [])), asked
    assert all(any(ROW_COLUMN in c for c in asked[f]) for f in decoded), asked
    truth = assemble([w["at_save"] for w in written])
    for key, weight in rebuilt.tables.items():
        table = next(t for t in truth if key.endswith(t.rsplit(".", 1)[-1] + ".weight"))
        np.testing.assert_array_equal(weight.numpy(), truth[table]["weight"], err_msg=key)


def _count_readers(monkeypatch: pytest.MonkeyPatch, built: Counter, reads: Counter) -> None:
    """Counts, per fetched file, the Parquet readers built over it and the reads they make."""
    from embckpt.storage.rowfile_ranges import FetchedFile

    new_reader = FetchedFile._new_reader

    def counted_reader(self: FetchedFile) -> Any:
        built[id(self)] += 1
        reader = new_reader(self)
        read = reader.read_row_groups

        def counted_read(*args: Any, **kwargs: Any) -> Any:
            reads[id(self)] += 1
            return read(*args, **kwargs)

        reader.read_row_groups = counted_read
        return reader

    monkeypatch.setattr(FetchedFile, "_new_reader", counted_reader)


def test_raw_rows_are_applied_from_a_view_of_the_file_bytes() -> None:
    import embckpt.codecs.row_kernels  # noqa: F401  (loaded: the scatter takes its kernel path)
    from embckpt.codecs import make_codec
    from embckpt.read.cells import WrittenRows
    from embckpt.read.cells import put_cells as _put
    from embckpt.sharding import TableShard

    codec = make_codec("raw")
    rows = torch.randn(6, 4)
    encoded = codec.encode(rows)
    view = codec.decode_view(encoded, 4)
    assert view is not None and not view.flags.writeable  # the batch's own bytes
    assert np.array_equal(view, rows.numpy())
    assert torch.equal(codec.decode(encoded, 4), rows)  # a copy, as before
    dest = torch.zeros(10, 4)
    shard = TableShard("t", "", "row_wise", 0, 0, 10, 4, dest)
    _put(WrittenRows(shard, np.array([1, 2, 5, 7, 8, 9]), 0, 4, False), view, dest, False)
    assert torch.equal(dest[[1, 2, 5, 7, 8, 9]], rows) and not dest[[0, 3, 4, 6]].any()
    added = torch.ones(10, 4)
    _put(WrittenRows(shard, np.arange(6), 0, 4, False), view, added, True)
    assert torch.equal(added[:6], rows + 1)
    bf16 = make_codec("raw").encode(rows.to(torch.bfloat16))
    assert codec.decode_view(bf16, 4) is None  # numpy has no bfloat16: decode() copies


def test_a_run_of_rows_is_written_and_its_states_copied_from_its_bounds_alone() -> None:
    from embckpt.read.cells import (
        RowRun,
        RowStateRows,
        WrittenRows,
        apply_row_states,
        block_rows,
        listed,
        put_cells,
    )
    from embckpt.sharding import TableShard

    # Global ids 12-14 of a block starting at row 10: a run; 12, 14, 15 are listed.
    assert block_rows(np.array([12, 13, 14]), 10) == RowRun(2, 3)
    scattered = block_rows(np.array([12, 14, 15]), 10)
    assert isinstance(scattered, np.ndarray) and scattered.tolist() == [2, 4, 5]
    assert listed(RowRun(2, 3)).tolist() == [2, 3, 4]
    rows = torch.randn(3, 4)
    dest = torch.zeros(8, 4)
    state = torch.zeros(8)
    shard = TableShard("t", "", "row_wise", 10, 0, 18, 4, dest, row_states={"sum": state})
    put_cells(WrittenRows(shard, RowRun(2, 3), 0, 4, False), rows.numpy(), dest, False)
    assert torch.equal(dest[2:5], rows) and not dest[[0, 1, 5, 6, 7]].any()
    put_cells(WrittenRows(shard, RowRun(5, 3), 0, 4, False), rows, dest, True)  # added
    assert torch.equal(dest[5:8], rows)
    values = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    apply_row_states([RowStateRows(shard, RowRun(1, 3), 0, 4, {"sum": values})])
    assert state.tolist() == [0.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0]
    # Two files of half the columns each: their column-weighted mean, a run and a list.
    state.zero_()
    halves = [
        RowStateRows(shard, RowRun(0, 2), 0, 2, {"sum": np.array([2.0, 4.0], np.float32)}),
        RowStateRows(shard, np.array([0, 1]), 2, 4, {"sum": np.array([4.0, 8.0], np.float32)}),
    ]
    apply_row_states(halves)
    assert state.tolist()[:3] == [3.0, 6.0, 0.0]


@pytest.mark.parametrize("name", ["adaptive", "asymmetric", "symmetric"])
def test_quantized_rows_decode_in_place_as_decode_gives_them(name: str) -> None:
    from embckpt.codecs import make_codec
    from embckpt.errors import CodecError

    codec = make_codec(name, {"bits": 4})
    rows = torch.randn(50, 16)
    encoded = codec.encode(rows)
    block = np.full((60, 16), 7.0, dtype=np.float32)
    assert codec.decode_into(encoded, 16, block[5:55])
    assert np.array_equal(block[5:55], codec.decode(encoded, 16).numpy())
    assert (block[:5] == 7).all() and (block[55:] == 7).all()  # nothing else touched
    with pytest.raises(CodecError):  # the kernel does not check bounds: the caller's error
        codec.decode_into(encoded, 16, block[:40].copy())
    assert not codec.decode_into(encoded, 16, block[5:55, :16:2].copy().astype(np.float64))
