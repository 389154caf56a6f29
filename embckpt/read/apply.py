"""Restore, third room: decode the staged bytes and write each cell once, into its block.

Files are decoded in bounded batches and each cell is written once, from the newest file that
holds it: those writes are disjoint, so every file is applied in parallel. (The small diffs of
most blocks go to ``chain_pass.py`` instead: every row of each, in chain order.) Files of an
additive codec (``Codec.additive``) add to what older checkpoints restored, so a chain with
one is applied checkpoint by checkpoint in chain order (the masks still skip what a newer file
that replaces rows overwrites). Row-wise optimizer states (one value per row per column block)
come from the newest checkpoint holding the row: copied where a block's columns lie inside one
writer block, else the mean of that checkpoint's writer blocks weighted by column overlap.

Writes go through numpy on CPU blocks: a torch kernel's own intra-op threads inside this
module's worker threads oversubscribe the rank's cores (a scatter measured 15x slower).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from embckpt.blocks import TableShard
from embckpt.codecs.delta import DeltaCodec
from embckpt.codecs.device_decode import decode_on_device
from embckpt.codecs.raw import RawCodec
from embckpt.codecs.uniform import UniformCodec
from embckpt.cores import rank_cores
from embckpt.read import cells
from embckpt.read.cells import (
    RowRun,
    RowStateRows,
    WrittenRows,
    apply_row_states,
    as_numpy,
    block_rows,
    listed,
    put_cells,
    take,
)
from embckpt.read.chain_pass import apply_block_chain, chain_blocks
from embckpt.read.changes import (
    ChangeCells,
    Changes,
    add_changes,
    adds_changes,
    decode_changes,
)
from embckpt.read.plan import Keep, plan_reads
from embckpt.read.pool import inline_size, submit_all, worker_pool
from embckpt.read.stage import StagedFile, default_threads, release, stage
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.manifest import Manifest
from embckpt.storage.phases import RESTORE_PHASES, PhaseClock
from embckpt.storage.rowfile_read import RowBatch, row_state_values


@dataclass(frozen=True)
class _Overlap:
    """Where one decoded batch meets one block's kept rows: the same rows as a slice of the
    batch and as a slice of the block's :class:`Keep` masks."""

    in_batch: slice
    in_keep: slice


def _overlap(keep: Keep, batch_start: int, batch_rows: int) -> _Overlap | None:
    """The rows a batch and a block share, or None.

    Positions count among the file's staged rows: the block's rows are positions
    ``[keep.first, keep.last)``, the batch's ``[batch_start, batch_start + batch_rows)``.
    """
    start, stop = max(keep.first, batch_start), min(keep.last, batch_start + batch_rows)
    if stop <= start:
        return None
    return _Overlap(
        slice(start - batch_start, stop - batch_start), slice(start - keep.first, stop - keep.first)
    )


@torch.no_grad()
def apply_staged(
    by_position: Sequence[Sequence[StagedFile]],
    threads: int,
    clock: PhaseClock | None = None,
) -> list[WrittenRows]:
    """Decodes and writes staged files into their blocks: the chain's base whole
    (contiguous copies beat a scatter that skips the few rows diffs replace), then the diffs:
    of most blocks all along the chain at once (``chain_pass.py``), of the others file by
    file, in parallel (each cell comes from the newest diff holding it), or diff by diff in
    chain order when one of an additive codec adds to older ones; then the row-wise states,
    checkpoint by checkpoint.

    Returns:
        Every run of weights written (the caller's tracker marks the diffs' rows).
    """
    clock = clock or PhaseClock(RESTORE_PHASES)
    if not by_position:
        return []
    base = [_unmasked(file) for file in by_position[0]]
    blocks = chain_blocks([file for files in by_position[1:] for file in files])
    in_pass = {id(file) for files in blocks for file in files}
    diffs = [[file for file in files if id(file) not in in_pass] for files in by_position[1:]]
    if not any(file.additive for files in diffs for file in files):
        diffs = [[file for files in diffs for file in files]]
    waves = [base, *diffs]
    written: list[WrittenRows] = []
    states: dict[int, list[RowStateRows]] = {}
    try:
        with worker_pool(threads, "embckpt-apply") as pool:
            for wave in waves:
                # Largest first, so that the last file to finish is a small one; the small
                # ones run on this thread meanwhile (pool.inline_size).
                wave.sort(key=lambda f: -f.read.planned_bytes)
                tasks = _FileTasks(wave, threads)
                run = functools.partial(tasks.run, clock=clock)
                futures = submit_all(
                    pool,
                    [
                        (inline_size(file.read.planned_bytes), run, (task,))
                        for file, task in zip(tasks.files, tasks.tasks, strict=True)
                    ],
                )
                for file, future in zip(tasks.files, futures, strict=True):
                    weights, row_states = future.result()
                    written.extend(weights)
                    states.setdefault(file.read.position, []).extend(row_states)
            # Other blocks than the waves': written after them or beside them alike.
            chain_futures = submit_all(
                pool,
                [
                    (_chain_inline_size(files), apply_block_chain, (files, clock))
                    for files in blocks
                ],
            )
            for future in chain_futures:
                weights, found = future.result()
                written.extend(weights)
                for position, rows in found:
                    states.setdefault(position, []).append(rows)
    finally:
        release([file for files in by_position for file in files])
    with clock.time("apply"):
        for position in sorted(states):
            apply_row_states(states[position])
    return written


