"""Reading a checkpoint chain into table blocks: plan, fetch, verify, decode, apply.

The blocks are whatever the caller holds: a rank's local shards (a restore, onto any world
size or plan) or whole tables (an export). Nothing here depends on the writer's plan: files
are addressed by their global row and column block, rows by global row id.

1. plan   - for each block, the rows files of every chain checkpoint whose block overlaps it,
            and in each file the row groups whose row range overlaps it (the manifest's index
            of the Parquet row-group statistics; files without an index are read whole);
2. stage  - checkpoint by checkpoint, newest first, worker threads fetch the footer and the
            planned row groups of each file (local files are memory-mapped: nothing is
            copied), verify every fetched byte against the manifest's checksums, check that
            the codecs are known and decode the row ids. A row group is dropped before it is
            fetched when newer checkpoints already give every row it could hold (its row
            range, from the index), and each staged file records, per block and column
            segment, which of its rows are still the newest version (:class:`Coverage`);
3. apply  - decode the checked bytes in bounded batches and write each cell once, from the
            newest file that holds it: those writes are disjoint, so every file is applied in
            parallel. Files of a ``delta`` codec add to what older checkpoints restored, so a
            chain with one is applied checkpoint by checkpoint in chain order (the masks still
            skip what a newer non-delta file overwrites). Row-wise optimizer states (one value
            per row per column block) come from the newest checkpoint holding the row: copied
            where a block's columns lie inside one writer block, else the mean of that
            checkpoint's writer blocks weighted by column overlap.

Staging keeps memory at the encoded bytes of the fetched row groups (none for local files)
rather than a decoded copy of every row; everything decoded was verified first, and what a
decode could still reject (an unknown codec, a file that does not parse) is found while
staging. Writes go through numpy on CPU blocks: a torch kernel's own intra-op threads inside
this module's worker threads oversubscribe the rank's cores (a scatter measured 15x slower).
Committed files are immutable: rewriting one in place during a read is outside the contract.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from embckpt.codecs import Codec, codec_from_config
from embckpt.errors import CheckpointCorruptError
from embckpt.sharding import TableShard
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.manifest import FileEntry, FileIndex, Manifest
from embckpt.storage.phases import RESTORE_PHASES, PhaseClock
from embckpt.storage.shardfile import (
    CheckedFile,
    checked_whole,
    fetch_checked,
    row_state_values,
)

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


# Restore phases (``RESTORE_PHASES``, thread-seconds): ``fetch`` is getting the bytes (for
# memory-mapped local files only the mapping: their page-cache reads happen while verifying);
# ``verify`` the checksums and footer parsing; ``decode`` Parquet and the codecs (the row ids
# while staging included); ``apply`` the writes into the blocks.


# -- plan -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FileRead:
    """One rows file to read for some of this rank's blocks.

    ``groups`` are the row groups to fetch; None when the manifest has no index for the file
    (written before indexes existed): the whole file is fetched and checked.
    """

    position: int  # the checkpoint's place in the chain, base first
    step: int
    from_diff: bool
    entry: FileEntry
    targets: tuple[TableShard, ...]
    groups: tuple[int, ...] | None

    @property
    def planned_bytes(self) -> int:
        index = self.entry.partial_index
        if index is None or self.groups is None:
            return self.entry.bytes
        footer = self.entry.bytes - index.footer_offset
        return footer + sum(index.row_groups[g].length for g in self.groups)

    def columns(self, shard: TableShard) -> tuple[int, int]:
        """The global columns [lo, hi) this file gives ``shard``."""
        entry = self.entry
        return (
            max(shard.col_offset, entry.col_offset),
            min(shard.col_offset + shard.num_cols, entry.col_offset + entry.shard_cols),
        )


def plan_reads(chain: Sequence[Manifest], shards: Sequence[TableShard]) -> list[FileRead]:
    """The files, and the row groups in them, that ``shards`` need from ``chain`` (before the
    newest-first pruning of :func:`stage`)."""
    by_table: dict[str, list[TableShard]] = {}
    for shard in shards:
        by_table.setdefault(shard.table, []).append(shard)
    reads = []
    for position, manifest in enumerate(chain):
        for entry in manifest.files:
            if entry.role != "rows":
                continue
            targets = tuple(
                s
                for s in by_table.get(entry.table, ())
                if entry.overlaps(
                    s.row_offset,
                    s.row_offset + s.num_rows,
                    s.col_offset,
                    s.col_offset + s.num_cols,
                )
            )
            if not targets:
                continue
            groups = None
            index = entry.partial_index
            if index is not None:
                groups = tuple(
                    i
                    for i, g in enumerate(index.row_groups)
                    if any(
                        g.first_row < s.row_offset + s.num_rows and s.row_offset <= g.last_row
                        for s in targets
                    )
                )
                if not groups:
                    continue  # the file's rows all lie outside this rank's blocks
            reads.append(
                FileRead(position, manifest.step, manifest.kind == "diff", entry, targets, groups)
            )
    return reads


# -- newest first -------------------------------------------------------------------------------
def _member(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """``values`` (ascending, unique) in ``sorted_set`` (ascending, unique), elementwise."""
    if not len(sorted_set) or not len(values):
        return np.zeros(len(values), dtype=bool)
    if len(sorted_set) < len(values):  # search the smaller array in the larger (``values``
        # ascend too): a base's rows against the few its diffs give
        at = np.searchsorted(values, sorted_set)
        found = at < len(values)
        found[found] = values[at[found]] == sorted_set[found]
        member = np.zeros(len(values), dtype=bool)
        member[at[found]] = True
        return member
    at = np.searchsorted(sorted_set, values).clip(max=len(sorted_set) - 1)
    return sorted_set[at] == values


def _union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The union of two ascending unique arrays, ascending and unique (``np.union1d`` hashes:
    measured 20x slower on sorted input)."""
    if not len(a) or not len(b):
        return b if not len(a) else a
    both = np.concatenate([a, b])
    both.sort(kind="stable")  # two sorted runs: merged in linear time
    fresh = np.empty(len(both), dtype=bool)
    fresh[0] = True
    np.not_equal(both[1:], both[:-1], out=fresh[1:])
    return both[fresh]


