"""Restore: a ``delta`` diff's changes added into a CPU block, file by file, each file's rows
in one kernel call.

Why: the changes of a file come in width groups (2, 3, 4, 8 bits, raw, zero), and adding them
group by group read and wrote the file's rows in several passes over the block, one per
width. Where the inner codec is a uniform one (the defaults), each file's changes stay
coded (:class:`CodedEntries`) and ``delta_kernels.add_coded`` decodes each row's entry as it
adds it; otherwise (k-means) the width groups of all the files decoded together decode once
each, straight into one array (``DeltaCodec.decode_group_into``), and each file's rows point
into it. Either way a file's changes are added by one kernel call; a width-0 row (no change)
gets its zero change added (a -0.0 becomes +0.0, as the dense addition makes it) without a
buffer. Each cell gets the same float additions in the same order (the chain's) as the dense
decode added file by file.

Measured on the 2-core machine of ``benchmarks/results/``, the 31,791 changes that the 15
diffs of ``benchmarks/family.py``'s dim128 chain give one rank's largest table (128 columns),
decoded and added: 6.8 ms width group by width group, 4.6 ms file by file in one pass each
(decoded first). Putting them in block-row order first, so that a row several diffs change
(16,328 rows) is read and written once, took 5.5 ms: the sort cost more than it saved (also
at 16 to 64 columns and in 600k-row blocks). Left coded: ``delta_kernels.py`` gives the
figures.
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
    """One file's changes, one per row: decoded (``values``, float32 [k, cols], shared by the
    files decoded together: ``index`` gives each row's change's row in it), or still coded
    (``coded``: ``index`` gives each row's entry kind); -1 in ``index``: a zero change."""

    index: np.ndarray
    values: np.ndarray | None = None
    coded: CodedEntries | None = None


@dataclass(frozen=True)
class CodedEntries:
    """A file's changes as coded: where each row's entry starts in ``data``, the entry kinds
    (``DeltaCodec.kernel_parts``), and the columns each entry decodes to."""

    starts: np.ndarray
    data: np.ndarray
    parts: np.ndarray
    cols: int


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
    """The changes of each of ``items``: left coded where every width of theirs is one the
    fused kernel decodes (``delta_kernels.add_coded``, which decodes each as it adds it),
    else decoded with one decode per width group over all of them."""
    entries, parts = codec.row_entries(items)
    table = codec.kernel_parts(parts, cols)
    if table is not None:
        return [
            Changes(e.keys, coded=CodedEntries(e.offsets[:-1], e.data, table, cols))
            for e in entries
        ]
    sizes, groups = codec.groups_of(entries, parts)
    index = np.full(sum(sizes), -1, dtype=np.int64)
    values = np.empty((sum(len(g.rows) for g in groups), cols), dtype=np.float32)
    at = 0
    for group in groups:
        n = len(group.rows)
        codec.decode_group_into(group, cols, values[at : at + n])
        index[group.rows] = np.arange(at, at + n)
        at += n
    starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).tolist()
    return [
        Changes(index[a:b], values=values) for a, b in zip(starts[:-1], starts[1:], strict=True)
    ]


def add_changes(cell: ChangeCells, out: np.ndarray) -> None:
    """Adds into ``out`` (a float32 block's column segment) the changes ``cell`` gives it, in
    one kernel call over the file's rows (a chain's files: one call each, in chain order)."""
    # Imported here: their compiled signatures load with the modules (numba's start-up, a
    # third of a second in a process that has decoded nothing yet).
    from embckpt.codecs import delta_kernels, row_kernels

    changes = cell.changes
    index = changes.index[cell.span]
    local = np.asarray(cell.local, dtype=np.int64)
    coded = changes.coded
    starts = None if coded is None else coded.starts[cell.span]
    if cell.mask is not None:
        index, local = index[cell.mask], local[cell.mask]
        starts = None if starts is None else starts[cell.mask]
    if coded is None:
        assert changes.values is not None  # decoded, or coded: one of them
        row_kernels.add_indexed(out, local, index, changes.values, cell.col_lo)
        return
    assert starts is not None  # coded
    delta_kernels.add_coded(
        out, local, index, starts, coded.data, coded.parts, coded.cols, cell.col_lo
    )
