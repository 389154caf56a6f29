"""FBGEMM's row cache of UVM tables (``fused_uvm_caching``), kept consistent with what a
checkpoint reads and writes.

A caching kernel keeps its table in UVM (``weights_uvm``) and the rows it looks up most in an
HBM cache (``lxu_cache_weights``, indexed by ``lxu_cache_state``). The fused backward updates a
cached row in the cache only: the UVM copy of that row is stale until the row is evicted or the
cache is flushed. The table views embckpt reads and writes (``split_embedding_weights``) are
views of ``weights_uvm``. So:

- a save flushes every caching kernel before it copies rows (:func:`flush`), on every rank
  (TorchRec's ``state_dict`` flushes too, but a save takes the dense state on rank 0 alone);
- a restore flushes, then drops every cached row, before it writes rows into UVM
  (:func:`drop_cached_rows`): a cached row would otherwise shadow the restored one at the next
  lookup and be written back over it at the next flush or eviction. Rows the restore does not
  write keep their newest value, flushed to UVM first.

Dropping the cache is FBGEMM's ``reset_cache_states`` (slot -> row map and LRU/LFU state) plus
what a prefetch left for a forward that has not run yet (TorchRec's prefetch pipeline): the
cache slots it located and locked. The next forward then prefetches its own batch again.

A kernel without a cache (HBM, plain UVM, host, the dense kernel) has an empty
``lxu_cache_weights`` and nothing to do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def is_caching(kernel: Any) -> bool:
    """Whether FBGEMM kernel ``kernel`` (a TBE module) holds rows in an HBM cache."""
    cache = getattr(kernel, "lxu_cache_weights", None)
    return isinstance(cache, torch.Tensor) and cache.numel() > 0


@torch.no_grad()
def flush(kernels: Iterable[Any]) -> None:
    """Writes every cached row back to UVM (on the training stream, so copies ordered after it
    read the values as of now). The cache keeps its rows: they equal UVM's until the next
    update."""
    for kernel in kernels:
        kernel.flush()


@torch.no_grad()
def drop_cached_rows(kernels: Iterable[Any]) -> None:
    """Flushes, then empties the cache of each kernel: the next lookup of any row reads it from
    UVM, where a restore is about to write it."""
    for kernel in kernels:
        kernel.flush()
        kernel.reset_cache_states()
        # A prefetch done for a forward that has not run yet (TorchRec's prefetch pipeline)
        # located its rows in slots just emptied: forget it, so the forward prefetches again.
        for name in ("timesteps_prefetched", "lxu_cache_locations_list"):
            pending = getattr(kernel, name, None)
            if isinstance(pending, list):
                pending.clear()
        locks = getattr(kernel, "lxu_cache_locking_counter", None)
        if isinstance(locks, torch.Tensor) and locks.numel():
            locks.zero_()
