"""The copier of a copy-on-write snapshot (the persist thread): chunks copied and handed over.

Chunks are claimed and copied two in flight; each is handed to a :class:`Sink` as soon as its
copy is done, and so are the slabs of rows the steps protected, so that copying, encoding and
writing overlap. Two sinks write them: :class:`ThreadSink`, the writer's threads in this
process, and ``save/process_sink.py``'s, the rank's writer process.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Callable
from typing import Protocol

import torch

from embckpt.save.assemble import copied_out, staged_bytes
from embckpt.save.cow import CowSession, Segment
from embckpt.save.snapshot import StagedUnit

Chunk = tuple[Segment, torch.Tensor, torch.Tensor]
"""A chunk being copied: its segment, its slab and the mask of the rows it claimed."""


class Sink(Protocol):
    """Where a window's copies go. Each call takes the slab: the sink gives it back to the
    pool once its rows are written (or dropped), even when it fails."""

    def chunk(self, entry: Chunk) -> None: ...

    def protected(self, segments: list[Segment], slab: torch.Tensor) -> None: ...

    def raise_failed(self) -> None:
        """Raises the first failure of a hand-over, if any."""

    def close(self, ok: bool) -> None:
        """Every hand-over is done (small units flushed first when ``ok``); every slab is back.
        When ``ok``, raises the first failure (else the copier's own error is the one
        raised)."""


def run_copier(session: CowSession, sink: Sink) -> float:
    """The copier's loop (persist thread): chunks copied two in flight and handed to ``sink``;
    then the window closes and the last protected rows are handed over. Returns when the
    window closed (``time.perf_counter()``). Raises the first error once every hand-over
    ended, with every slab given back."""
    pool = session.pool
    pending: collections.deque[Chunk] = collections.deque(session.early)
    session.early = []
    closed_at = 0.0
    ok = False
    try:
        in_flight = min(2, pool.copier_slabs)
        for module, block, span in session.chunks():
            while len(pending) >= in_flight:
                sink.chunk(pending.popleft())
            pending.append(session.copy_chunk(module, block, span))
            for segments, slab in session.take_sealed():
                sink.protected(segments, slab)
            sink.raise_failed()
            if session.error is not None:
                raise session.error
        while pending:
            sink.chunk(pending.popleft())
        session.close_window()
        closed_at = time.perf_counter()
        if session.error is not None:
            raise session.error
        for segments, slab in session.take_sealed():
            sink.protected(segments, slab)
        ok = True
    finally:
        session.close_window()
        for segment, slab, _ in pending:  # a failure: copies end before their slabs go back
            segment.fence.synchronize()
            pool.give(slab)
        for segments, slab in session.take_sealed():
            for segment in segments:
                segment.fence.synchronize()
            pool.give(slab)
        sink.close(ok)
    return closed_at


class ThreadSink:
    """Units written by this process's writer threads: ``threads`` hand-overs at once, each
    one ``write()`` of the writer, which encodes and writes its units on its own threads.
    Units under ``pack_below`` bytes (small blocks, rows steps protected) are copied out of
    their slabs and handed over together, up to ``pack_bytes``, so that the writer packs them
    into shared files as it does a piece's small blocks."""

    def __init__(
        self,
        session: CowSession,
        write: Callable[[list[StagedUnit]], None],
        pack_below: int,
        pack_bytes: int,
        threads: int,
    ) -> None:
        self.session = session
        self.pool = session.pool
        self.write = write
        self.pack_below = pack_below
        self.pack_bytes = pack_bytes
        self.writes: list[concurrent.futures.Future[None]] = []
        self.executor = concurrent.futures.ThreadPoolExecutor(threads, "embckpt-cow-write")
        self.small: list[StagedUnit] = []
        self.small_bytes = 0

    def _hand_over(self, units: list[StagedUnit], slabs: list[torch.Tensor], held: int) -> None:
        def task() -> None:
            try:
                if units:
                    self.write(units)
            finally:
                self.pool.release(held)
                for slab in slabs:
                    self.pool.give(slab)

        self.pool.hold(held)
        self.writes.append(self.executor.submit(task))

    def _batch(self, unit: StagedUnit, held: int) -> None:
        """A small unit (its tensors outside any slab) joins the next packed hand-over."""
        self.small.append(unit)
        self.small_bytes += held
        self.pool.hold(held)
        if self.small_bytes >= self.pack_bytes:
            self._flush()

    def _flush(self) -> None:
        if self.small:
            units, held = list(self.small), self.small_bytes
            self.small.clear()
            self.small_bytes = 0
            self.pool.release(held)
            self._hand_over(units, [], held)

    def chunk(self, entry: Chunk) -> None:
        segment, slab, mask = entry
        unit: StagedUnit | None = None
        held = 0
        try:
            unit, held = self.session.chunk_unit(segment, mask)
            if unit is not None and not held and staged_bytes(unit) < self.pack_below:
                unit, held = copied_out(unit)
        finally:
            if unit is None or held:  # the rows were copied out of the slab (or none kept)
                self.pool.give(slab)
        if unit is None:
            return
        if held and held < self.pack_below:
            self._batch(unit, held)
        elif held:
            self._hand_over([unit], [], held)
        else:
            self._hand_over([unit], [slab], 0)

    def protected(self, segments: list[Segment], slab: torch.Tensor) -> None:
        try:
            units = self.session.protected_units(segments)
        finally:
            self.pool.give(slab)
        for unit in units:
            held = staged_bytes(unit)
            if held < self.pack_below:
                self._batch(unit, held)
            else:
                self._hand_over([unit], [], held)

    def raise_failed(self) -> None:
        for future in self.writes:
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]

    def close(self, ok: bool) -> None:
        if ok:
            self._flush()
        self.pool.release(self.small_bytes)
        self.small_bytes = 0
        self.executor.shutdown(wait=True)
        if ok:
            for future in self.writes:
                future.result()