def _count_in(sorted_set: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """How many of ``sorted_set`` lie in each closed range [lo, hi]."""
    return np.searchsorted(sorted_set, hi, side="right") - np.searchsorted(sorted_set, lo)


@dataclass(frozen=True)
class Keep:
    """Which staged rows of one file still give one block their newest version.

    ``first:last`` are the file's staged rows inside the block; ``segments`` are the block's
    column segments [lo, hi) the file covers, each with a mask over ``first:last`` (None: all
    of them); ``states`` the same for the row-wise optimizer states.
    """

    first: int
    last: int
    segments: tuple[tuple[int, int, np.ndarray | None], ...]
    states: np.ndarray | None


class Coverage:
    """The rows that newer checkpoints of a chain already give each block.

    Weights and element-wise states are tracked per cell: per block and column segment (the
    column boundaries of every file over the block), only from non-delta files (a delta adds
    to older versions instead of replacing them). Row-wise states are tracked per row: the
    newest checkpoint holding a row gives its state (see the module doc).
    """

    def __init__(self, reads: Sequence[FileRead]) -> None:
        bounds: dict[int, set[int]] = {}
        for read in reads:
            for shard in read.targets:
                bounds.setdefault(id(shard), set()).update(read.columns(shard))
        self._bounds = {key: sorted(cuts) for key, cuts in bounds.items()}
        self._cells: dict[tuple[int, int], np.ndarray] = {}
        self._states: dict[int, np.ndarray] = {}
        self._empty = np.zeros(0, dtype=np.int64)

    def segments(self, read: FileRead, shard: TableShard) -> list[tuple[int, int]]:
        lo, hi = read.columns(shard)
        cuts = [c for c in self._bounds[id(shard)] if lo <= c <= hi]
        return list(zip(cuts[:-1], cuts[1:], strict=True))

    def prune(self, read: FileRead) -> FileRead | None:
        """``read`` without the row groups whose every possible row newer files already give
        (for each target block, in each column segment and for the row-wise states); None when
        no row group is left."""
        index = read.entry.partial_index
        if read.groups is None or index is None:
            return read
        groups = np.array(read.groups)
        first = np.array([index.row_groups[g].first_row for g in read.groups])
        last = np.array([index.row_groups[g].last_row for g in read.groups])
        needed = np.zeros(len(groups), dtype=bool)
        for shard in read.targets:
            lo = first.clip(min=shard.row_offset)
            hi = last.clip(max=shard.row_offset + shard.num_rows - 1)
            overlap = hi >= lo
            span = hi - lo + 1
            given = [
                self._cells.get((id(shard), seg[0]), self._empty)
                for seg in self.segments(read, shard)
            ]
            if shard.row_states:
                given.append(self._states.get(id(shard), self._empty))
            for rows in given:
                needed |= overlap & (_count_in(rows, lo, hi) < span)
        if needed.all():
            return read
        if not needed.any():
            return None
        return FileRead(
            read.position,
            read.step,
            read.from_diff,
            read.entry,
            read.targets,
            tuple(int(g) for g in groups[needed]),
        )

    def keep(self, read: FileRead, rows: np.ndarray) -> list[Keep]:
        """Per target block, which of a staged file's ``rows`` are still the newest."""
        keeps = []
        for shard in read.targets:
            first, last = np.searchsorted(
                rows, [shard.row_offset, shard.row_offset + shard.num_rows]
            )
            inside = rows[first:last]
            segments = []
            for lo, hi in self.segments(read, shard):
                mask = ~_member(inside, self._cells.get((id(shard), lo), self._empty))
                segments.append((lo, hi, None if mask.all() else mask))
            states = ~_member(inside, self._states.get(id(shard), self._empty))
            keeps.append(
                Keep(int(first), int(last), tuple(segments), None if states.all() else states)
            )
        return keeps

    def give(self, read: FileRead, rows: np.ndarray, delta: bool) -> None:
        """Records a staged file's rows as given (cells only for a non-delta file). Files of
        one checkpoint are recorded after all of them were kept: their row-wise states
        average together."""
        for shard in read.targets:
            first, last = np.searchsorted(
                rows, [shard.row_offset, shard.row_offset + shard.num_rows]
            )
            inside = rows[first:last]
            if not len(inside):
                continue
            if not delta:
                for lo, _ in self.segments(read, shard):
                    key = (id(shard), lo)
                    self._cells[key] = _union(self._cells.get(key, self._empty), inside)
            self._states[id(shard)] = _union(self._states.get(id(shard), self._empty), inside)


# -- stage ------------------------------------------------------------------------------------
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
    def delta(self) -> bool:
        """Whether applying this file adds to what older checkpoints restored."""
        return type(self.codec).delta or type(self.state_codec).delta

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
    path = store.step_path(read.step, entry.path)
    index = entry.partial_index
    if read.groups is None or index is None:
        with clock.time("fetch"):  # fetched and checked in one call: counted as fetching
            checked = checked_whole(store.read_checked(read.step, entry.written), path)
        row_bytes = np.full(entry.rows, entry.bytes / max(entry.rows, 1))
    else:
        groups = [index.row_groups[g] for g in read.groups]
        checked = _fetch_checked(store, path, entry, index, read.groups, clock)
        row_bytes = np.repeat([g.length / g.rows for g in groups], [g.rows for g in groups])
    try:
        try:
            codec = codec_from_config(checked.meta["codec"])
            state_codec = codec_from_config(checked.meta["state_codec"])
        except KeyError as exc:
            raise CheckpointCorruptError(path, f"no codec in the file's metadata: {exc}") from exc
        with clock.time("decode"):
            rows = checked.row_ids()  # the row column alone: proves the file parses
        if len(rows) != len(row_bytes):
            raise CheckpointCorruptError(
                path, f"{len(rows)} rows where the manifest says {len(row_bytes)}"
            )
    except BaseException:
        checked.close()
        raise
    cost = ReadCost(files=1, bytes_read=checked.bytes_read)
    cost.row_groups = len(read.groups) if read.groups is not None else 0
    return StagedFile(read, checked, codec, state_codec, rows, row_bytes), cost


def _fetch_checked(
    store: CheckpointStore,
    path: str,
    entry: FileEntry,
    index: FileIndex,
    groups: Sequence[int],
    clock: PhaseClock,
) -> CheckedFile:
    """Fetches and checks the footer and ``groups`` of one file. Local files are memory-mapped:
    the bytes are hashed and later parsed where the page cache holds them, never copied."""
    try:
        source = pa.memory_map(path) if store.is_local else store.fs.open_input_file(path)
    except (OSError, pa.ArrowException) as exc:
        raise CheckpointCorruptError(path, f"cannot read: {exc}") from exc

    spent = 0.0

    def fetch(offset: int, length: int) -> pa.Buffer:
        nonlocal spent
        begun = time.perf_counter()
        try:
            source.seek(offset)
            return source.read_buffer(length)
        finally:
            spent += time.perf_counter() - begun

    started = time.perf_counter()
    try:
        size = source.size()
        if size != entry.bytes:
            raise CheckpointCorruptError(
                path, f"size is {size} bytes, the manifest says {entry.bytes}"
            )
        return fetch_checked(fetch, entry.bytes, index, groups, path, source)
    except BaseException:
        source.close()
        raise
    finally:  # what fetch_checked spent outside its fetches was checking
        clock.add("fetch", spent)
        clock.add("verify", time.perf_counter() - started - spent)


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
        with concurrent.futures.ThreadPoolExecutor(max(1, threads), "embckpt-stage") as pool:
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
                        coverage.give(file.read, file.rows, file.delta)
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


def read_into(
    store: CheckpointStore,
    chain: Sequence[Manifest],
    shards: Sequence[TableShard],
    *,
    threads: int | None = None,
    progress: bool = False,
) -> None:
    """Plans, stages and applies ``chain`` into ``shards`` in one process (export, merge): the
    code path of a restore, without the agreement between ranks that separates staging from
    applying there."""
    threads = threads or default_threads()
    staged, _ = stage(
        store, len(chain), plan_reads(chain, shards), threads=threads, progress=progress
    )
    apply_staged(staged, threads)


# -- apply ------------------------------------------------------------------------------------
@dataclass
class Applied:
    """Rows of one file written into one column segment of one block."""

    shard: TableShard
    local_rows: torch.Tensor  # ascending, local to the block
    col_lo: int  # global columns [col_lo, col_hi) written
    col_hi: int
    from_diff: bool


@dataclass
class _StatePiece:
    """Row-wise state values of one file for one block; applied per checkpoint."""

    shard: TableShard
    local_rows: np.ndarray
    col_lo: int  # the global columns [col_lo, col_hi) the file gives the block: the weight
    col_hi: int
    values: dict[str, np.ndarray]


@torch.no_grad()
def apply_staged(
    by_position: Sequence[Sequence[StagedFile]],
    threads: int,
    clock: PhaseClock | None = None,
) -> list[Applied]:
    """Decodes and writes staged files into their blocks: the chain's base first, whole
    (contiguous copies beat a scatter that skips the few rows diffs replace), then every diff
    in parallel (each cell comes from the newest diff holding it), or diff by diff in chain
    order when one of a delta codec adds to older ones; then the row-wise states, checkpoint
    by checkpoint.

    Returns:
        Every piece of weights written (for the trackers).
    """
    clock = clock or PhaseClock(RESTORE_PHASES)
    if not by_position:
        return []
    base = [_unmasked(file) for file in by_position[0]]
    diffs: list[list[StagedFile]] = [list(files) for files in by_position[1:]]
    if not any(file.delta for files in diffs for file in files):
        diffs = [[file for files in diffs for file in files]]
    waves = [base, *diffs]
    applied: list[Applied] = []
    states: dict[int, list[_StatePiece]] = {}
    try:
        with concurrent.futures.ThreadPoolExecutor(max(1, threads), "embckpt-apply") as pool:
            for wave in waves:
                # Largest first, so that the last file to finish is a small one.
                wave.sort(key=lambda f: -f.read.planned_bytes)
                for file, (pieces, state_pieces) in zip(
                    wave, pool.map(lambda f: _apply_file(f, clock), wave), strict=True
                ):
                    applied.extend(pieces)
                    states.setdefault(file.read.position, []).extend(state_pieces)
    finally:
        release([file for files in by_position for file in files])
    with clock.time("apply"):
        for position in sorted(states):
            _apply_row_states(states[position])
    return applied


def _apply_file(staged: StagedFile, clock: PhaseClock) -> tuple[list[Applied], list[_StatePiece]]:
    read, entry, keeps = staged.read, staged.read.entry, staged.keeps
    if keeps is None:
        raise ValueError(f"{entry.path}: applied before stage() decided which rows it gives")
    lo = min(t.row_offset for t in read.targets)
    hi = max(t.row_offset + t.num_rows for t in read.targets)
    add, add_elem = type(staged.codec).delta, type(staged.state_codec).delta
    pieces: list[Applied] = []
    state_pieces: list[_StatePiece] = []
    blocks = staged.checked.read(lo, hi)
    try:
        while True:
            started = time.perf_counter()
            block = next(blocks, None)
            if block is None:
                clock.add("decode", time.perf_counter() - started)
                break
            # Where the batch starts among the staged rows (both ascending, unique).
            at = int(np.searchsorted(staged.rows, block.rows[0]))
            spans = [(max(k.first, at), min(k.last, at + len(block.rows))) for k in keeps]
            if not any(
                b > a and _any_kept(k, a - k.first, b - k.first)
                for k, (a, b) in zip(keeps, spans, strict=True)
            ):
                clock.add("decode", time.perf_counter() - started)
                continue
            weights = staged.codec.decode(block.encoded, entry.shard_cols)
            elem_states = {
                name: staged.state_codec.decode(encoded, entry.shard_cols)
                for name, encoded in block.elem_states.items()
            }
            row_states = row_state_values(block, staged.state_codec)
            clock.add("decode", time.perf_counter() - started)
            started = time.perf_counter()
            for shard, keep, (a, b) in zip(read.targets, keeps, spans, strict=True):
                if b <= a:
                    continue
                rows = block.rows[a - at : b - at] - shard.row_offset
                for col_lo, col_hi, mask in keep.segments:
                    m = None if mask is None else mask[a - keep.first : b - keep.first]
                    if m is not None and not m.any():
                        continue
                    local = rows if m is None else rows[m]
                    piece = Applied(shard, torch.from_numpy(local), col_lo, col_hi, read.from_diff)
                    ca, cb = col_lo - entry.col_offset, col_hi - entry.col_offset
                    _put(piece, _take(weights, a - at, b - at, m)[:, ca:cb], shard.weight, add)
                    for name, values in elem_states.items():
                        if name in shard.elem_states:
                            taken = _take(values, a - at, b - at, m)[:, ca:cb]
                            _put(piece, taken, shard.elem_states[name], add_elem)
                    pieces.append(piece)
                m = None if keep.states is None else keep.states[a - keep.first : b - keep.first]
                if row_states and (m is None or m.any()):
                    col_lo, col_hi = read.columns(shard)
                    state_pieces.append(
                        _StatePiece(
                            shard,
                            rows if m is None else rows[m],
                            col_lo,
                            col_hi,
                            {
                                name: np.asarray(values[a - at : b - at])[
                                    m if m is not None else slice(None)
                                ]
                                for name, values in row_states.items()
                                if name in shard.row_states
                            },
                        )
                    )
            clock.add("apply", time.perf_counter() - started)
    finally:
        staged.checked.close()
    return pieces, state_pieces


def _unmasked(file: StagedFile) -> StagedFile:
    """``file`` writing all its rows' weights (its row-wise states stay masked)."""
    file.keeps = [
        replace(k, segments=tuple((lo, hi, None) for lo, hi, _ in k.segments))
        for k in file.keeps or ()
    ]
    return file


def _any_kept(keep: Keep, a: int, b: int) -> bool:
    """Whether rows [a, b) of ``keep`` give anything (weights of a segment or states)."""
    if keep.states is None or keep.states[a:b].any():
        return True
    return any(mask is None or mask[a:b].any() for _, _, mask in keep.segments)


def _take(values: torch.Tensor, a: int, b: int, mask: np.ndarray | None) -> torch.Tensor:
    span = values[a:b]
    if mask is None:
        return span
    if span.device.type == "cpu":  # numpy: no intra-op threads (module doc)
        return torch.from_numpy(_numpy(span)[mask]).view(span.dtype)
    return span[torch.from_numpy(mask).to(span.device)]


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as numpy (16-bit floats numpy lacks as int16: copies are bitwise)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.detach().numpy()


def _put(piece: Applied, values: torch.Tensor, dest: torch.Tensor, add: bool) -> None:
    """Writes (or adds) ``values`` at the piece's rows and columns of ``dest`` (a block view).

    Copies into CPU blocks go through numpy (one thread, the GIL released); see the module doc.
    """
    lo, hi = piece.col_lo - piece.shard.col_offset, piece.col_hi - piece.shard.col_offset
    rows = piece.local_rows
    first, count = int(rows[0]), len(rows)
    target = dest[:, lo:hi]
    values = values.to(dest.dtype)
    run = int(rows[-1]) - first + 1 == count  # a contiguous run (full checkpoints)
    if not add and dest.device.type == "cpu":
        out, src = _numpy(target), _numpy(values)
        if run:
            np.copyto(out[first : first + count], src)
        else:
            out[rows.numpy()] = src
        return
    values = values.to(dest.device)
    if run:
        span = target[first : first + count]
        if add:
            span.add_(values)
        else:
            span.copy_(values)
    elif add:
        target.index_add_(0, rows.to(dest.device), values)
    else:
        target.index_copy_(0, rows.to(dest.device), values)


def _apply_row_states(pieces: Sequence[_StatePiece]) -> None:
    """Row-wise states of one checkpoint: copied where a piece spans its block's columns,
    otherwise the column-overlap-weighted mean of the pieces that hold the row."""
    groups: dict[tuple[int, str], list[_StatePiece]] = {}
    for piece in pieces:
        for name in piece.values:
            groups.setdefault((id(piece.shard), name), []).append(piece)
    for (_, name), group in groups.items():
        shard = group[0].shard
        target = shard.row_states[name]
        width = (shard.col_offset, shard.col_offset + shard.num_cols)
        if all((p.col_lo, p.col_hi) == width for p in group):
            for p in group:
                if not len(p.local_rows):
                    continue
                values = torch.tensor(p.values[name]).to(target.dtype)
                if target.device.type == "cpu":
                    _numpy(target)[p.local_rows] = _numpy(values)
                else:
                    rows = torch.from_numpy(p.local_rows).to(target.device)
                    target.index_copy_(0, rows, values.to(target.device))
            continue
        # Integer weights and float64 sums: equal source values average back to themselves.
        total = torch.zeros(shard.num_rows, dtype=torch.float64)
        weight = torch.zeros(shard.num_rows, dtype=torch.float64)
        for p in group:
            overlap = float(p.col_hi - p.col_lo)
            rows = torch.from_numpy(p.local_rows)
            total.index_add_(0, rows, torch.tensor(p.values[name]).double() * overlap)
            weight.index_add_(0, rows, torch.full((len(rows),), overlap, dtype=torch.float64))
        held = torch.nonzero(weight > 0).squeeze(1)
        target.index_copy_(0, held.to(target.device), (total[held] / weight[held]).to(target))
