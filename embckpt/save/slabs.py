"""Host staging for copy-on-write snapshots: fixed-size slabs under the staging budget.

A copy-on-write save copies rows out in many small pieces while training goes on (chunks the
background copier takes, rows a step is about to update), and each piece lives only until its
file is written. Slabs of one size, reused across saves, serve them all: nothing is allocated
per piece, a slab returned by the writer is the next piece's, and the budget is a count of slabs.
On a CUDA model the slabs are pinned, so device-to-host copies run asynchronously on a side
stream; pinned slabs also keep PyTorch's caching host allocator (which rounds sizes up to a
power of two) out of the picture.

The budget is shared as in ``staging.split_budget``: the slabs may fill all but the encoded
share, which covers the encoded columns of the files being written (``hold``/``release``, as
the writer counts them), and copies of rows a step must protect may take slabs from that share
rather than make the step wait (the copier never does). ``peak_bytes`` is the save's
high-water mark of slabs in use plus encoded bytes held.

With a writer process (``save/writer_process.py``) the slabs are cut from memory it shares
(``save/shared_memory.py``), so that it reads the rows where they were copied.
"""

from __future__ import annotations

import threading

import torch

from embckpt.save.shared_memory import SharedMemory
from embckpt.save.staging import ENCODED_SHARE

SLAB_BYTES = 32 << 20
"""Largest slab: a chunk of rows copied and written as one file (smaller under a small budget)."""
_MIN_SLABS = 8  # a budget is cut into at least this many slabs, so copies and writes overlap


class SlabPool:
    """Reusable host slabs, at most ``budget_bytes`` of slabs and encoded buffers together.

    Args:
        budget_bytes: the staging budget (``staging_budget_bytes``).
        pinned: allocate pinned memory (CUDA models).
        shared: cut the slabs from memory shared with the writer process (``memory``).
    """

    def __init__(self, budget_bytes: int, pinned: bool, shared: bool = False) -> None:
        self.budget_bytes = budget_bytes
        self.slab_bytes = max(min(SLAB_BYTES, budget_bytes // _MIN_SLABS), 1)
        self.pinned = pinned
        # The copier's slabs leave the encoded share free; protected copies may use it.
        share = budget_bytes - budget_bytes // ENCODED_SHARE
        self.copier_slabs = max(share // self.slab_bytes, 1)
        self._all_slabs = max(budget_bytes // self.slab_bytes, self.copier_slabs)
        self.memory = SharedMemory(self._all_slabs * self.slab_bytes, pinned) if shared else None
        self._free: list[torch.Tensor] = []
        self._made: list[torch.Tensor] = []
        self._in_use = 0
        self._cond = threading.Condition()
        self._closed = False
        self.held_bytes = 0
        self.peak_bytes = 0
        self.overflows = 0  # protected copies that found the budget used up (this save)

    # -- slabs --------------------------------------------------------------------------------
    def take(self) -> torch.Tensor:
        """A free slab (uint8, ``slab_bytes``) for the copier; waits while its share of the
        budget is in use."""
        with self._cond:
            while self._in_use >= self.copier_slabs and not self._closed:
                self._cond.wait()
            if self._closed:
                raise RuntimeError("the staging slabs were released while a copy waited")
            return self._take_locked()

    def take_now(self) -> torch.Tensor:
        """A slab for rows a training step protects, which never waits: from the whole budget
        (the encoded share too) while it lasts, else a scratch slab beyond it (``overflows``
        counts them: a save whose writes lag far behind the rows training touches)."""
        with self._cond:
            if self._in_use < self._all_slabs:
                return self._take_locked()
            self.overflows += 1
        return self.scratch(self.slab_bytes)

    def _take_locked(self) -> torch.Tensor:
        """A slab, with ``_cond`` held (allocated while none is free: at most the budget's)."""
        self._in_use += 1
        self._peak()
        if self._free:
            return self._free.pop()
        if self.memory is not None:
            slab = self.memory.slab(len(self._made) * self.slab_bytes, self.slab_bytes)
        else:
            slab = torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=self.pinned)
        self._made.append(slab)
        return slab

    def scratch(self, nbytes: int) -> torch.Tensor:
        """A buffer outside the slabs, counted as held until given back: for copies that must
        finish before ``save()`` returns whatever the slabs hold (data-parallel blocks)."""
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        self.hold(nbytes)
        return buffer

    def give(self, slab: torch.Tensor) -> None:
        """Returns a slab whose rows are written (or dropped), or a scratch buffer."""
        with self._cond:
            if not any(slab is made for made in self._made):
                self.held_bytes -= slab.numel()
                return
            self._in_use -= 1
            self._free.append(slab)
            self._cond.notify_all()

    def owns(self, address: int) -> bool:
        """Whether ``address`` lies in one of the slabs (a view the codec did not copy)."""
        with self._cond:
            made = list(self._made)
        return any(s.data_ptr() <= address < s.data_ptr() + s.numel() for s in made)

    # -- the writer's encoded buffers (the StagingArena interface) ----------------------------
    def hold(self, nbytes: int) -> None:
        with self._cond:
            self.held_bytes += nbytes
            self._peak()

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.held_bytes -= nbytes

    def reset_peak(self) -> None:
        with self._cond:
            self.held_bytes = 0
            self.peak_bytes = self._in_use * self.slab_bytes
            self.overflows = 0

    def _peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self._in_use * self.slab_bytes + self.held_bytes)

    @property
    def capacity(self) -> int:
        """Bytes of slabs allocated so far (kept for the next save)."""
        with self._cond:
            return len(self._made) * self.slab_bytes

    def close(self) -> None:
        """Wakes any waiter with an error and frees the slabs."""
        with self._cond:
            self._closed = True
            self._free.clear()
            self._made.clear()
            self._cond.notify_all()
        if self.memory is not None:
            self.memory.close()
