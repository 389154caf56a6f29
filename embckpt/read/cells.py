"""Restore: writing decoded cells into a block, shared by the file-by-file apply (``apply.py``)
and the chain pass (``chain_pass.py``).

Writes go through numpy on CPU blocks: a torch kernel's own intra-op threads inside the
restore's worker threads oversubscribe the rank's cores (a scatter measured 15x slower).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from embckpt.blocks import TableShard
from embckpt.codecs.base import Codec
from embckpt.codecs.device_decode import serves
from embckpt.codecs.transfer import host_copy, to_device


@dataclass(frozen=True)
class RowRun:
    """Block-local rows ``first`` to ``first + count - 1``, not listed one by one: a full's
    rows come in runs, and listing them cost a 10M-row block's restore 35 ms on one thread
    (an id per row, in new pages) and kept 80 MB until its end, for copies that need only
    the run's bounds."""

    first: int
    count: int

    def __len__(self) -> int:
        return self.count


LocalRows = np.ndarray | RowRun
"""A block's local rows, ascending: listed, or a run."""


def block_rows(ids: np.ndarray, offset: int) -> np.ndarray | RowRun:
    """Global row ids ``ids`` (ascending, unique) as rows of the block starting at ``offset``:
    a :class:`RowRun` where they are consecutive."""
    if len(ids) and int(ids[-1]) - int(ids[0]) + 1 == len(ids):
        return RowRun(int(ids[0]) - offset, len(ids))
    return ids - offset


def listed(rows: LocalRows) -> np.ndarray:
    """``rows`` as an array of row numbers (a run's spelled out)."""
    if isinstance(rows, RowRun):
        return np.arange(rows.first, rows.first + rows.count, dtype=np.int64)
    return rows


def _span(rows: LocalRows) -> tuple[int, int, bool]:
    """The first row, the count, and whether ``rows`` are one run."""
    if isinstance(rows, RowRun):
        return rows.first, rows.count, True
    first, count = int(rows[0]), len(rows)
    return first, count, int(rows[-1]) - first + 1 == count


@dataclass
class WrittenRows:
    """Rows of one file written into one column segment of one block."""

    shard: TableShard
    local_rows: LocalRows  # ascending, local to the block
    col_lo: int  # global columns [col_lo, col_hi) written
    col_hi: int
    from_diff: bool


@dataclass
class RowStateRows:
    """Row-wise state values of one file for one block; applied per checkpoint."""

    shard: TableShard
    local_rows: np.ndarray | RowRun
    col_lo: int  # the global columns [col_lo, col_hi) the file gives the block: the weight
    col_hi: int
    values: dict[str, np.ndarray]


def take(
    values: torch.Tensor | np.ndarray, rows: slice, mask: np.ndarray | None
) -> torch.Tensor | np.ndarray:
    span = values[rows]
    if mask is None or isinstance(span, np.ndarray):
        return span if mask is None else span[mask]
    if span.device.type == "cpu":  # numpy: no intra-op threads (module doc)
        return torch.from_numpy(as_numpy(span)[mask]).view(span.dtype)
    # Indices, not a boolean mask: a mask's count would make the host wait for the device.
    return span.index_select(0, to_device(np.flatnonzero(mask), span.device))


def device_decodes(codec: Codec, device: torch.device) -> bool:
    """Whether rows of ``codec`` for a block on ``device`` decode there: quantized rows for a
    GPU, whose codes then cross instead of their floats (``codecs/device_decode.py``)."""
    return device.type == "cuda" and serves(codec, device)


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as numpy (16-bit floats numpy lacks as int16: copies are bitwise)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.detach().numpy()


