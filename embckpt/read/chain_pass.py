"""Restore, the diffs of a chain in one pass per block.

Why: applied file by file (``apply.py``), each link of a chain cost its fixed work (a decode
per width of each delta file, masks cut per decoded batch, a write per file and column
segment) whatever its bytes: about 11 ms per link on a 2-core machine. Here the diff files of
one block along the whole chain are decoded together (``Codec.decode_many``: one decode per
width and metadata, not per file), then written in chain order. For a block on a GPU,
quantized rows decode there (``cells.device_decodes``), as in ``apply.py``.

Exactness: each diff's every row is written (or added) in chain order, file by file, after the
base: what applying the chain checkpoint by checkpoint does, so a newer write simply comes
later. No masks: staging gives these files unmasked keeps (``Coverage.whole``), and skips the
masks of what newer files give. Those cost more than the writes they saved: a mask per file
and column segment, a gather of every decoded batch, and the coverage bookkeeping over the
block (``plan._Rows``), while the rows they skipped were decoded anyway (a diff is decoded
whole). Measured in fresh ranks on the 2-core machine of ``benchmarks/results/``
(``benchmarks/restore_ab.py``, 3 pairs): the 16-link chain of ``benchmarks/family.py``'s dim128
model in 107-156 ms instead of 162-186 ms, the 8-link chain of its 10.2M-row model in
251-352 ms instead of 311-343 ms.

Which blocks: those whose every diff read is at most ``BATCH_BYTES`` (a diff's usual size:
decoded whole) and gives no other block of this rank, decided before staging
(``plan.chained_blocks``). The others take ``apply.py``'s path (batch by batch, a large file's
batches on several threads); both write disjoint blocks. The files of a block are taken a few
at a time, in chain order (about ``BATCH_BYTES`` of them encoded), which keeps the order above
and bounds the decoded rows.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from embckpt.blocks import TableShard
from embckpt.codecs.base import Codec, EncodedRows, equal_groups
from embckpt.codecs.delta import DeltaCodec
from embckpt.codecs.device_decode import decode_many_on_device
from embckpt.read import cells
from embckpt.read.cells import RowStateRows, WrittenRows, as_numpy, put_cells, take
from embckpt.read.changes import (
    ChangeCells,
    Changes,
    add_changes,
    adds_changes,
    decode_changes,
)
from embckpt.read.plan import Keep
from embckpt.read.stage import StagedFile
from embckpt.storage.phases import PhaseClock
from embckpt.storage.rowfile_read import BATCH_BYTES, RowBatch


def chain_blocks(diffs: Sequence[StagedFile]) -> list[list[StagedFile]]:
    """The diff files of each block the chain pass applies (``StagedFile.chained``, decided
    at staging: ``plan.chained_blocks``), in chain order; the caller applies every other file
    file by file."""
    by_block: dict[int, list[StagedFile]] = {}
    for file in diffs:
        if file.chained:
            by_block.setdefault(id(file.read.targets[0]), []).append(file)
    return [sorted(files, key=lambda f: f.read.position) for files in by_block.values()]


@dataclass
class _Loaded:
    """One diff file's rows for its block: its keep, its batch, its block-local rows."""

    file: StagedFile
    keep: Keep
    batch: RowBatch
    local: np.ndarray


@dataclass
class _Cells:
    """Decoded cells one file gives one column segment of one field (weight or state): its
    kept rows' values, or a delta file's changes with where they go."""

    position: int
    additive: bool
    rows: np.ndarray  # block-local, ascending
    values: torch.Tensor | ChangeCells  # the kept rows (all of the file's columns), or all
    in_file: slice  # the file's columns this segment takes


