"""Touched-row tracking: one bitmap per local table block, set from the ids each block looks up.

A forward pre-hook on every FBGEMM table-batched embedding module sees the ids after TorchRec's
input distribution, already local to the block (row-wise shards receive shard-local ids), so one
vectorised scatter per module per step marks the rows it reads. A row that is looked up is the
only kind of row whose weights and optimizer state the fused backward can change.

Views: the hook writes one *pending* bitmap per module. Each named view (``since_last``: since
the previous checkpoint; ``since_full``: since the last full one) is an accumulator that pending
bits are folded into when a checkpoint reads it, so the step cost does not grow with the number
of views. Replicated (data-parallel) tables change on every rank when any rank looks a row up, so
their bits are OR-ed across ranks when folded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from embckpt.blocks import TableShard
from embckpt.sharding import collection_kernels, table_id


class View(str, Enum):
    """What a tracker view counts: rows touched since the previous checkpoint (what an
    incremental diff writes) or since the last full one (what a one-shot diff writes)."""

    SINCE_LAST = "since_last"
    SINCE_FULL = "since_full"


@dataclass
class _TrackedModule:
    """One table-batched module: its pending bitmap and where each block lives in it."""

    pending: torch.Tensor  # bool [sum of block rows]
    table_of_feature: torch.Tensor  # int64 [features]
    table_base: torch.Tensor  # int64 [tables]: first bit of each block
    replicated: bool
    emb_module: nn.Module
    last: torch.Tensor | None = None  # bits of the last lookup (for save/protect.py)


class RowTracker:
    """Per-block touched-row bitmaps with independent views.

    Call order: construct (installs hooks) -> training steps (hooks record) -> ``dirty`` /
    ``take`` at a checkpoint -> ``give_back`` if that checkpoint failed -> ``close``.

    Args:
        model: the ``DistributedModelParallel`` model whose lookups are hooked.
        shards: this rank's blocks, from :func:`embckpt.sharding.discover`.
        group: process group for OR-ing replicated tables' bits (None: single process).
    """

    def __init__(
        self,
        model: nn.Module,
        shards: Iterable[TableShard],
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self._group = group
        by_block = {(s.table, s.row_offset, s.col_offset): s for s in shards}
        self._modules: list[_TrackedModule] = []
        # block key -> (module index, first bit, rows)
        self._slices: dict[str, tuple[int, int, int]] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        for path, batched in collection_kernels(model):
            self._install(path, batched, by_block)
        missing = {s.key for s in by_block.values()} - set(self._slices)
        if missing:
            raise RuntimeError(f"no embedding lookup found for blocks {sorted(missing)}")
        self._views: dict[View, list[torch.Tensor]] = {
            view: [torch.zeros_like(m.pending) for m in self._modules] for view in View
        }

    def _install(
        self, path: str, batched: Any, by_block: dict[tuple[str, int, int], TableShard]
    ) -> None:
        """Hooks one TorchRec batched embedding kernel (its private ``_config`` and
        ``_feature_table_map`` are the only place the block layout is exposed)."""
        tables = batched._config.embedding_tables
        bases, first = [], 0
        replicated = False
        for table in tables:
            meta = table.local_metadata
            offsets = (0, 0) if meta is None else (meta.shard_offsets[0], meta.shard_offsets[1])
            replicated |= meta is None
            shard = by_block[(table_id(path, table.name), int(offsets[0]), int(offsets[1]))]
            self._slices[shard.key] = (len(self._modules), first, shard.num_rows)
            bases.append(first)
            first += shard.num_rows
        device = next(iter(by_block.values())).weight.device if by_block else None
        tracked = _TrackedModule(
            pending=torch.zeros(first, dtype=torch.bool, device=device),
            table_of_feature=torch.tensor(
                batched._feature_table_map, dtype=torch.long, device=device
            ),
            table_base=torch.tensor(bases, dtype=torch.long, device=device),
            replicated=replicated,
            emb_module=batched.emb_module,
        )
        self._modules.append(tracked)
        self._hooks.append(
            batched.emb_module.register_forward_pre_hook(
                lambda _m, args, kwargs, t=tracked: self._on_lookup(t, args, kwargs),
                with_kwargs=True,
            )
        )

    @staticmethod
    def _on_lookup(tracked: _TrackedModule, args: tuple, kwargs: dict) -> None:
        """Marks the looked-up rows without a host synchronisation (sizes are known on the
        host), and keeps their bits for the save's copy-on-write hooks."""
        indices = kwargs["indices"] if "indices" in kwargs else args[0]
        offsets = kwargs["offsets"] if "offsets" in kwargs else args[1]
        if indices.numel() == 0:
            tracked.last = None
            return
        indices = indices.to(torch.long)
        num_tables = tracked.table_base.numel()
        if num_tables == 1:
            tracked.pending[indices] = True
            tracked.last = indices
            return
        num_features = tracked.table_of_feature.numel()
        num_bags = offsets.numel() - 1
        per_feature = kwargs.get("batch_size_per_feature_per_rank")
        if per_feature is not None:
            # Variable batch sizes: feature f owns sum(per_feature[f]) consecutive bags.
            counts = torch.tensor([sum(b) for b in per_feature], device=indices.device)
            feature_of_bag = torch.repeat_interleave(
                torch.arange(num_features, device=indices.device), counts, output_size=num_bags
            )
        else:
            feature_of_bag = torch.arange(num_bags, device=indices.device) // (
                num_bags // num_features
            )
        base_of_bag = tracked.table_base[tracked.table_of_feature[feature_of_bag]]
        lengths = offsets[1:] - offsets[:-1]
        # output_size: without it repeat_interleave reads the total back from the device.
        bits = torch.repeat_interleave(
            base_of_bag, lengths.to(torch.long), output_size=indices.numel()
        ).add_(indices)
        tracked.pending[bits] = True
        tracked.last = bits

    # -- reading and consuming views ---------------------------------------------------------
    def _fold(self) -> None:
        for index, tracked in enumerate(self._modules):
            if tracked.replicated and self._group is not None:
                # The checkpoint group is gloo: reduce a host copy whatever the model's device.
                as_int = tracked.pending.to("cpu", torch.uint8)
                dist.all_reduce(as_int, op=dist.ReduceOp.MAX, group=self._group)
                tracked.pending.copy_(as_int.bool())
            for view in View:
                self._views[view][index] |= tracked.pending
            tracked.pending.zero_()

    def _bits(self, view: View, key: str) -> torch.Tensor:
        module, first, rows = self._slices[key]
        return self._views[view][module][first : first + rows]

    def dirty(self, key: str, view: View) -> torch.Tensor:
        """Local row indices (ascending, int64) of block ``key`` touched in ``view`` as of the
        last :meth:`fold`."""
        return torch.nonzero(self._bits(view, key)).flatten()

    def fold(self) -> None:
        """Moves the bits recorded since the last call into every view.

        Collective when the model has replicated tables: every rank calls it together."""
        self._fold()

    def count(self, key: str, view: View) -> int:
        """Number of touched rows of block ``key`` in ``view``, as of the last fold."""
        return int(self._bits(view, key).sum())

    def mark(self, key: str, local_rows: torch.Tensor, view: View) -> None:
        """Sets bits in one view only (a restore rebuilding what its chain changed)."""
        self._bits(view, key)[local_rows.to(torch.long)] = True

    def take(self, view: View) -> list[torch.Tensor]:
        """Clears ``view`` and returns its bits as of the last fold, for :meth:`give_back`."""
        taken = [bits.clone() for bits in self._views[view]]
        for bits in self._views[view]:
            bits.zero_()
        return taken

    def give_back(self, view: View, taken: list[torch.Tensor]) -> None:
        """Re-marks bits taken by a checkpoint that did not commit."""
        for bits, old in zip(self._views[view], taken, strict=True):
            bits |= old

    def reset(self) -> None:
        """Clears pending bits and every view (after a restore)."""
        for tracked in self._modules:
            tracked.pending.zero_()
        for view in View:
            for bits in self._views[view]:
                bits.zero_()

    def lookups(self) -> list[tuple[nn.Module, _TrackedModule]]:
        """Each tracked kernel and its tracking state (its index is its module number)."""
        return [(m.emb_module, m) for m in self._modules]

    def layout(self, key: str) -> tuple[int, int]:
        """(module number, first bit) of block ``key`` in its module's bitmaps."""
        module, first, _ = self._slices[key]
        return module, first

    def module_bits(self) -> list[int]:
        """Bits of each tracked module's bitmaps."""
        return [int(m.pending.numel()) for m in self._modules]

    def close(self) -> None:
        """Removes the hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
