"""Reading a checkpoint chain into table blocks: plan, stage, apply.

The blocks are whatever the caller holds: a rank's local shards (a restore, onto any world
size or plan) or whole tables (an export). Nothing here depends on the writer's plan: files
are addressed by their global row and column block, rows by global row id.

1. plan  - for each block, the rows files of every chain checkpoint whose block overlaps it,
           and in each file the row groups whose row range overlaps it (the manifest's index
           of the Parquet row-group statistics; files without an index are read whole);
2. stage - worker threads fetch the footer and those row groups of each file (local files are
           memory-mapped, so nothing is copied), check every fetched byte against the
           manifest's SHA-256s, check that the codecs are known and decode the row ids. Only
           the row groups of the caller's blocks are staged;
3. apply - checkpoint by checkpoint in chain order (the files of one checkpoint in parallel:
           they hold disjoint blocks), decode the checked bytes in bounded batches and write
           rows and optimizer states into the blocks. Files of a ``delta`` codec are added to
           the rows restored so far. A row-wise optimizer state (one value per row per column
           block) is copied where a block's columns lie inside one writer block, else the
           mean of the writer blocks' values weighted by column overlap.

Decoding after staging keeps staging memory at the encoded bytes (none for local files) rather
than a decoded copy of every row; everything decoded was checked first, and what a decode
could still reject (an unknown codec, a file that does not parse) is found while staging.
Committed files are immutable: rewriting one in place during a read is outside the contract.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from embckpt.codecs import Codec, codec_from_config
from embckpt.errors import CheckpointCorruptError
from embckpt.sharding import TableShard
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.manifest import FileEntry, FileIndex, Manifest
from embckpt.storage.shardfile import CheckedFile, checked_whole, fetch_checked

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


def plan_reads(chain: Sequence[Manifest], shards: Sequence[TableShard]) -> list[FileRead]:
    """The files, and the row groups in them, that ``shards`` need from ``chain``."""
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


# -- stage ------------------------------------------------------------------------------------
@dataclass
class ReadCost:
    """What staging one rank read, against what its blocks need."""

    files: int = 0
    row_groups: int = 0
    bytes_read: int = 0  # rows files: footers and row groups fetched (whole files if unindexed)
    bytes_needed: float = 0.0  # the rows files' bytes of exactly the rows and columns applied
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
    """One file's checked bytes and codecs: everything apply needs, nothing left to verify."""

    read: FileRead
    checked: CheckedFile
    codec: Codec
    state_codec: Codec


def stage_file(store: CheckpointStore, read: FileRead) -> tuple[StagedFile, ReadCost]:
    """Fetches and checks one file's bytes for its target blocks, and its codecs.

    Raises:
        CheckpointCorruptError: a byte range is missing, short or altered; names the file.
        UnknownCodecError: the file's codec is not one this reader knows.
    """
    entry = read.entry
    path = store.step_path(read.step, entry.path)
    index = entry.partial_index
    if read.groups is None or index is None:
        checked = checked_whole(store.read_checked(read.step, entry.written), path)
        row_bytes = np.full(entry.rows, entry.bytes / max(entry.rows, 1))
    else:
        groups = [index.row_groups[g] for g in read.groups]
        checked = _fetch_checked(store, path, entry, index, read.groups)
        row_bytes = np.repeat([g.length / g.rows for g in groups], [g.rows for g in groups])
    try:
        try:
            codec = codec_from_config(checked.meta["codec"])
            state_codec = codec_from_config(checked.meta["state_codec"])
        except KeyError as exc:
            raise CheckpointCorruptError(path, f"no codec in the file's metadata: {exc}") from exc
        rows = checked.row_ids()  # the row column alone: proves the file parses, sizes the need
        if len(rows) != len(row_bytes):
            raise CheckpointCorruptError(
                path, f"{len(rows)} rows where the manifest says {len(row_bytes)}"
            )
    except BaseException:
        checked.close()
        raise
    cost = ReadCost(files=1, bytes_read=checked.bytes_read)
    cost.row_groups = len(read.groups) if read.groups is not None else 0
    for shard in read.targets:
        first, last = np.searchsorted(rows, [shard.row_offset, shard.row_offset + shard.num_rows])
        cols = min(shard.col_offset + shard.num_cols, entry.col_offset + entry.shard_cols) - max(
            shard.col_offset, entry.col_offset
        )
        cost.bytes_needed += float(row_bytes[first:last].sum()) * cols / entry.shard_cols
    return StagedFile(read, checked, codec, state_codec), cost


def _fetch_checked(
    store: CheckpointStore, path: str, entry: FileEntry, index: FileIndex, groups: Sequence[int]
) -> CheckedFile:
    """Fetches and checks the footer and ``groups`` of one file. Local files are memory-mapped:
    the bytes are hashed and later parsed where the page cache holds them, never copied."""
    try:
        source = pa.memory_map(path) if store.is_local else store.fs.open_input_file(path)
    except (OSError, pa.ArrowException) as exc:
        raise CheckpointCorruptError(path, f"cannot read: {exc}") from exc

    def fetch(offset: int, length: int) -> pa.Buffer:
        source.seek(offset)
        return source.read_buffer(length)

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