def put_cells(
    written: WrittenRows, values: torch.Tensor | np.ndarray, dest: torch.Tensor, add: bool
) -> None:
    """Writes (or adds) ``values`` at the rows and columns ``written`` names in ``dest`` (a
    block's tensor); numpy ``values`` are a read-only view (``RawCodec.decode_view``), copied
    here (for a GPU block into page-locked memory: raw rows cross by DMA).

    Copies into CPU blocks go through numpy (one thread, the GIL released); see the module doc.
    """
    lo, hi = written.col_lo - written.shard.col_offset, written.col_hi - written.shard.col_offset
    rows = written.local_rows
    first, count, run = _span(rows)  # a run: full checkpoints
    target = dest[:, lo:hi]
    cpu_copy = not add and dest.device.type == "cpu"
    if isinstance(values, np.ndarray):
        if cpu_copy and values.dtype == as_numpy(target).dtype:
            _copy_rows(as_numpy(target), values, rows)
            return
        values = host_copy(values, dest.device)
    values = values.to(dest.dtype)
    if cpu_copy:
        _copy_rows(as_numpy(target), as_numpy(values), rows)
        return
    if dest.device.type == "cpu" and dest.dtype in (torch.float32, torch.float64):
        out, src = as_numpy(target), as_numpy(values)  # add: the same float additions as torch's
        if run:
            out[first : first + count] += src
        else:
            # Imported here: its compiled signatures load with the module (numba's start-up,
            # a third of a second in a process that has decoded nothing yet).
            from embckpt.codecs import row_kernels

            row_kernels.add_rows(out, listed(rows), src)  # rows are unique: each added once
        return
    values = to_device(values, dest.device)
    if run:
        span = target[first : first + count]
        if add:
            span.add_(values)
        else:
            span.copy_(values)
    elif add:
        target.index_add_(0, to_device(listed(rows), dest.device), values)
    else:
        target.index_copy_(0, to_device(listed(rows), dest.device), values)


def _copy_rows(out: np.ndarray, src: np.ndarray, rows: LocalRows) -> None:
    """``out[rows] = src``: one contiguous copy for a run of rows; scattered float32 rows by
    ``row_kernels.copy_rows`` (1.3-3x numpy's speed: it keeps several rows' cache misses in
    flight) where this process has loaded that module already (a restore of delta diffs
    does), by numpy otherwise: loading numba and its kernels for this copy alone cost a
    relaunched rank's lossless restore 0.4-0.5 s (``benchmarks/recovery.py``)."""
    first, count, run = _span(rows)
    if run:
        np.copyto(out[first : first + count], src)
        return
    at = listed(rows)
    kernels = sys.modules.get("embckpt.codecs.row_kernels")
    rows_of_out = out.ndim == 2 and src.shape == (count, out.shape[1])  # no bounds checked
    if kernels is not None and out.dtype == src.dtype == np.float32 and rows_of_out:
        kernels.copy_rows(out, at, src)
    else:
        out[at] = src


def apply_row_states(found: Sequence[RowStateRows]) -> None:
    """Row-wise states of one checkpoint: copied where a file's columns span the block's,
    otherwise the column-overlap-weighted mean of the files that hold the row."""
    groups: dict[tuple[int, str], list[RowStateRows]] = {}
    for held_rows in found:
        for name in held_rows.values:
            groups.setdefault((id(held_rows.shard), name), []).append(held_rows)
    for (_, name), group in groups.items():
        shard = group[0].shard
        target = shard.row_states[name]
        width = (shard.col_offset, shard.col_offset + shard.num_cols)
        if all((p.col_lo, p.col_hi) == width for p in group):
            for p in group:
                if not len(p.local_rows):
                    continue
                given = np.asarray(p.values[name])  # may be read-only Arrow memory
                if target.device.type == "cpu" and given.dtype == as_numpy(target).dtype:
                    _copy_rows(as_numpy(target), given, p.local_rows)  # copied, not converted
                    continue
                values = torch.tensor(given).to(target.dtype)
                if target.device.type == "cpu":
                    _copy_rows(as_numpy(target), as_numpy(values), p.local_rows)
                else:
                    rows = to_device(listed(p.local_rows), target.device)
                    target.index_copy_(0, rows, to_device(values, target.device))
            continue
        # Integer weights and float64 sums: equal source values average back to themselves.
        total = torch.zeros(shard.num_rows, dtype=torch.float64)
        weight = torch.zeros(shard.num_rows, dtype=torch.float64)
        for p in group:
            overlap = float(p.col_hi - p.col_lo)
            rows = torch.from_numpy(listed(p.local_rows))
            total.index_add_(0, rows, torch.tensor(p.values[name]).double() * overlap)
            weight.index_add_(0, rows, torch.full((len(rows),), overlap, dtype=torch.float64))
        held = torch.nonzero(weight > 0).squeeze(1)
        mean = (total[held] / weight[held]).to(target.dtype)
        target.index_copy_(0, to_device(held, target.device), to_device(mean, target.device))