def _chain_inline_size(files: Sequence[StagedFile]) -> int | None:
    """What ``submit_all`` weighs for one block's chain pass: on a rank of one core, nothing
    (it runs on the calling thread, whatever its bytes), else its encoded bytes where small.

    Why: a chain pass is mostly Python, a few thousand rows at a time, so on one core a
    second thread gains little overlap and pays the GIL's hand-overs. Measured on the 2-core
    machine of ``benchmarks/results/`` (2 ranks, 2 threads each, interleaved rounds): the
    16-link chain of ``benchmarks/family.py``'s dim128 model restored in 208 ms instead of
    254 (best of 20), 370 ms of CPU instead of 463. Where one rank holds most of the chain
    (rows10M_dim16: its 10M-row table's diffs), a second thread could use the core the other
    rank leaves idle, yet it measured within noise: as long over 6 links, over 15 links 4-10%
    longer in two runs and 2% shorter in a third."""
    encoded = sum(file.read.planned_bytes for file in files)
    return 0 if rank_cores() <= 1 else inline_size(encoded)


class _FileTasks:
    """A wave's files as tasks for the worker threads: a large file's runs of row groups
    (``CheckedFile.runs``) one task each, so that one large table (a 10M-row table on one
    rank) decodes on every thread; a file is closed when its last task ends."""

    def __init__(self, wave: Sequence[StagedFile], threads: int) -> None:
        self.tasks: list[tuple[int, Sequence[Sequence[int]] | None]] = []
        self.files: list[StagedFile] = []
        self._wave = wave
        self._left: list[int] = []
        self._lock = threading.Lock()
        for i, file in enumerate(wave):
            runs = file.checked.runs() if threads > 1 and not file.checked.small else []
            parts: list[Sequence[Sequence[int]] | None] = (
                [[r] for r in runs] if len(runs) > 1 else [None]
            )
            self.tasks.extend((i, part) for part in parts)
            self.files.extend(file for _ in parts)
            self._left.append(len(parts))

    def run(
        self, task: tuple[int, Sequence[Sequence[int]] | None], clock: PhaseClock
    ) -> tuple[list[WrittenRows], list[RowStateRows]]:
        index, runs = task
        file = self._wave[index]
        try:
            return _apply_file(file, clock, runs)
        finally:
            with self._lock:
                self._left[index] -= 1
                last = self._left[index] == 0
            if last:
                file.checked.close()


