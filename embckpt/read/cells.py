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


@dataclass
class WrittenRows:
    """Rows of one file written into one column segment of one block."""

    shard: TableShard
    local_rows: torch.Tensor  # ascending, local to the block
    col_lo: int  # global columns [col_lo, col_hi) written
    col_hi: int
    from_diff: bool


@dataclass
class RowStateRows:
    """Row-wise state values of one file for one block; applied per checkpoint."""

    shard: TableShard
    local_rows: np.ndarray
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
    first, count = int(rows[0]), len(rows)
    target = dest[:, lo:hi]
    run = int(rows[-1]) - first + 1 == count  # a contiguous run (full checkpoints)
    cpu_copy = not add and dest.device.type == "cpu"
    if isinstance(values, np.ndarray):
        if cpu_copy and values.dtype == as_numpy(target).dtype:
            _copy_rows(as_numpy(target), values, rows, run)
            return
        values = host_copy(values, dest.device)
    values = values.to(dest.dtype)
    if cpu_copy:
        _copy_rows(as_numpy(target), as_numpy(values), rows, run)
        return
    if dest.device.type == "cpu" and dest.dtype in (torch.float32, torch.float64):
        out, src = as_numpy(target), as_numpy(values)  # add: the same float additions as torch's
        if run:
            out[first : first + count] += src
        else:
            # Imported here: its compiled signatures load with the module (numba's start-up,
            # a third of a second in a process that has decoded nothing yet).
            from embckpt.codecs import row_kernels

            row_kernels.add_rows(out, rows.numpy(), src)  # rows are unique: each added once
        return
    values = to_device(values, dest.device)
    if run:
        span = target[first : first + count]
        if add:
            span.add_(values)
        else:
            span.copy_(values)
    elif add:
        target.index_add_(0, to_device(rows, dest.device), values)
    else:
        target.index_copy_(0, to_device(rows, dest.device), values)


def _copy_rows(
    out: np.ndarray, src: np.ndarray, rows: torch.Tensor | np.ndarray, run: bool | None = None
) -> None:
    """``out[rows] = src``: one contiguous copy for a run of rows (``run``: known to be one;
    None: found here); scattered float32 rows by ``row_kernels.copy_rows`` (1.3-3x numpy's
    speed: it keeps several rows' cache misses in flight) where this process has loaded that
    module already (a restore of delta diffs does), by numpy otherwise: loading numba and its
    kernels for this copy alone cost a relaunched rank's lossless restore 0.4-0.5 s
    (``benchmarks/recovery.py``)."""
    at = rows.numpy() if isinstance(rows, torch.Tensor) else rows
    first = int(at[0])
    if run is None:
        run = int(at[-1]) - first + 1 == len(at)
    if run:
        np.copyto(out[first : first + len(at)], src)
        return
    kernels = sys.modules.get("embckpt.codecs.row_kernels")
    rows_of_out = out.ndim == 2 and src.shape == (len(at), out.shape[1])  # no bounds checked
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
                values = torch.from_numpy(np.asarray(p.values[name])).to(target.dtype)
                if target.device.type == "cpu":
                    _copy_rows(as_numpy(target), as_numpy(values), p.local_rows)
                else:
                    rows = to_device(p.local_rows, target.device)
                    target.index_copy_(0, rows, to_device(values, target.device))
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
        mean = (total[held] / weight[held]).to(target.dtype)
        target.index_copy_(0, to_device(held, target.device), to_device(mean, target.device))
