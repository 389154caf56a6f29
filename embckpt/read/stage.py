"""Restore, second room: fetch and verify the planned bytes, checkpoint by checkpoint.

Checkpoint by checkpoint, newest first, worker threads fetch the footer and the planned row
groups of each file (``CheckpointStore.open_rows``: local files are memory-mapped, nothing is
copied) and verify every fetched byte against the manifest's checksums. A packed file is
fetched once for all the blocks this rank takes from it (:func:`stage_blocks`): a chain's
diffs are many such small files, whose fixed costs a fetch per block multiplied. Staging also checks
that the file's codecs are known and decodes its row ids, so what a decode could still reject
(an unknown codec, a file that does not parse) is found here, before any rank writes a row.
Between checkpoints, :class:`~embckpt.read.plan.Coverage` prunes the older checkpoints' row
groups and marks the rows each staged file still gives (not for the diffs the chain pass
applies in chain order, ``plan.chained_blocks``: they keep every row); the positions of small
diffs are fetched all at once, unpruned, from the start (their fixed costs overlap on the
threads).

What the restore's clock counts here: ``fetch`` is getting the bytes (for memory-mapped local
files only the mapping: their page-cache reads happen while verifying), ``verify`` the checksums
and parsing the footer, ``decode`` the row ids.

Staging keeps memory at the encoded bytes of the fetched row groups (none for local files)
rather than a decoded copy of every row; only small files (``rowfile_ranges.SMALL_BYTES``)
keep their rows read, once for all their blocks. Committed files are immutable: rewriting one in
place during a read is outside the contract.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from embckpt.codecs import Codec, codec_from_config
from embckpt.cores import restore_threads
from embckpt.errors import CheckpointCorruptError
from embckpt.read.plan import Coverage, FileRead, Keep, chained_blocks
from embckpt.read.pool import inline_size, submit_all, worker_pool
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.manifest import FileEntry, RowGroupEntry
from embckpt.storage.phases import RESTORE_PHASES, PhaseClock
from embckpt.storage.rowfile_read import BATCH_BYTES, CheckedFile

THREADS_ENV = "EMBCKPT_RESTORE_THREADS"


def default_threads() -> int:
    """Reader threads where the other ranks' work is unknown (the follower, a merge): the
    ``EMBCKPT_RESTORE_THREADS`` environment variable, else
    :func:`~embckpt.cores.restore_threads` (twice this rank's share of the machine's cores,
    ``LOCAL_WORLD_SIZE`` ranks per machine, at most 8). A restore weighs the ranks' planned
    bytes instead (``restore._threads``)."""
    return asked_threads() or restore_threads()


def asked_threads() -> int | None:
    """Reader threads per rank that the ``EMBCKPT_RESTORE_THREADS`` environment variable
    asks for, or None."""
    if os.environ.get(THREADS_ENV):
        return max(1, int(os.environ[THREADS_ENV]))
    return None


@dataclass
class ReadCost:
    """What staging one rank read, against what its blocks need."""

    files: int = 0
    row_groups: int = 0
    bytes_read: int = 0  # rows files: footers and row groups fetched (whole files if unindexed)
    bytes_needed: float = 0.0  # the rows files' bytes of exactly the cells applied
    other_bytes: int = 0  # dense and per-rank files

    def add(self, other: ReadCost) -> None:
        self.files += other.files
        self.row_groups += other.row_groups
        self.bytes_read += other.bytes_read
        self.bytes_needed += other.bytes_needed
        self.other_bytes += other.other_bytes

    @property
    def ratio(self) -> float:
        """Bytes read over bytes needed (1.0 is ideal)."""
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0


@dataclass
class StagedFile:
    """One file's checked bytes and codecs: everything apply needs, nothing left to verify.

    ``rows`` are the staged rows' global ids (ascending); the bytes read are shared among them
    group by group (``group_ends``: where each fetched row group's rows end among ``rows``;
    ``group_rate``: its bytes per row; kept per group, not per row: a full of 10M rows would
    need a 10M-entry array); ``keeps`` per target block the rows still newest (set by
    :func:`stage`).
    """

    read: FileRead
    checked: CheckedFile
    codec: Codec
    state_codec: Codec
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    group_ends: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    group_rate: np.ndarray = field(default_factory=lambda: np.zeros(0))
    keeps: list[Keep] | None = None
    chained: bool = False  # applied by the chain pass, in chain order (``chain_pass.py``)

    @property
    def additive(self) -> bool:
        """Whether applying this file adds to what older checkpoints restored."""
        return self.codec.additive or self.state_codec.additive

    def needed_bytes(self) -> float:
        """The bytes of exactly the cells this file gives its blocks."""
        entry, total = self.read.entry, 0.0
        ends = self.group_ends
        if len(ends) == 1:  # one row group (a diff's block): its rate times the kept rows
            rate = float(self.group_rate[0])
            for keep in self.keeps or ():
                for lo, hi, mask in keep.segments:
                    kept = keep.last - keep.first if mask is None else np.count_nonzero(mask)
                    total += kept * rate * (hi - lo) / entry.shard_cols
            return total
        starts = np.concatenate([[0], ends[:-1]])
        for keep in self.keeps or ():
            # Each group's rows among the keep's positions [first, last), then the kept ones.
            lo_at = (starts - keep.first).clip(0, keep.last - keep.first)
            hi_at = (ends - keep.first).clip(0, keep.last - keep.first)
            for lo, hi, mask in keep.segments:
                if mask is None:
                    counts = hi_at - lo_at
                else:  # one count per row group (a few): a running sum cost a pass per row
                    counts = np.array(
                        [np.count_nonzero(mask[a:b]) for a, b in zip(lo_at, hi_at, strict=True)]
                    )
                total += float(counts @ self.group_rate) * (hi - lo) / entry.shard_cols
        return total


def stage_file(
    store: CheckpointStore, read: FileRead, clock: PhaseClock | None = None
) -> tuple[StagedFile, ReadCost]:
    """Fetches and checks one file's bytes for its target blocks, and its codecs.

    Raises:
        CheckpointCorruptError: a byte range is missing, short or altered; names the file.
        UnknownCodecError: the file's codec is not one this reader knows.
    """
    clock = clock or PhaseClock(RESTORE_PHASES)
    checked = store.open_rows(read.step, read.entry, read.groups, clock)
    staged = _staged(read, checked, clock)
    cost = ReadCost(files=1, bytes_read=checked.bytes_read)
    cost.row_groups = len(read.groups) if read.groups is not None else 0
    return staged, cost


def stage_blocks(
    store: CheckpointStore, reads: Sequence[FileRead], clock: PhaseClock | None = None
) -> tuple[list[StagedFile], ReadCost]:
    """:func:`stage_file` for blocks of one packed file (``reads``, of one checkpoint), from
    one fetch: the footer fetched, checked and parsed once, each row group once, and a small
    file's rows read once for all its blocks (``CheckedFile.blocks``)."""
    if len(reads) == 1:
        one, cost = stage_file(store, reads[0], clock)
        return [one], cost
    clock = clock or PhaseClock(RESTORE_PHASES)
    entry, groups = _one_fetch(reads)
    checked = store.open_rows(reads[0].step, entry, groups, clock)
    try:
        views = checked.blocks([(read.entry.block, _parquet_groups(read)) for read in reads])
    finally:
        checked.close()  # the views hold the fetched bytes
    staged: list[StagedFile] = []
    known: list[tuple[Any, Codec]] = []  # the file's blocks mostly share their codecs
    try:
        for read, view in zip(reads, views, strict=True):
            staged.append(_staged(read, view, clock, known))
    except BaseException:
        for view in views:  # closing twice is harmless
            view.close()
        raise
    return staged, ReadCost(files=1, row_groups=len(groups), bytes_read=checked.bytes_read)


