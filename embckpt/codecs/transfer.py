"""Host-to-GPU copies of a restore's bytes, through page-locked memory.

Why: a copy from pageable memory makes the host wait for all the work queued on the stream
before it (decode kernels, other blocks' writes), at every batch, and is staged by the driver
through a bounce buffer; from page-locked memory it is one DMA, queued on the current stream.
Shared by the device decode (``device_decode.py``: codes) and the restore's writes
(``read/cells.py``: rows, states, indices).
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values: torch.Tensor | np.ndarray, device: torch.device) -> torch.Tensor:
    """``values`` on ``device``; for a GPU copied from page-locked memory, queued on the
    current stream (module doc)."""
    if device.type != "cuda":
        return values.to(device) if isinstance(values, torch.Tensor) else torch.from_numpy(values)
    if isinstance(values, np.ndarray):
        values = host_copy(values, device)
    elif values.device.type == "cpu" and not values.is_pinned():
        values = values.pin_memory()
    return values.to(device, non_blocking=True)


def host_copy(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A tensor copy of (possibly read-only) ``values``: page-locked for a GPU, so that the
    copy to the device is one DMA; one pass over the bytes either way."""
    if device.type != "cuda":
        return torch.from_numpy(np.array(values))
    dtype = torch.from_numpy(values[:0].copy()).dtype
    host = torch.empty(values.shape, dtype=dtype, pin_memory=True)
    host.numpy()[...] = values
    return host