def _apply_file(
    staged: StagedFile, clock: PhaseClock, runs: Sequence[Sequence[int]] | None = None
) -> tuple[list[WrittenRows], list[RowStateRows]]:
    """Decodes one staged file batch by batch (its row groups ``runs``: all if None) and
    writes, into each target block, the cells its :class:`Keep` still gives; returns what it
    wrote and the row-wise states to apply (the caller closes the file).

    Three numberings meet here. A worked example: the file's staged rows have global ids
    ``[10, 11, 12, 20, 21, 30]`` (positions 0 to 5); block A holds global rows 0 to 15, so
    its keep covers positions ``first=0, last=3``; block B holds rows 16 to 40, positions
    3 to 6. A decoded batch holds rows ``[12, 20, 21]``: it starts at position 2
    (``batch_start``, found by searching its first id among the staged rows).

    - A meets the batch at position 2 alone: the batch's rows ``[0:1]`` and A's masks
      ``[2:3]``; block-local row ``12 - 0 = 12``.
    - B meets it at positions 3 and 4: the batch's rows ``[1:3]`` and B's masks ``[0:2]``;
      block-local rows ``20 - 16 = 4`` and ``21 - 16 = 5``.

    Columns are global in a keep's segments; the file's own columns start at
    ``entry.col_offset`` and a block's at ``shard.col_offset``.
    """
    read, entry, keeps = staged.read, staged.read.entry, staged.keeps
    if keeps is None:
        raise ValueError(f"{entry.path}: applied before stage() decided which rows it gives")
    lo = min(t.row_offset for t in read.targets)
    hi = max(t.row_offset + t.num_rows for t in read.targets)
    written: list[WrittenRows] = []
    row_state_rows: list[RowStateRows] = []
    batches = staged.checked.read(lo, hi, runs)
    while True:
        started = time.perf_counter()
        batch = next(batches, None)
        if batch is None:
            clock.add("decode", time.perf_counter() - started)
            break
        batch_start = int(np.searchsorted(staged.rows, batch.rows[0]))
        overlaps = [_overlap(keep, batch_start, len(batch.rows)) for keep in keeps]
        if not any(
            o is not None and k.gives(o.in_keep) for k, o in zip(keeps, overlaps, strict=True)
        ):
            clock.add("decode", time.perf_counter() - started)
            continue
        decoded = _Decoded.of(staged, batch, _whole_run(staged, batch, keeps, overlaps))
        clock.add("decode", time.perf_counter() - started)
        started = time.perf_counter()
        for shard, keep, overlap in zip(read.targets, keeps, overlaps, strict=True):
            if overlap is not None:
                local = block_rows(batch.rows[overlap.in_batch], shard.row_offset)
                written.extend(_write_cells(staged, decoded, shard, keep, overlap, local))
                found = _row_states(staged, decoded, shard, keep, overlap, local)
                row_state_rows.extend(_copied_now(staged, found))
        clock.add("apply", time.perf_counter() - started)
    return written, row_state_rows


def _copied_now(staged: StagedFile, found: list[RowStateRows]) -> list[RowStateRows]:
    """Copies the base's row-wise states that span their block's columns at once, and
    returns the others, to apply once every file of their checkpoint is decoded.

    Why: nothing older is applied after the base, and a spanning file's rows are the only
    ones of its checkpoint that hold their state (writer blocks do not overlap), so copying
    them now gives what the copy after the waves gave, while the batch's decoded states are
    freed at once instead of held to the end (40 MB for a 10M-row block)."""
    if staged.read.position != 0:
        return found
    now = [r for r in found if (r.col_lo, r.col_hi) == _columns(r.shard)]
    apply_row_states(now)
    return [r for r in found if (r.col_lo, r.col_hi) != _columns(r.shard)]


def _columns(shard: TableShard) -> tuple[int, int]:
    return shard.col_offset, shard.col_offset + shard.num_cols


@dataclass(frozen=True)
class _Decoded:
    """One batch's weights, element-wise and row-wise states, decoded, each written once into
    the block: raw weights stay a read-only view of the batch's bytes
    (``RawCodec.decode_view``) that ``put_cells`` copies; quantized ones that fill a run of the
    block whole are decoded straight into it (``weights`` None: already written); for a block
    on a GPU quantized rows decode there (``cells.device_decodes``)."""

    weights: torch.Tensor | np.ndarray | Changes | None
    elem_states: dict[str, torch.Tensor]
    row_states: dict[str, np.ndarray]

    @classmethod
    def of(
        cls, staged: StagedFile, batch: RowBatch, into: np.ndarray | torch.Tensor | None
    ) -> _Decoded:
        cols = staged.read.entry.shard_cols
        codec = staged.codec
        device = staged.read.targets[0].weight.device
        weights: torch.Tensor | np.ndarray | Changes | None = None
        written = False
        if isinstance(codec, DeltaCodec) and all(
            adds_changes(t.weight) for t in staged.read.targets
        ):  # added where its decoded rows lie (changes.py)
            (weights,) = decode_changes(codec, [batch.encoded], cols)
        elif isinstance(into, torch.Tensor):  # a run of a block where the rows decode
            written = decode_on_device(codec, batch.encoded, cols, device, into) is not None
        elif isinstance(codec, UniformCodec) and into is not None:
            written = codec.decode_into(batch.encoded, cols, into)
        elif cells.device_decodes(codec, device):  # the codes cross to the device, not floats
            weights = decode_on_device(codec, batch.encoded, cols, device)
        elif isinstance(codec, RawCodec):
            weights = codec.decode_view(batch.encoded, cols)
        if weights is None and not written:
            weights = codec.decode(batch.encoded, cols)
        return cls(
            weights,
            {n: staged.state_codec.decode(e, cols) for n, e in batch.elem_states.items()},
            row_state_values(batch, staged.state_codec),
        )