def _by_file(reads: Sequence[FileRead]) -> list[list[FileRead]]:
    """``reads`` (of one checkpoint) grouped by file: the indexed blocks of one packed file
    together, every other read alone."""
    grouped: dict[object, list[FileRead]] = {}
    for read in reads:
        packed = read.entry.block is not None and read.entry.partial_index is not None
        key = read.entry.path if packed and read.groups is not None else id(read)
        grouped.setdefault(key, []).append(read)
    return list(grouped.values())


def _parquet_groups(read: FileRead) -> list[int]:
    index = read.entry.partial_index
    assert index is not None and read.groups is not None  # packed and indexed (_by_file)
    return [index.first_group + g for g in read.groups]


def _one_fetch(reads: Sequence[FileRead]) -> tuple[FileEntry, list[int]]:
    """An entry whose index spans the row groups of every block ``reads`` take from one
    packed file, and the positions in it to fetch. The blocks between them that no read takes
    keep their places with an empty entry: never fetched, so never checked against it."""
    indexes = [r.entry.partial_index for r in reads]
    assert all(i is not None for i in indexes)  # packed and indexed (_by_file)
    first = min(i.first_group for i in indexes if i is not None)
    end = max(i.first_group + len(i.row_groups) for i in indexes if i is not None)
    slots: list[RowGroupEntry] = [_NOT_READ] * (end - first)
    for index in indexes:
        if index is not None:
            start = index.first_group - first
            slots[start : start + len(index.row_groups)] = index.row_groups
    groups = sorted(g - first for read in reads for g in _parquet_groups(read))
    entry = reads[0].entry
    assert entry.index is not None
    return replace(
        entry, index=replace(entry.index, first_group=first, row_groups=tuple(slots))
    ), groups


