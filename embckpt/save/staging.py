"""Staging buffers for snapshots: one reusable arena, bounded by a byte budget.

A snapshot copies rows into views carved from one flat buffer, so repeated checkpoints reuse the
same memory instead of allocating per checkpoint, and staging can never exceed the budget: a
checkpoint larger than the budget is staged and persisted in pieces. Where the model lives on a
GPU, the arena is GPU memory when there is room for it (copies stay on the device), else pinned
host memory that a side stream copies into without blocking the training stream.

The budget also covers what encoding a piece allocates besides the arena (codec output, row
ids: the columns of the files being written): :func:`split_budget` keeps a share of it for
them and caps each file's rows so that the files written at once fit that share, and the arena
counts what the writer holds (:meth:`StagingArena.hold`) so that ``peak_bytes`` is the save's
high-water mark of staged plus encoded bytes.
"""

from __future__ import annotations

import math
import threading

import torch

_ALIGN = 64  # bytes: every view starts on a cache line
ENCODED_SHARE = 8
"""One part in this many of the staging budget is kept for encoded buffers (see module doc)."""


def split_budget(budget_bytes: int, threads: int) -> tuple[int, int]:
    """The staging budget's two shares: the most the arena may hold, and the most bytes a unit
    (one file's rows) may stage, so that ``threads`` units encoded at once fit the rest. A
    unit's encoded columns are taken to be at most its staged bytes (and its row ids, counted
    by the caller): a lossless codec's payload is a view of the arena, a lossy one's smaller."""
    reserve = budget_bytes // ENCODED_SHARE
    return budget_bytes - reserve, max(reserve // max(threads, 1), 1)


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
        self._lock = threading.Lock()
        self.held_bytes = 0  # encoded buffers of files being written (hold/release)
        self.peak_bytes = 0  # the most capacity + held_bytes reached since reset_peak()

    def hold(self, nbytes: int) -> None:
        """Counts ``nbytes`` of encoded buffers as held until :meth:`release`."""
        with self._lock:
            self.held_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.capacity + self.held_bytes)

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.held_bytes -= nbytes

    def reset_peak(self) -> None:
        """Starts a new high-water mark, at a save's start (when no file is being written)."""
        with self._lock:
            self.held_bytes = 0
            self.peak_bytes = self.capacity

    def owns(self, address: int) -> bool:
        """Whether ``address`` lies in the arena's buffer (a view the codec did not copy)."""
        if self._buffer is None or self._buffer.device.type != "cpu":
            return False
        start = self._buffer.data_ptr()
        return start <= address < start + self.capacity

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
        self.hold(0)  # the high-water mark follows the new capacity

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
