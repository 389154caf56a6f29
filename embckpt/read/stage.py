"""Restore, second room: fetch and verify the planned bytes, checkpoint by checkpoint.

Checkpoint by checkpoint, newest first, worker threads fetch the footer and the planned row
groups of each file (``CheckpointStore.open_rows``: local files are memory-mapped, nothing is
copied) and verify every fetched byte against the manifest's checksums. Staging also checks
that the file's codecs are known and decodes its row ids, so what a decode could still reject
(an unknown codec, a file that does not parse) is found here, before any rank writes a row.
Between checkpoints, :class:`~embckpt.read.plan.Coverage` prunes the older checkpoints' row
groups and marks the rows each staged file still gives.

What the restore's clock counts here: ``fetch`` is getting the bytes (for memory-mapped local
files only the mapping: their page-cache reads happen while verifying), ``verify`` the checksums
and parsing the footer, ``decode`` the row ids.

Staging keeps memory at the encoded bytes of the fetched row groups (none for local files)
rather than a decoded copy of every row. Committed files are immutable: rewriting one in
place during a read is outside the contract.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embckpt.codecs import Codec, codec_from_config
from embckpt.errors import CheckpointCorruptError
from embckpt.read.plan import Coverage, FileRead, Keep
from embckpt.read.pool import worker_pool
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.phases import RESTORE_PHASES, PhaseClock
from embckpt.storage.rowfile_read import CheckedFile

THREADS_ENV = "EMBCKPT_RESTORE_THREADS"


def default_threads() -> int:
    """Reader threads per rank: the ``EMBCKPT_RESTORE_THREADS`` environment variable, else this
    rank's share of the machine's cores (``LOCAL_WORLD_SIZE`` ranks per machine), between 1
    and 8."""
    if os.environ.get(THREADS_ENV):
        return max(1, int(os.environ[THREADS_ENV]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return min(8, max(1, (cores or 1) // local_ranks))


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

    ``rows`` are the staged rows' global ids (ascending), ``row_bytes`` each one's share of the
    bytes read, ``keeps`` per target block the rows still newest (set by :func:`stage`).
    """

    read: FileRead
    checked: CheckedFile
    codec: Codec
    state_codec: Codec
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    row_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    keeps: list[Keep] | None = None

    @property
    def additive(self) -> bool:
        """Whether applying this file adds to what older checkpoints restored."""
        return self.codec.additive or self.state_codec.additive

    def needed_bytes(self) -> float:
        """The bytes of exactly the cells this file gives its blocks."""
        entry, total = self.read.entry, 0.0
        for keep in self.keeps or ():
            share = self.row_bytes[keep.first : keep.last]
            for lo, hi, mask in keep.segments:
                taken = share if mask is None else share[mask]
                total += float(taken.sum()) * (hi - lo) / entry.shard_cols
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
    entry = read.entry
    checked = store.open_rows(read.step, entry, read.groups, clock)
    index = entry.partial_index
    if read.groups is None or index is None:
        row_bytes = np.full(entry.rows, entry.bytes / max(entry.rows, 1))
    else:
        groups = [index.row_groups[g] for g in read.groups]
        row_bytes = np.repeat([g.length / g.rows for g in groups], [g.rows for g in groups])
    try:
        try:
            codec = codec_from_config(checked.header["codec"])
            state_codec = codec_from_config(checked.header["state_codec"])
        except KeyError as exc:
            raise CheckpointCorruptError(
                checked.path, f"no codec in the file's metadata: {exc}"
            ) from exc
        with clock.time("decode"):
            rows = checked.row_ids()  # the row column alone: proves the file parses
        if len(rows) != len(row_bytes):
            raise CheckpointCorruptError(
                checked.path, f"{len(rows)} rows where the manifest says {len(row_bytes)}"
            )
    except BaseException:
        checked.close()
        raise
    cost = ReadCost(files=1, bytes_read=checked.bytes_read)
    cost.row_groups = len(read.groups) if read.groups is not None else 0
    return StagedFile(read, checked, codec, state_codec, rows, row_bytes), cost


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
    each file's row groups pruned and its rows masked by what newer checkpoints give.

    Returns:
        The staged files of each chain checkpoint (base first), and what was read.
    """
    clock = clock or PhaseClock(RESTORE_PHASES)
    cost = ReadCost()
    bar = _progress_bar(sum(r.planned_bytes for r in reads), progress)
    coverage = Coverage(reads)
    by_position: list[list[StagedFile]] = [[] for _ in range(chain_length)]
    try:
        with worker_pool(threads, "embckpt-stage") as pool:
            for position in reversed(range(chain_length)):
                with clock.time("plan"):
                    pruned = [coverage.prune(r) for r in reads if r.position == position]
                todo = [r for r in pruned if r is not None]
                futures = [pool.submit(stage_file, store, read, clock) for read in todo]
                try:
                    for future in concurrent.futures.as_completed(futures):
                        staged, file_cost = future.result()
                        by_position[position].append(staged)
                        cost.add(file_cost)
                        if bar is not None:
                            bar.update(staged.read.planned_bytes)
                except BaseException:
                    for future in futures:
                        future.cancel()
                    for future in futures:  # the ones already running: closed below
                        if not future.cancelled() and future.exception() is None:
                            staged = future.result()[0]
                            if staged not in by_position[position]:
                                by_position[position].append(staged)
                    raise
                with clock.time("plan"):
                    files = sorted(by_position[position], key=lambda f: f.read.entry.path)
                    by_position[position] = files
                    for file in files:
                        file.keeps = coverage.keep(file.read, file.rows)
                        cost.bytes_needed += file.needed_bytes()
                    for file in files if position else ():  # nothing older than the base
                        coverage.give(file.read, file.rows, file.additive)
    except BaseException:
        release([file for files in by_position for file in files])
        raise
    finally:
        if bar is not None:
            bar.close()
    return by_position, cost


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