def _whole_run(
    staged: StagedFile, batch: RowBatch, keeps: Sequence[Keep], overlaps: Sequence[_Overlap | None]
) -> np.ndarray | torch.Tensor | None:
    """The rows of the one block a batch's weights fill whole, as one contiguous run, all
    columns, replacing what is there (a full's rows): where they can be decoded in place (a
    tensor where they decode on the block's device, else an array)."""
    entry, n = staged.read.entry, len(batch.rows)
    overlap = overlaps[0] if len(keeps) == 1 else None
    if overlap is None or overlap.in_batch != slice(0, n) or staged.codec.additive:
        return None
    shard, (segment, *more) = staged.read.targets[0], keeps[0].segments
    weight = shard.weight
    if (
        more
        or segment[2] is not None  # a mask: some rows are newer elsewhere
        or segment[:2] != (shard.col_offset, shard.col_offset + shard.num_cols)
        or (entry.col_offset, entry.shard_cols) != (shard.col_offset, shard.num_cols)
        or weight.dtype != torch.float32
        or not weight.is_contiguous()
    ):
        return None
    on_device = cells.device_decodes(staged.codec, weight.device)
    if weight.device.type != "cpu" and not on_device:
        return None
    first = int(batch.rows[0]) - shard.row_offset
    if int(batch.rows[-1]) - shard.row_offset - first + 1 != n:
        return None
    return weight[first : first + n] if on_device else as_numpy(weight)[first : first + n]


def _write_cells(
    staged: StagedFile,
    decoded: _Decoded,
    shard: TableShard,
    keep: Keep,
    overlap: _Overlap,
    local: np.ndarray | RowRun,
) -> list[WrittenRows]:
    """Writes (or adds) a batch's kept weights and element-wise states into one block, column
    segment by column segment; ``local`` are the overlap's block-local rows."""
    entry = staged.read.entry
    written = []
    for col_lo, col_hi, mask in keep.segments:
        kept = None if mask is None else mask[overlap.in_keep]
        if kept is not None and not kept.any():
            continue
        rows = WrittenRows(
            shard,
            local if kept is None else listed(local)[kept],
            col_lo,
            col_hi,
            staged.read.from_diff,
        )
        in_file = slice(col_lo - entry.col_offset, col_hi - entry.col_offset)
        if isinstance(decoded.weights, Changes):
            columns = as_numpy(shard.weight)[
                :, col_lo - shard.col_offset : col_hi - shard.col_offset
            ]
            change = ChangeCells(
                decoded.weights, overlap.in_batch, kept, listed(local), in_file.start
            )
            add_changes(change, columns)
        elif decoded.weights is not None:  # else decoded in place (_whole_run)
            values = take(decoded.weights, overlap.in_batch, kept)[:, in_file]
            put_cells(rows, values, shard.weight, staged.codec.additive)
        for name, state in decoded.elem_states.items():
            if name in shard.elem_states:
                values = take(state, overlap.in_batch, kept)[:, in_file]
                put_cells(rows, values, shard.elem_states[name], staged.state_codec.additive)
        written.append(rows)
    return written


def _row_states(
    staged: StagedFile,
    decoded: _Decoded,
    shard: TableShard,
    keep: Keep,
    overlap: _Overlap,
    local: np.ndarray | RowRun,
) -> list[RowStateRows]:
    """A batch's kept row-wise states for one block, to apply per checkpoint (the base's at
    once where they can be: :func:`_copied_now`)."""
    kept = None if keep.states is None else keep.states[overlap.in_keep]
    if not decoded.row_states or (kept is not None and not kept.any()):
        return []
    pick = slice(None) if kept is None else kept
    col_lo, col_hi = staged.read.columns(shard)
    values = {
        name: np.asarray(values[overlap.in_batch])[pick]
        for name, values in decoded.row_states.items()
        if name in shard.row_states
    }
    rows = local if kept is None else listed(local)[kept]
    return [RowStateRows(shard, rows, col_lo, col_hi, values)]


def _unmasked(file: StagedFile) -> StagedFile:
    """``file`` (the chain's base) writing all its rows' weights and row-wise states: the
    diffs overwrite theirs afterwards (row-wise states checkpoint by checkpoint, no state codec
    is additive), and one contiguous copy beats gathering the rows they skip (on a 10M-row
    block, masking its row-wise states cost a restore of any chain 75 ms)."""
    file.keeps = [
        replace(k, segments=tuple((lo, hi, None) for lo, hi, _ in k.segments), states=None)
        for k in file.keeps or ()
    ]
    return file


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
