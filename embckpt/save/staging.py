"""Staging buffers for snapshots: one reusable arena, bounded by a byte budget.

A snapshot copies rows into views carved from one flat buffer, so repeated checkpoints reuse the
same memory instead of allocating per checkpoint, and staging can never exceed the budget: a
checkpoint larger than the budget is staged and persisted in pieces. Where the model lives on a
GPU, the arena is GPU memory when there is room for it (copies stay on the device), else pinned
host memory that a side stream copies into without blocking the training stream.
"""

from __future__ import annotations

import math

import torch

_ALIGN = 64  # bytes: every view starts on a cache line


class StagingArena:
    """A bump allocator over a reused flat buffer.

    Call order: ``reserve(nbytes)`` for a piece (grows the buffer at most to the budget), then
    ``take`` views for each tensor of the piece, ``reset()`` when the piece has been persisted.

    Args:
        budget_bytes: the most the arena may ever hold.
        device: the model's device; decides where the arena lives.
    """

    def __init__(self, budget_bytes: int, device: torch.device) -> None:
        self.budget_bytes = budget_bytes
        self.model_device = device
        self._buffer: torch.Tensor | None = None
        self._used = 0

    @staticmethod
    def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Bytes a view of ``shape`` takes in the arena, alignment included."""
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return -(-size // _ALIGN) * _ALIGN

    @property
    def capacity(self) -> int:
        return 0 if self._buffer is None else int(self._buffer.numel())

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self._buffer is None else self._buffer.device

    def reserve(self, nbytes: int) -> None:
        """Makes room for a piece of ``nbytes`` (at most the budget), reusing the buffer."""
        if nbytes > self.budget_bytes:
            raise ValueError(f"piece of {nbytes} bytes exceeds the staging budget")
        self._used = 0
        if nbytes <= self.capacity:
            return
        self._buffer = None  # free the old buffer before allocating the larger one
        self._buffer = self._allocate(nbytes)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self.model_device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.model_device)
            if free > 2 * nbytes:
                return torch.empty(nbytes, dtype=torch.uint8, device=self.model_device)
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return torch.empty(nbytes, dtype=torch.uint8)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A view of ``shape`` and ``dtype`` from the reserved piece."""
        size = self.nbytes(shape, dtype)
        if self._buffer is None or self._used + size > self.capacity:
            raise ValueError("staging arena overrun: reserve() a larger piece first")
        raw = self._buffer[self._used : self._used + size]
        self._used += size
        count = math.prod(shape)
        return raw.view(dtype)[:count].view(shape)