_NOT_READ = RowGroupEntry(first_row=0, last_row=-1, rows=0, offset=0, length=0, checksum="")


def _staged(
    read: FileRead,
    checked: CheckedFile,
    clock: PhaseClock,
    known: list[tuple[Any, Codec]] | None = None,
) -> StagedFile:
    """A staged file from its checked bytes (closed on failure): its codecs known and its
    row ids read (decoded, or told by the index where each row group is one run of ids).
    Codecs of a config in ``known`` (the blocks of one packed file staged so far) are shared,
    not rebuilt: codecs decode on several threads at once already (a writer's blocks share
    one), and rebuilding two per block cost about a tenth of a small link's staging."""
    entry = read.entry
    index = entry.partial_index
    if read.groups is None or index is None:
        counts, sizes = [entry.rows], [entry.bytes]
    else:
        groups = [index.row_groups[g] for g in read.groups]
        counts, sizes = [g.rows for g in groups], [g.length for g in groups]
    group_ends = np.cumsum(np.array(counts, dtype=np.int64))
    group_rate = np.array(sizes, dtype=np.float64) / np.maximum(counts, 1)
    try:
        try:
            codec = _codec(checked.header["codec"], known)
            state_codec = _codec(checked.header["state_codec"], known)
        except KeyError as exc:
            raise CheckpointCorruptError(
                checked.path, f"no codec in the file's metadata: {exc}"
            ) from exc
        with clock.time("decode"):
            rows = checked.row_ids()  # a small file is read whole here
        listed = int(group_ends[-1]) if len(group_ends) else 0
        if len(rows) != listed:
            raise CheckpointCorruptError(
                checked.path, f"{len(rows)} rows where the manifest says {listed}"
            )
    except BaseException:
        checked.close()
        raise
    return StagedFile(read, checked, codec, state_codec, rows, group_ends, group_rate)


def _codec(config: Any, known: list[tuple[Any, Codec]] | None) -> Codec:
    """The codec ``config`` names: one of ``known`` with an equal config, else a new one
    (added to ``known``). Configs are compared as dicts: few per file, and cheaper than a key."""
    for seen, codec in known or ():
        if seen == config:
            return codec
    codec = codec_from_config(config)
    if known is not None:
        known.append((config, codec))
    return codec


