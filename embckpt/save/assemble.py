"""A copy-on-write save's units, assembled from the rows copied into slabs.

The same steps whether the rows are written by the training process's threads
(``save/copier.py``) or by the rank's writer process (``save/writer_worker.py``): a chunk keeps
the rows nobody claimed before it, protected rows are merged per block in row order, and small
units are copied out of their slab so that it can be reused while they wait to be packed.
"""

from __future__ import annotations

import dataclasses

import torch

from embckpt.save.snapshot import StagedUnit

ALIGN = 64
"""Bytes every tensor copied into a slab is aligned to (a cache line)."""


def kept_rows(
    local_rows: torch.Tensor, tensors: dict[str, torch.Tensor], mask: torch.Tensor | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor], int] | None:
    """A chunk's rows that ``mask`` keeps (None: all of them): the rows, their tensors (views
    when all are kept, copies otherwise) and the bytes copied; None when none is kept."""
    if mask is None or bool(mask.all()):
        return local_rows, tensors, 0
    keep = torch.nonzero(mask).flatten()
    if not keep.numel():
        return None
    kept = {n: t.index_select(0, keep) for n, t in tensors.items()}
    return local_rows[keep], kept, nbytes(kept)


def merged_rows(
    parts: list[tuple[torch.Tensor, dict[str, torch.Tensor]]],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Segments of one block (local rows, tensors by name) as one, in row order (copies)."""
    rows = torch.cat([r for r, _ in parts])
    order = torch.argsort(rows)
    names = parts[0][1]
    tensors = {n: torch.cat([t[n] for _, t in parts]).index_select(0, order) for n in names}
    return rows[order], tensors


def staged_bytes(unit: StagedUnit) -> int:
    """Bytes of a unit's staged tensors."""
    tensors = [unit.weights, unit.fused, *unit.row_states.values(), *unit.elem_states.values()]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def copied_out(unit: StagedUnit) -> tuple[StagedUnit, int]:
    """The unit with its tensors copied out of its slab, and their bytes."""
    copy = dataclasses.replace(
        unit,
        weights=unit.weights.clone(),
        fused=None if unit.fused is None else unit.fused.clone(),
        row_states={n: t.clone() for n, t in unit.row_states.items()},
        elem_states={n: t.clone() for n, t in unit.elem_states.items()},
    )
    return copy, staged_bytes(copy)


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of ``tensors`` as slabs hold them (each aligned)."""
    return sum(aligned(t.numel() * t.element_size()) for t in tensors.values())


def aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN
