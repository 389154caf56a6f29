"""Restore: a ``delta`` diff's changes added into a CPU block width group by width group,
without a dense buffer.

Why: ``DeltaCodec.decode_many`` writes each file's changes into a fresh zeroed array, width-0
rows included, which the chain pass copied again where a keep mask drops rows, then added:
three passes over memory, the first one page faults on fresh pages. Here each width group still
decodes once for all the files (the same decode, the same values), and the rows a block keeps
are added from the group's values where they lie, by one kernel call per width group
(``row_kernels.add_spanned``); width-0 rows get their zero change added (a -0.0 becomes +0.0,
as the dense addition makes it). Each cell gets the same one float addition as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from embckpt.codecs.base import EncodedRows
from embckpt.codecs.delta import DeltaCodec


def adds_by_group(weight: torch.Tensor) -> bool:
    """Whether a delta diff's changes to ``weight`` are added group by group: a float32 block
    on the CPU, which ``row_kernels`` adds into."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32


@dataclass
class Changes:
    """One file's decoded changes: per width group, the positions among the file's rows
    (ascending) and their values (float32 [k, cols]; None: a zero change)."""

    parts: list[tuple[np.ndarray, np.ndarray | None]]


def decode_changes(codec: DeltaCodec, items: Sequence[EncodedRows], cols: int) -> list[Changes]:
    """The changes of each of ``items``, one decode per width group over all of them."""
    sizes, groups = codec.width_groups(items)
    starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    covered = np.zeros(int(starts[-1]), dtype=bool)
    decoded: list[tuple[np.ndarray, np.ndarray | None]] = []
    for group in groups:
        covered[group.rows] = True
        decoded.append((group.rows, codec.decode_group(group, cols)))
    decoded.append((np.flatnonzero(~covered), None))
    out = []
    for first, last in zip(starts[:-1], starts[1:], strict=True):
        parts: list[tuple[np.ndarray, np.ndarray | None]] = []
        for rows, values in decoded:
            a, b = np.searchsorted(rows, [first, last])
            if b > a:
                parts.append((rows[a:b] - first, None if values is None else values[a:b]))
        out.append(Changes(parts))
    return out


def add_changes(
    changes: Changes,
    span: slice,
    mask: np.ndarray | None,
    local: np.ndarray,
    out: np.ndarray,
    in_file: slice,
) -> None:
    """Adds into ``out`` (a float32 block's columns) the changes of the file's rows
    ``span`` that ``mask`` (over ``span``; None: all) keeps, at their block-local rows
    ``local`` (over ``span``), of the file's columns ``in_file``."""
    # Imported here: its compiled signatures load with the module (numba's start-up, a third
    # of a second in a process that has decoded nothing yet).
    from embckpt.codecs import row_kernels

    masked = mask is not None
    keep = mask if mask is not None else _NO_MASK
    rows = np.ascontiguousarray(local, dtype=np.int64)
    for positions, values in changes.parts:
        row_kernels.add_spanned(
            out,
            positions,
            _NO_VALUES if values is None else values,
            in_file.start,
            span.start,
            span.stop,
            masked,
            keep,
            rows,
        )


_NO_MASK = np.zeros(0, dtype=bool)
_NO_VALUES = np.zeros((0, 0), dtype=np.float32)