def stage(
    store: CheckpointStore,
    chain_length: int,
    reads: Sequence[FileRead],
    *,
    threads: int,
    progress: bool,
) -> tuple[list[list[StagedFile]], ReadCost]:
    """Stages every read on ``threads`` worker threads.

    Returns:
        The staged files of each chain checkpoint (base first), and what was read.
    """
    cost = ReadCost()
    bar = _progress_bar(sum(r.planned_bytes for r in reads), progress)
    done: dict[int, StagedFile] = {}
    try:
        with concurrent.futures.ThreadPoolExecutor(max(1, threads), "embckpt-stage") as pool:
            futures = {pool.submit(stage_file, store, read): i for i, read in enumerate(reads)}
            try:
                for future in concurrent.futures.as_completed(futures):
                    staged, file_cost = future.result()
                    done[futures[future]] = staged
                    cost.add(file_cost)
                    if bar is not None:
                        bar.update(reads[futures[future]].planned_bytes)
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
    except BaseException:
        release(list(done.values()))
        raise
    finally:
        if bar is not None:
            bar.close()
    by_position: list[list[StagedFile]] = [[] for _ in range(chain_length)]
    for i, read in enumerate(reads):
        by_position[read.position].append(done[i])
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
    """Rows of one file written into one block; row-wise states wait for the whole checkpoint."""

    shard: TableShard
    local_rows: torch.Tensor  # ascending, local to the block
    col_lo: int  # global columns [col_lo, col_hi) the file covered
    col_hi: int
    row_states: dict[str, torch.Tensor]
    from_diff: bool


@torch.no_grad()
def apply_staged(by_position: Sequence[Sequence[StagedFile]], threads: int) -> list[Applied]:
    """Decodes and writes staged files into their blocks, checkpoint by checkpoint in chain
    order; files of one checkpoint hold disjoint blocks and are written in parallel.

    Returns:
        Every piece written (for the trackers).
    """
    applied: list[Applied] = []
    with concurrent.futures.ThreadPoolExecutor(max(1, threads), "embckpt-apply") as pool:
        for files in by_position:
            pieces = [p for ps in pool.map(_apply_file, files) for p in ps]
            _apply_row_states(pieces)
            applied.extend(pieces)
    return applied


def _apply_file(staged: StagedFile) -> list[Applied]:
    read, entry = staged.read, staged.read.entry
    lo = min(t.row_offset for t in read.targets)
    hi = max(t.row_offset + t.num_rows for t in read.targets)
    add, add_elem = type(staged.codec).delta, type(staged.state_codec).delta
    pieces = []
    try:
        for block in staged.checked.read(lo, hi):
            weights = staged.codec.decode(block.encoded, entry.shard_cols)
            elem_states = {
                name: staged.state_codec.decode(encoded, entry.shard_cols)
                for name, encoded in block.elem_states.items()
            }
            for shard in read.targets:
                first, last = np.searchsorted(
                    block.rows, [shard.row_offset, shard.row_offset + shard.num_rows]
                )
                if first == last:
                    continue
                col_lo = max(shard.col_offset, entry.col_offset)
                col_hi = min(shard.col_offset + shard.num_cols, entry.col_offset + entry.shard_cols)
                a, b = col_lo - entry.col_offset, col_hi - entry.col_offset
                piece = Applied(
                    shard=shard,
                    local_rows=torch.from_numpy(block.rows[first:last] - shard.row_offset),
                    col_lo=col_lo,
                    col_hi=col_hi,
                    row_states={
                        name: torch.from_numpy(np.array(values[first:last], copy=True))
                        for name, values in block.row_states.items()
                    },
                    from_diff=read.from_diff,
                )
                _put(piece, weights[first:last, a:b], shard.weight, add)
                for name, values in elem_states.items():
                    if name in shard.elem_states:
                        _put(piece, values[first:last, a:b], shard.elem_states[name], add_elem)
                pieces.append(piece)
    finally:
        staged.checked.close()
    return pieces


def _put(piece: Applied, values: torch.Tensor, dest: torch.Tensor, add: bool) -> None:
    """Writes (or adds) ``values`` at the piece's rows and columns of ``dest`` (a block view)."""
    lo, hi = piece.col_lo - piece.shard.col_offset, piece.col_hi - piece.shard.col_offset
    rows = piece.local_rows
    first, count = int(rows[0]), len(rows)
    target = dest[:, lo:hi]
    values = values.to(dest)
    if int(rows[-1]) - first + 1 == count:  # a contiguous run (full checkpoints): plain copy
        span = target[first : first + count]
        if add:
            span.add_(values)
        else:
            span.copy_(values)
    elif add:
        target.index_add_(0, rows.to(dest.device), values)
    else:
        target.index_copy_(0, rows.to(dest.device), values)


def _apply_row_states(pieces: Sequence[Applied]) -> None:
    """Row-wise states of one checkpoint: copied where a piece spans its block's columns,
    otherwise the column-overlap-weighted mean of the pieces that hold the row."""
    groups: dict[tuple[int, str], list[Applied]] = {}
    for piece in pieces:
        for name in piece.row_states:
            if name in piece.shard.row_states:
                groups.setdefault((id(piece.shard), name), []).append(piece)
    for (_, name), group in groups.items():
        shard = group[0].shard
        target = shard.row_states[name]
        width = (shard.col_offset, shard.col_offset + shard.num_cols)
        if all((p.col_lo, p.col_hi) == width for p in group):
            for p in group:
                rows = p.local_rows.to(target.device)
                target.index_copy_(0, rows, p.row_states[name].to(target))
            continue
        # Integer weights and float64 sums: equal source values average back to themselves.
        total = torch.zeros(shard.num_rows, dtype=torch.float64)
        weight = torch.zeros(shard.num_rows, dtype=torch.float64)
        for p in group:
            overlap = float(p.col_hi - p.col_lo)
            total.index_add_(0, p.local_rows, p.row_states[name].double() * overlap)
            weight.index_add_(
                0, p.local_rows, torch.full((len(p.local_rows),), overlap, dtype=torch.float64)
            )
        held = torch.nonzero(weight > 0).squeeze(1)
        target.index_copy_(0, held.to(target.device), (total[held] / weight[held]).to(target))
