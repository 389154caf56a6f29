"""The reconstructed state that delta codecs encode against (LC-Checkpoint's error feedback).

A delta codec writes ``rows - reference``, where ``reference`` is what a restore of the chain
reproduces for those rows so far; the quantization error of one checkpoint then feeds into the
next delta instead of piling up. The writer keeps that reference for the blocks it writes: one
fp32 copy of this rank's blocks in host memory (the price of delta coding: as much host memory as
the rank's share of the tables, never more; nothing is read back from storage). A full
checkpoint resets it to what its (non-delta) base codec decodes to; one-shot diffs are deltas
against that base and leave it alone; incremental diffs add their decoded deltas to it.
"""

from __future__ import annotations

import torch


class ReconstructedRows:
    """Per-block fp32 reconstruction of the latest checkpoint chain, on the host."""

    def __init__(self) -> None:
        self._rows: dict[str, torch.Tensor] = {}

    @property
    def ready(self) -> bool:
        """True once a full checkpoint set the base (false at start and after a restore)."""
        return bool(self._rows)

    def clear(self) -> None:
        self._rows.clear()

    def ensure(self, key: str, shape: tuple[int, int]) -> None:
        """Allocates block ``key`` (before parallel writers touch disjoint rows of it)."""
        if key not in self._rows or tuple(self._rows[key].shape) != shape:
            self._rows[key] = torch.zeros(shape, dtype=torch.float32)

    def set(self, key: str, local_rows: torch.Tensor, decoded: torch.Tensor) -> None:
        """Rows ``local_rows`` of block ``key`` are now ``decoded`` (a full checkpoint's)."""
        self._rows[key][local_rows] = decoded.float()

    def delta(self, key: str, local_rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """What a delta codec encodes: the rows minus their reconstruction."""
        return values.float().cpu() - self._rows[key][local_rows]

    def add(self, key: str, local_rows: torch.Tensor, decoded: torch.Tensor) -> None:
        """An incremental diff's decoded delta joins the reconstruction."""
        self._rows[key].index_add_(0, local_rows, decoded.float())