def apply_block_chain(
    files: Sequence[StagedFile], clock: PhaseClock
) -> tuple[list[WrittenRows], list[tuple[int, RowStateRows]]]:
    """Decodes and writes one block's diff files (one target each, chain order); returns the
    runs written and, with their chain positions, the row-wise states to apply."""
    written: list[WrittenRows] = []
    states: list[tuple[int, RowStateRows]] = []
    try:
        for chunk in _chunks(files):
            started = time.perf_counter()
            loaded = [_load(file) for file in chunk if _keep(file).gives()]
            weight = files[0].read.targets[0].weight
            weights = _decode_grouped(
                loaded, lambda f: f.codec, lambda b: b.encoded, weight.device, adds_changes(weight)
            )
            elem = _decode_elem_states(loaded)
            row_states = _decode_row_states(loaded)
            clock.add("decode", time.perf_counter() - started)
            started = time.perf_counter()
            cells: dict[tuple[int, int, str | None], list[_Cells]] = {}
            for i, item in enumerate(loaded):
                fields: dict[str | None, torch.Tensor | Changes] = {None: weights[i]}
                fields.update(elem[i])
                written.extend(_gather(item, fields, cells))
                states.extend(_row_states(item, row_states[i]))
            shard = files[0].read.targets[0]
            for (lo, hi, field), found in cells.items():
                dest = shard.weight if field is None else shard.elem_states[field]
                _write(shard, lo, hi, dest, found)
            clock.add("apply", time.perf_counter() - started)
    finally:
        for file in files:
            file.checked.close()
    return written, states


def _keep(file: StagedFile) -> Keep:
    if file.keeps is None:
        raise ValueError(f"{file.read.entry.path}: applied before stage() decided its rows")
    return file.keeps[0]


def _chunks(files: Sequence[StagedFile]) -> list[list[StagedFile]]:
    """Consecutive files (chain order) of about ``BATCH_BYTES`` encoded bytes each."""
    chunks: list[list[StagedFile]] = []
    size = BATCH_BYTES
    for file in files:
        if size + file.read.planned_bytes > BATCH_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(file)
        size += file.read.planned_bytes
    return chunks


def _load(file: StagedFile) -> _Loaded:
    keep = _keep(file)
    batch = file.checked.read_all()
    shard = file.read.targets[0]
    local = batch.rows[keep.first : keep.last] - shard.row_offset
    return _Loaded(file, keep, batch, local)


def _decode_grouped(
    loaded: Sequence[_Loaded],
    codec_of: Callable[[StagedFile], Codec],
    encoded_of: Callable[[RowBatch], EncodedRows],
    device: torch.device | None = None,
    sparse: bool = False,
) -> list[torch.Tensor | Changes]:
    """Each file's decoded rows, the files of one codec (and width) decoded as one; on
    ``device`` (the weights' block's) where its rows decode there, as in ``apply.py``, which
    decodes element-wise states on the CPU; a delta codec's as :class:`Changes` where
    ``sparse``."""
    groups = equal_groups(
        (codec_of(item.file).get_config(), item.file.read.entry.shard_cols) for item in loaded
    )
    out: list[torch.Tensor | Changes] = [torch.empty(0)] * len(loaded)
    for members in groups:
        first = loaded[members[0]].file
        codec, cols = codec_of(first), first.read.entry.shard_cols
        items = [encoded_of(loaded[i].batch) for i in members]
        decoded: Sequence[torch.Tensor | Changes] | None = None
        if device is not None and cells.device_decodes(codec, device):
            # The codes cross, not the floats; None where the kernel failed (logged).
            decoded = decode_many_on_device(codec, items, cols, device)
        elif sparse and isinstance(codec, DeltaCodec):
            decoded = decode_changes(codec, items, cols)
        if decoded is None:
            decoded = codec.decode_many(items, cols)
        for i, values in zip(members, decoded, strict=True):
            out[i] = values
    return out


def _decode_elem_states(loaded: Sequence[_Loaded]) -> list[dict[str, torch.Tensor | Changes]]:
    """Each file's decoded element-wise states, by name (each name decoded as one group)."""
    out: list[dict[str, torch.Tensor | Changes]] = [{} for _ in loaded]
    for name in sorted({n for x in loaded for n in x.batch.elem_states}):
        holders = [i for i, x in enumerate(loaded) if name in x.batch.elem_states]
        decoded = _decode_grouped(
            [loaded[i] for i in holders],
            lambda f: f.state_codec,
            functools.partial(_elem_state, name=name),
        )
        for i, values in zip(holders, decoded, strict=True):
            out[i][name] = values
    return out


def _decode_row_states(loaded: Sequence[_Loaded]) -> list[dict[str, np.ndarray]]:
    """Each file's row-wise states as values [rows]: the encoded ones of one name and state
    codec decoded together (``Codec.decode_many``: log8's into one array for all the files)."""
    out: list[dict[str, np.ndarray]] = [{} for _ in loaded]
    groups: list[tuple[str, dict[str, Any], Codec, list[int], list[EncodedRows]]] = []
    for i, item in enumerate(loaded):
        codec = item.file.state_codec
        config = codec.get_config()
        for name, values in item.batch.row_states.items():
            if isinstance(values, np.ndarray):  # stored as values
                out[i][name] = values
                continue
            group = next((g for g in groups if g[0] == name and g[1] == config), None)
            if group is None:
                group = (name, config, codec, [], [])
                groups.append(group)
            group[3].append(i)
            group[4].append(values)
    for name, _, codec, members, encoded in groups:
        for i, decoded in zip(members, codec.decode_many(encoded, 1), strict=True):
            out[i][name] = decoded.reshape(-1).numpy()
    return out


def _elem_state(batch: RowBatch, name: str) -> EncodedRows:
    return batch.elem_states[name]


def _gather(
    item: _Loaded,
    fields: dict[str | None, torch.Tensor | Changes],
    cells: dict[tuple[int, int, str | None], list[_Cells]],
) -> list[WrittenRows]:
    """Adds the cells ``item`` still gives (its keep's masks) to ``cells``, per column
    segment and field; returns the runs of weights it gives."""
    file, keep = item.file, item.keep
    entry, shard = file.read.entry, file.read.targets[0]
    span = slice(keep.first, keep.last)
    written = []
    for lo, hi, mask in keep.segments:
        if mask is not None and not mask.any():
            continue
        rows = item.local if mask is None else item.local[mask]
        written.append(WrittenRows(shard, rows, lo, hi, file.read.from_diff))
        in_file = slice(lo - entry.col_offset, hi - entry.col_offset)
        for name, values in fields.items():
            if name is not None and name not in shard.elem_states:
                continue
            codec = file.codec if name is None else file.state_codec
            position = file.read.position
            if isinstance(values, Changes):  # added where its decoded rows lie (changes.py)
                change = ChangeCells(values, span, mask, item.local, in_file.start)
                found = _Cells(position, True, rows, change, in_file)
            else:
                kept = take(values, span, mask)
                assert isinstance(kept, torch.Tensor)  # decoded rows are tensors
                found = _Cells(position, codec.additive, rows, kept, in_file)
            cells.setdefault((lo, hi, name), []).append(found)
    return written


def _row_states(item: _Loaded, values: dict[str, np.ndarray]) -> list[tuple[int, RowStateRows]]:
    """``item``'s kept row-wise states for its block, with its chain position."""
    file, keep = item.file, item.keep
    shard = file.read.targets[0]
    if not values or (keep.states is not None and not keep.states.any()):
        return []
    pick = slice(None) if keep.states is None else keep.states
    col_lo, col_hi = file.read.columns(shard)
    kept = {
        name: np.asarray(v[keep.first : keep.last])[pick]
        for name, v in values.items()
        if name in shard.row_states
    }
    return [(file.read.position, RowStateRows(shard, item.local[pick], col_lo, col_hi, kept))]


def _write(shard: TableShard, lo: int, hi: int, dest: torch.Tensor, found: list[_Cells]) -> None:
    """Every cell of a column segment in chain order (``found`` is), file by file: a write
    replaces what an older file wrote or added, an addition adds to it, as applying the
    chain checkpoint by checkpoint would. Joining the files first cost a copy and a reorder of
    every value: on the 2-core machine of ``benchmarks/results/``, a third of the
    single-threaded restore of ``benchmarks/stall.py``'s chain on the CPU."""
    for cell in found:
        if isinstance(cell.values, ChangeCells):
            columns = as_numpy(dest)[:, lo - shard.col_offset : hi - shard.col_offset]
            add_changes(cell.values, columns)
            continue
        target = WrittenRows(shard, cell.rows, lo, hi, True)
        put_cells(target, cell.values[:, cell.in_file], dest, add=cell.additive)