def stage(
    store: CheckpointStore,
    chain_length: int,
    reads: Sequence[FileRead],
    *,
    threads: int,
    progress: bool,
    clock: PhaseClock | None = None,
) -> tuple[list[list[StagedFile]], ReadCost]:
    """Stages every read on ``threads`` worker threads, checkpoint by checkpoint newest first,
    each file's row groups pruned and its rows masked by what newer checkpoints give (the
    small diffs fetched at once, unpruned: :func:`_prefetch`).

    Returns:
        The staged files of each chain checkpoint (base first), and what was read.
    """
    clock = clock or PhaseClock(RESTORE_PHASES)
    cost = ReadCost()
    bar = _progress_bar(sum(r.planned_bytes for r in reads), progress)
    coverage = Coverage(reads)
    chained = chained_blocks(reads)
    by_position: list[list[StagedFile]] = [[] for _ in range(chain_length)]
    submitted: list[tuple[int, concurrent.futures.Future]] = []
    try:
        with worker_pool(threads, "embckpt-stage") as pool:
            try:
                early = _prefetch(pool, store, chain_length, reads, clock)
                submitted.extend((p, f) for p, futures in early.items() for f in futures)
                for position in reversed(range(chain_length)):
                    futures = early.get(position)
                    if futures is None:
                        with clock.time("plan"):
                            pruned = [coverage.prune(r) for r in reads if r.position == position]
                        todo = [r for r in pruned if r is not None]
                        futures = _submit_files(pool, store, _by_file(todo), clock)
                        submitted.extend((position, f) for f in futures)
                    for future in concurrent.futures.as_completed(futures):
                        staged, file_cost = future.result()
                        by_position[position].extend(staged)
                        cost.add(file_cost)
                        if bar is not None:
                            bar.update(sum(s.read.planned_bytes for s in staged))
                    with clock.time("plan"):
                        files = sorted(by_position[position], key=lambda f: f.read.entry.path)
                        by_position[position] = files
                        for file in files:
                            file.chained = position > 0 and id(file.read.targets[0]) in chained
                            if file.chained:
                                file.keeps = coverage.whole(file.read, file.rows)
                            else:
                                file.keeps = coverage.keep(file.read, file.rows)
                            cost.bytes_needed += file.needed_bytes()
                        for file in files if position else ():  # nothing older than the base
                            if file.chained:
                                continue
                            assert file.keeps is not None  # kept just above
                            coverage.give(file.read, file.rows, file.keeps, file.additive)
            except BaseException:  # whatever failed: what any position staged is released
                _collect(submitted, by_position)
                raise
    except BaseException:
        release([file for files in by_position for file in files])
        raise
    finally:
        if bar is not None:
            bar.close()
    return by_position, cost


def _prefetch(
    pool: concurrent.futures.Executor,
    store: CheckpointStore,
    chain_length: int,
    reads: Sequence[FileRead],
    clock: PhaseClock,
) -> dict[int, list[concurrent.futures.Future]]:
    """Submits at once, unpruned, the files of every diff position whose reads are small (at
    most ``BATCH_BYTES`` in all: a chain's diffs, usually): pruning saves little of them, and
    staged together their fixed costs (fetch, checks, parsing) overlap on the threads instead
    of waiting position by position. Files are immutable, so staging early reads the same."""
    early: dict[int, list[concurrent.futures.Future]] = {}
    for position in reversed(range(1, chain_length)):
        at = [r for r in reads if r.position == position]
        if at and sum(r.planned_bytes for r in at) <= BATCH_BYTES:
            early[position] = _submit_files(pool, store, _by_file(at), clock)
    return early


def _submit_files(
    pool: concurrent.futures.Executor,
    store: CheckpointStore,
    files: Sequence[Sequence[FileRead]],
    clock: PhaseClock,
) -> list[concurrent.futures.Future]:
    """:func:`stage_blocks` of each file: the large ones on ``pool``, the small ones of a
    local disk on the calling thread (``pool.inline_size``: a local read does not wait, and a
    small file's work is mostly Python)."""
    return submit_all(
        pool,
        [
            (
                inline_size(sum(r.planned_bytes for r in reads), store.is_local),
                stage_blocks,
                (store, reads, clock),
            )
            for reads in files
        ],
    )


def _collect(
    submitted: Sequence[tuple[int, concurrent.futures.Future]],
    by_position: list[list[StagedFile]],
) -> None:
    """After a failure: cancels what has not started and adds what was staged to
    ``by_position`` (whose files the caller releases)."""
    for _, future in submitted:
        future.cancel()
    for position, future in submitted:  # the ones already running: closed by the caller
        if future.cancelled() or future.exception() is not None:
            continue
        for staged_file in future.result()[0]:
            if staged_file not in by_position[position]:
                by_position[position].append(staged_file)


def release(staged: Sequence[StagedFile]) -> None:
    """Closes staged files (their memory maps) without applying them."""
    for file in staged:
        file.checked.close()


def _progress_bar(total: int, progress: bool) -> Any:
    if not progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: no bar without it
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc="embckpt restore", leave=False)
