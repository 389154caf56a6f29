"""Host memory shared with the rank's writer process: one memfd mapping that slabs are cut from.

Why a memfd: the writer process maps the same pages (its file descriptor is passed when the
process starts), so rows copied off the model are encoded there without a copy through a pipe;
unlike ``/dev/shm`` (64 MB in a container by default) its size is bounded by memory alone, and
nothing named is left behind when a process dies. Pages are allocated as slabs are first used.
On CUDA models each slab is page-locked when first taken (``cudaHostRegister``, as DCP pins its
shared staging memory), so device-to-host copies into it run asynchronously on a side stream.
"""

from __future__ import annotations

import logging
import mmap
import os

import torch

log = logging.getLogger(__name__)


class SharedMemory:
    """``nbytes`` of host memory the writer process maps too.

    Args:
        nbytes: the mapping's size (slabs are cut from it, never beyond).
        pinned: page-lock each slab when first taken (CUDA models).
    """

    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.nbytes = nbytes
        self.pinned = pinned
        self.fd = os.memfd_create("embckpt-staging", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, nbytes)
        self._map = mmap.mmap(self.fd, nbytes)
        self.tensor: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)
        self.base = self.tensor.data_ptr()
        self._registered: list[int] = []

    def slab(self, offset: int, nbytes: int) -> torch.Tensor:
        """The bytes [offset, offset + nbytes), page-locked on CUDA models."""
        assert self.tensor is not None, "the shared memory is closed"
        slab = self.tensor[offset : offset + nbytes]
        if self.pinned:
            check = int(torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), nbytes, 1))
            if check == 0:  # 1: cudaHostRegisterPortable
                self._registered.append(slab.data_ptr())
            else:  # copies into pageable memory are synchronous, not wrong: said, not raised
                self.pinned = False
                log.warning(
                    "could not page-lock the shared staging memory (cudaHostRegister: error "
                    "%d): device-to-host copies into it will not overlap training",
                    check,
                )
        return slab

    def offset_of(self, tensor: torch.Tensor) -> int | None:
        """Where ``tensor``'s bytes start in the mapping (None: outside it)."""
        at = tensor.data_ptr() - self.base
        size = tensor.numel() * tensor.element_size()
        return at if 0 <= at and at + size <= self.nbytes else None

    def close(self) -> None:
        """Unpins and unmaps (once no tensor views the mapping any more)."""
        for address in self._registered:
            torch.cuda.cudart().cudaHostUnregister(address)
        self._registered = []
        self.tensor = None
        try:
            self._map.close()
        except BufferError:  # a view is still alive: the mapping goes with it
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def attach(fd: int, nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """The writer process's view of a :class:`SharedMemory` whose descriptor it was given."""
    mapping = mmap.mmap(fd, nbytes)
    os.close(fd)
    return mapping, torch.frombuffer(mapping, dtype=torch.uint8)
