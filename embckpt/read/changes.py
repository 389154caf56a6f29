"""Restore: a ``delta`` diff's changes added into a CPU block, file by file, each file's rows
in one pass.

Why: the changes of a file come in width groups (2, 3, 4, 8 bits, raw, zero), and adding them
group by group read and wrote the file's rows in several passes over the block, one per
width. Here the width groups of all the files decoded together decode once each, straight
into one array (``DeltaCodec.decode_group_into``), and each file's rows point into it
(:class:`Changes`), so a file's changes are added in its row order by one kernel call
(``row_kernels.add_indexed``); a width-0 row (no change) gets its zero change added (a -0.0
becomes +0.0, as the dense addition makes it) without a buffer. Each cell gets the same float
additions in the same order (the chain's) as the dense decode added file by file.

Measured on the 2-core machine of ``benchmarks/results/``, the 31,791 changes that the 15
diffs of ``benchmarks/family.py``'s dim128 chain give one rank's largest table (128 columns),
decoded and added: 6.8 ms width group by width group, 4.6 ms file by file in one pass each.
Putting them in block-row order first, so that a row several diffs change (16,328 rows) is
read and written once, took 5.5 ms: the sort cost more than it saved (also at 16 to 64
columns and in 600k-row blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from embckpt.codecs.base import EncodedRows
from embckpt.codecs.delta import DeltaCodec


def adds_changes(weight: torch.Tensor) -> bool:
    """Whether a delta diff's changes to ``weight`` are added by :func:`add_changes`: a
    float32 block on the CPU, which ``row_kernels`` adds into."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32


@dataclass
class Changes:
    """One file's decoded changes: for each of its rows, its change's row in ``values`` (-1:
    a zero change); ``values`` (float32 [k, cols]) is shared by the files decoded together."""

    index: np.ndarray
    values: np.ndarray


@dataclass(frozen=True)
class ChangeCells:
    """The changes one file adds to one column segment of a block: of the file's rows
    ``span``, those ``mask`` keeps (over ``span``; None: all), at their block-local rows
    ``local`` (over ``span``), of the file's columns from ``col_lo`` on."""

    changes: Changes
    span: slice
    mask: np.ndarray | None
    local: np.ndarray
    col_lo: int


def decode_changes(codec: DeltaCodec, items: Sequence[EncodedRows], cols: int) -> list[Changes]:
    """The changes of each of ``items``, one decode per width group over all of them."""
    sizes, groups = codec.width_groups(items)
    index = np.full(sum(sizes), -1, dtype=np.int64)
    values = np.empty((sum(len(g.rows) for g in groups), cols), dtype=np.float32)
    at = 0
    for group in groups:
        n = len(group.rows)
        codec.decode_group_into(group, cols, values[at : at + n])
        index[group.rows] = np.arange(at, at + n)
        at += n
    starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).tolist()
    return [Changes(index[a:b], values) for a, b in zip(starts[:-1], starts[1:], strict=True)]


def add_changes(cell: ChangeCells, out: np.ndarray) -> None:
    """Adds into ``out`` (a float32 block's column segment) the changes ``cell`` gives it, in
    one kernel call over the file's rows (a chain's files: one call each, in chain order)."""
    # Imported here: its compiled signatures load with the module (numba's start-up, a third
    # of a second in a process that has decoded nothing yet).
    from embckpt.codecs import row_kernels

    index = cell.changes.index[cell.span]
    local = np.asarray(cell.local, dtype=np.int64)
    if cell.mask is not None:
        index, local = index[cell.mask], local[cell.mask]
    row_kernels.add_indexed(out, local, index, cell.changes.values, cell.col_lo)
