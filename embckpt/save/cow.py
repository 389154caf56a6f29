"""Copy-on-write snapshots: a checkpoint's rows copied out while training goes on.

``save()`` returns once it has *claimed* nothing yet: every row of the checkpoint starts
unclaimed in a per-module bitmap. From then on two parties claim rows, each claim recorded in
the bitmap, in one order (a lock, and on CUDA the training stream, on which every claim is
enqueued):

- the **copier** (the persist thread) claims the next chunk of rows (up to one slab), then
  copies the chunk's unclaimed rows into a host slab, on a side stream (CUDA) or on its own
  thread (CPU), and hands them to the writer;
- a **training step**, just before the fused backward updates the rows it looked up (a
  gradient hook on the kernel's output, :class:`ProtectHooks`), claims those rows that are
  still unclaimed and copies them first: copy-on-write. The tracker already computed their
  positions for the lookup.

A row is copied exactly once, by whoever claims it first, and always before its first update
since the snapshot: the copier's chunk excludes rows a step claimed before it, and a step
waits (on CUDA, the training stream waits, the CPU does not) for chunks claimed before it to
finish copying, since its update may touch them. So the step waits at most for the copy of
the rows it must protect and for a chunk in flight. Data-parallel blocks, which the dense
optimizer updates without a lookup, are copied while ``save()`` runs.

Memory: host slabs under the staging budget (``slabs.py``); on the device, the claim bitmaps
(one byte per row of the model's tracked blocks, for the save's duration) and the gathers
of rows being copied: at most two slices of ``DEVICE_SLICE_BYTES`` in flight for the steps'
copies and two slabs' worth for the copier (only where rows are gathered or encoded on the
device; a whole chunk of a full save is copied straight from the table).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from embckpt.blocks import TableShard
from embckpt.save.assemble import ALIGN, aligned, kept_rows, merged_rows, nbytes
from embckpt.save.slabs import SlabPool
from embckpt.save.snapshot import StagedUnit, Unit, shard_tensors

DEVICE_SLICE_BYTES = 32 << 20
"""Most bytes of rows one step gathers on the device before their copy to the host."""

Encoder = Callable[[torch.Tensor], "tuple[torch.Tensor, bool] | None"]
"""Quantizes rows on their device into fused rows (None: the codec's CPU path encodes)."""


@dataclass
class CowBlock:
    """One block of a tracked module: where its bits start and which rows the save writes."""

    shard: TableShard
    first: int  # the block's first bit in its module's bitmap
    rows: torch.Tensor | None  # local rows the save writes, ascending (None: all)


@dataclass
class _Module:
    claimed: torch.Tensor  # bool, one per bit of the tracked module
    blocks: list[CowBlock]
    cuts: torch.Tensor  # first bits of the blocks after the first (to split claimed bits)
    live: bool  # some row may still be claimed by a step (else protect() costs nothing)
    unclaimed_chunks: int = 0  # chunks the copier has yet to claim
    inflight: list[Any] = field(default_factory=list)  # fences of chunks being copied


@dataclass
class Segment:
    """Rows of one block copied into a slab (views), ready once ``fence`` is."""

    block: CowBlock
    local_rows: torch.Tensor  # CPU int64
    tensors: dict[str, torch.Tensor]  # "weight" or "fused", "row:<name>", "elem:<name>"
    fence: Any


class _Fence:
    """Completion of an asynchronous copy: a CUDA event (with a gate: set once the event is
    recorded, since waiting on an unrecorded event does not wait), or a threading event."""

    def __init__(self, cuda: bool) -> None:
        self.event: Any = torch.cuda.Event() if cuda else None
        self.recorded = threading.Event()  # CPU: the copy is done; CUDA: the event recorded

    def record(self, stream: Any) -> None:
        if self.event is not None:
            self.event.record(stream)
        self.recorded.set()

    def done(self) -> bool:
        return self.recorded.is_set() and (self.event is None or bool(self.event.query()))

    def wait_on(self, stream: Any) -> None:
        """Makes ``stream`` (CUDA) or this thread (CPU) wait for the copy."""
        self.recorded.wait()
        if self.event is not None:
            stream.wait_event(self.event)

    def synchronize(self) -> None:
        self.recorded.wait()
        if self.event is not None:
            self.event.synchronize()


class CowSession:
    """One save's copy-on-write window, from the claim bitmaps to the last unit handed over.

    Args:
        modules: per tracked module, its bit count and blocks (``RowTracker.layout``), blocks
            this save does not write left out.
        pool: host slabs.
        device: the model's device.
        max_rows: rows per file at most (``max_file_rows``).
        encoder: device quantization of weights (None: copy fp32 rows).
        eager: keys of blocks copied while ``save()`` runs (:meth:`copy_eager`): those an
            update can change without a lookup (data-parallel tables, moved by the dense
            optimizer).
    """

    def __init__(
        self,
        modules: list[tuple[int, list[CowBlock]]],
        pool: SlabPool,
        device: torch.device,
        max_rows: int,
        encoder: Encoder | None = None,
        eager: frozenset[str] = frozenset(),
    ) -> None:
        self.pool = pool
        self.eager = eager
        self.early: list[tuple[Segment, torch.Tensor, torch.Tensor]] = []
        self.cuda = device.type == "cuda"
        self.max_rows = max_rows
        self.encoder = encoder
        self.train: Any = torch.cuda.current_stream(device) if self.cuda else None
        self.side: Any = torch.cuda.Stream(device) if self.cuda else None
        self._lock = threading.RLock()
        self._open = True
        self.error: Exception | None = None  # a step's copy failed: the save fails
        self._parts: dict[str, int] = {}
        self._slab: torch.Tensor | None = None  # the slab steps copy into
        self._slab_used = 0
        self._slab_segments: list[Segment] = []
        self._sealed: list[tuple[list[Segment], torch.Tensor]] = []
        self._slices: collections.deque[_Fence] = collections.deque()
        self.protected_rows = 0
        self.modules: list[_Module] = []
        for bits, blocks in modules:
            for block in blocks:
                if pool.slab_bytes - 8 * ALIGN < _row_bytes(block.shard):
                    raise ValueError(
                        f"staging budget of {pool.budget_bytes} bytes cannot hold one row of "
                        f"{block.shard.table} in a slab of {pool.slab_bytes} bytes"
                    )
            claimed = torch.ones(bits, dtype=torch.bool, device=device)
            for block in blocks:
                span = claimed[block.first : block.first + block.shard.num_rows]
                if block.rows is None:
                    span.fill_(False)
                else:
                    span[block.rows] = False
            ordered = sorted(blocks, key=lambda b: b.first)
            cuts = torch.tensor([b.first for b in ordered[1:]], dtype=torch.long, device=device)
            module = _Module(claimed, ordered, cuts, live=False)
            self.modules.append(module)
            chunks = sum(1 for b in ordered if b.shard.key not in eager for _ in self._spans(b))
            module.unclaimed_chunks = chunks
            module.live = chunks > 0

    # -- the training side: copy-on-write ----------------------------------------------------
    @torch.no_grad()
    def protect(self, module: int, positions: torch.Tensor) -> None:
        """Copies the rows at ``positions`` (bits of ``module``, repeats allowed) that nobody
        claimed yet, before the caller's update; the caller's stream (CUDA) first waits for
        the chunks claimed before it. Never raises into the training step: a failure ends the
        window and fails the save (``error``, raised by the copier on every rank's persist)."""
        try:
            self._protect(module, positions)
        except Exception as exc:
            with self._lock:
                self.error = self.error or exc
                self._open = False

    def _protect(self, module: int, positions: torch.Tensor) -> None:
        with self._lock:
            mod = self.modules[module]
            if not self._open:  # closed once every copy ended
                return
            stream: Any = torch.cuda.current_stream(positions.device) if self.cuda else None
            mod.inflight = [f for f in mod.inflight if not f.done()]
            for fence in mod.inflight:
                fence.wait_on(stream)
            if not mod.live:  # the copier claimed every row: nothing is left to copy first
                return
            if self.cuda and stream != self.train:
                stream.wait_stream(self.train)  # claims are ordered on the training stream
            fresh = positions[~mod.claimed[positions]]
            if not fresh.numel():
                return
            fresh = torch.unique(fresh)
            mod.claimed[fresh] = True
            if self.cuda and stream != self.train:
                self.train.wait_stream(stream)
            bounds = [0, *torch.searchsorted(fresh, mod.cuts).tolist(), int(fresh.numel())]
            for block, lo, hi in zip(mod.blocks, bounds[:-1], bounds[1:], strict=True):
                if hi > lo:
                    self._protect_rows(block, fresh[lo:hi] - block.first, stream)

    def _protect_rows(self, block: CowBlock, local: torch.Tensor, stream: Any | None) -> None:
        per_row = _row_bytes(block.shard)
        step = max(min(DEVICE_SLICE_BYTES, self.pool.slab_bytes - 8 * ALIGN) // per_row, 1)
        for start in range(0, int(local.numel()), step):
            rows = local[start : start + step]
            if self.cuda and len(self._slices) >= 2:
                self._slices.popleft().wait_on(stream)  # bounds the gathers in flight
            gathered = self._gather(block.shard, rows, None)
            slab, at = self._room(nbytes(gathered))
            segment = self._copy(block, rows.cpu(), gathered, slab, at, stream)
            segment.fence.record(self.side)
            self._slab_segments.append(segment)
            if self.cuda:
                self._slices.append(segment.fence)
            self.protected_rows += int(rows.numel())

    def _room(self, nbytes: int) -> tuple[torch.Tensor, int]:
        """Where the next protected rows go: the current slab, or a new one (the old sealed)."""
        if self._slab is None or self._slab_used + nbytes > self._slab.numel():
            self._seal()
            self._slab = self.pool.take_now()
            self._slab_used = 0
        at = self._slab_used
        self._slab_used += nbytes
        return self._slab, at

    def _seal(self) -> None:
        if self._slab is not None:
            self._sealed.append((self._slab_segments, self._slab))
        self._slab, self._slab_segments, self._slab_used = None, [], 0

    # -- copies --------------------------------------------------------------------------------
    def _gather(
        self, shard: TableShard, rows: torch.Tensor | None, span: tuple[int, int] | None
    ) -> dict[str, torch.Tensor]:
        """The block's rows (by index, or a range read in place), weights possibly quantized."""
        out: dict[str, torch.Tensor] = {}
        for name, live in shard_tensors(shard):
            if span is not None:
                part = live[span[0] : span[1]]
            else:
                assert rows is not None
                part = live.index_select(0, rows)
            if name == "weight" and self.encoder is not None:
                fused = self.encoder(part)
                if fused is not None:
                    out["fused"] = fused[0]
                    continue
            out[name] = part
        return out

    def _copy(
        self,
        block: CowBlock,
        rows: torch.Tensor,
        gathered: dict[str, torch.Tensor],
        slab: torch.Tensor,
        at: int,
        stream: Any | None,
        fence: _Fence | None = None,
    ) -> Segment:
        """Copies ``gathered`` into the slab from byte ``at``, asynchronously on CUDA (after
        ``stream``'s work); ``rows`` are the local rows, on the CPU."""
        fence = fence or _Fence(self.cuda)
        views = {}
        for name, tensor in gathered.items():
            size = aligned(tensor.numel() * tensor.element_size())
            views[name] = (
                slab[at : at + tensor.numel() * tensor.element_size()]
                .view(tensor.dtype)
                .view(tensor.shape)
            )
            at += size
        if self.cuda:
            side: Any = self.side
            if stream is not side:
                side.wait_stream(stream)
            with torch.cuda.stream(side):
                for name, tensor in gathered.items():
                    views[name].copy_(tensor, non_blocking=True)
                    tensor.record_stream(side)
        else:
            for name, tensor in gathered.items():
                views[name].copy_(tensor)
        return Segment(block, rows, views, fence)

    # -- the copier ----------------------------------------------------------------------------
    def _spans(self, block: CowBlock) -> Iterator[tuple[int, int]]:
        """[lo, hi) of the block's selected rows (or of its rows), one slab's worth each."""
        total = block.shard.num_rows if block.rows is None else int(block.rows.numel())
        per_row = _row_bytes(block.shard)
        step = max(min(self.max_rows, (self.pool.slab_bytes - 8 * ALIGN) // per_row), 1)
        for lo in range(0, total, step):
            yield lo, min(lo + step, total)

    def chunks(self) -> Iterator[tuple[int, CowBlock, tuple[int, int]]]:
        """(module, block, span) of every chunk the copier takes, in order."""
        for index, mod in enumerate(self.modules):
            for block in mod.blocks:
                if block.shard.key not in self.eager:
                    for span in self._spans(block):
                        yield index, block, span

    @torch.no_grad()
    def copy_chunk(
        self, module: int, block: CowBlock, span: tuple[int, int], eager: bool = False
    ) -> tuple[Segment, torch.Tensor, torch.Tensor]:
        """Claims a chunk and starts copying it; returns its segment, slab (a scratch buffer
        when ``eager``) and the mask of the rows it claimed (the others a step claimed first:
        dropped from the chunk)."""
        if eager:
            slab = self.pool.scratch((span[1] - span[0]) * _row_bytes(block.shard) + 8 * ALIGN)
        else:
            slab = self.pool.take()
        mod = self.modules[module]
        rows = None if block.rows is None else block.rows[span[0] : span[1]]
        local = torch.arange(*span) if rows is None else rows.cpu()
        fence = _Fence(self.cuda)
        with self._lock, torch.cuda.stream(self.train) if self.cuda else contextlib.nullcontext():
            # Claims, in the one order every claim follows (the lock, the training stream).
            if rows is None:
                bits = mod.claimed[block.first + span[0] : block.first + span[1]]
                mask = ~bits
                bits.fill_(True)
            else:
                mask = ~mod.claimed[rows + block.first]
                mod.claimed[rows + block.first] = True
            claimed = torch.cuda.Event() if self.cuda else None
            if claimed is not None:
                claimed.record(self.train)
            mod.inflight.append(fence)  # steps wait for it before their next update
            if not eager:
                mod.unclaimed_chunks -= 1
                # Every row claimed: the module's steps need not look (nor synchronise) again.
                mod.live = mod.unclaimed_chunks > 0
        # The copy, outside the lock: a step meeting the fence first waits until it is set.
        span_or_none = span if rows is None else None
        if not self.cuda:
            segment = self._copy(
                block, local, self._gather(block.shard, rows, span_or_none), slab, 0, None, fence
            )
            fence.record(None)
            return segment, slab, mask
        self.side.wait_event(claimed)
        with torch.cuda.stream(self.side):
            gathered = self._gather(block.shard, rows, span_or_none)
            segment = self._copy(block, local, gathered, slab, 0, self.side, fence)
            host_mask = torch.empty(mask.shape, dtype=torch.bool, pin_memory=True)
            host_mask.copy_(mask, non_blocking=True)
            mask.record_stream(self.side)
            fence.record(self.side)
        return segment, slab, host_mask

    def copy_eager(self) -> None:
        """Copies the eager blocks now (``save()``); on CUDA the training stream waits for
        the copies, the CPU does not."""
        for index, mod in enumerate(self.modules):
            for block in mod.blocks:
                if block.shard.key in self.eager:
                    for span in self._spans(block):
                        entry = self.copy_chunk(index, block, span, eager=True)
                        entry[0].fence.wait_on(self.train)
                        self.early.append(entry)

    def close_window(self) -> None:
        """No more claims: the copier has claimed every row; protected slabs are sealed."""
        with self._lock:
            self._open = False
            self._seal()

    def take_sealed(self) -> list[tuple[list[Segment], torch.Tensor]]:
        with self._lock:
            sealed, self._sealed = self._sealed, []
        return sealed

    # -- units -----------------------------------------------------------------------------
    def part(self, block: CowBlock) -> int:
        with self._lock:
            number = self._parts.get(block.shard.key, 0)
            self._parts[block.shard.key] = number + 1
        return number

    def chunk_unit(self, segment: Segment, mask: torch.Tensor) -> tuple[StagedUnit | None, int]:
        """The chunk's rows nobody claimed before it (a copy out of the slab when some were);
        returns the unit and the bytes it holds outside the slab."""
        segment.fence.synchronize()
        kept = kept_rows(segment.local_rows, segment.tensors, mask)
        if kept is None:
            return None, 0
        rows, tensors, held = kept
        return self._unit(segment.block, rows, tensors, not held), held

    def protected_units(self, segments: list[Segment]) -> list[StagedUnit]:
        """Units of a sealed slab: per block, its segments merged in row order (copies out of
        the slab)."""
        units = []
        for parts in by_block(segments).values():
            rows, tensors = merged_rows([(s.local_rows, s.tensors) for s in parts])
            units.append(self._unit(parts[0].block, rows, tensors, False))
        return units

    def _unit(
        self, block: CowBlock, rows: torch.Tensor, tensors: dict[str, torch.Tensor], whole: bool
    ) -> StagedUnit:
        return StagedUnit.of(Unit(block.shard, self.part(block), rows, whole), rows, tensors)


def by_block(segments: list[Segment]) -> dict[tuple[str, tuple[str, ...]], list[Segment]]:
    """Segments grouped by block and tensor names, each group's copies finished."""
    groups: dict[tuple[str, tuple[str, ...]], list[Segment]] = {}
    for segment in segments:
        segment.fence.synchronize()
        key = (segment.block.shard.key, tuple(sorted(segment.tensors)))
        groups.setdefault(key, []).append(segment)
    return groups


def _row_bytes(shard: TableShard) -> int:
    """A row's bytes in a slab, at most (fp32 weights even when encoded: the encoder may fall
    back to them)."""
    return sum(t[0].numel() * t.element_size() for _, t in shard_tensors(shard)) + 1
