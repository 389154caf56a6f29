"""The copier of a copy-on-write snapshot (the persist thread): chunks copied and written.

Chunks are claimed and copied two in flight, each settled into a unit (the rows nobody claimed
before it) handed to a writer thread as soon as its copy is done, so copying, encoding and
writing overlap; the rows steps protected are handed over slab by slab. Slabs go back to the
pool once their rows are written, or at once when the rows were copied out of them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from collections.abc import Callable

import torch

from embckpt.save.cow import CowSession, Segment
from embckpt.save.snapshot import StagedUnit


def run_copier(
    session: CowSession,
    write: Callable[[list[StagedUnit]], None],
    pack_below: int,
    pack_bytes: int,
    threads: int,
) -> None:
    """The copier's loop (persist thread): chunks copied two in flight, units handed to
    ``write`` on writer threads (``threads`` hand-overs at once) as they are ready; then the
    window closes and the last protected rows are written. Units under ``pack_below`` bytes
    (small blocks, rows steps protected) are copied out of their slabs and handed over
    together, up to ``pack_bytes``, so that the writer packs them into shared files as it does
    a piece's small blocks. Raises the first error once every started write ended, with every
    slab given back."""
    pool = session.pool
    writes: list[concurrent.futures.Future[None]] = []
    # ``threads`` hand-overs at once: each is one write() of the writer, which encodes and
    # writes its units on the writer's own threads (one unit each, mostly).
    executor = concurrent.futures.ThreadPoolExecutor(threads, "embckpt-cow-write")
    pending = collections.deque(session.early)
    session.early = []
    small: list[StagedUnit] = []
    small_bytes = 0

    def hand_over(units: list[StagedUnit], slabs: list[torch.Tensor], held: int) -> None:
        def task() -> None:
            try:
                if units:
                    write(units)
            finally:
                pool.release(held)
                for slab in slabs:
                    pool.give(slab)

        pool.hold(held)
        writes.append(executor.submit(task))

    def batch(unit: StagedUnit, held: int) -> None:
        """A small unit (its tensors outside any slab) joins the next packed hand-over."""
        nonlocal small_bytes
        small.append(unit)
        small_bytes += held
        pool.hold(held)
        if small_bytes >= pack_bytes:
            flush()

    def flush() -> None:
        nonlocal small_bytes
        if small:
            units, held = list(small), small_bytes
            small.clear()
            small_bytes = 0
            pool.release(held)
            hand_over(units, [], held)

    def settle(entry: tuple[Segment, torch.Tensor, torch.Tensor]) -> None:
        segment, slab, mask = entry
        unit: StagedUnit | None = None
        held = 0
        try:
            unit, held = session.chunk_unit(segment, mask)
            if unit is not None and not held and staged_bytes(unit) < pack_below:
                unit, held = copied_out(unit)
        finally:
            if unit is None or held:  # the rows were copied out of the slab (or none kept)
                pool.give(slab)
        if unit is None:
            return
        if held and held < pack_below:
            batch(unit, held)
        elif held:
            hand_over([unit], [], held)
        else:
            hand_over([unit], [slab], 0)

    def protected() -> None:
        for segments, slab in session.take_sealed():
            try:
                units = session.protected_units(segments)
            finally:
                pool.give(slab)
            for unit in units:
                held = staged_bytes(unit)
                if held < pack_below:
                    batch(unit, held)
                else:
                    hand_over([unit], [], held)

    try:
        in_flight = min(2, pool.copier_slabs)
        for module, block, span in session.chunks():
            while len(pending) >= in_flight:
                settle(pending.popleft())
            pending.append(session.copy_chunk(module, block, span))
            protected()
            _raise_failed(writes)
            if session.error is not None:
                raise session.error
        while pending:
            settle(pending.popleft())
        session.close_window()
        if session.error is not None:
            raise session.error
        protected()
        flush()
    finally:
        session.close_window()
        for segment, slab, _ in pending:  # a failure: copies end before their slabs go back
            segment.fence.synchronize()
            pool.give(slab)
        for segments, slab in session.take_sealed():
            for segment in segments:
                segment.fence.synchronize()
            pool.give(slab)
        pool.release(small_bytes)
        executor.shutdown(wait=True)
    for future in writes:
        future.result()


def staged_bytes(unit: StagedUnit) -> int:
    """Bytes of a unit's staged tensors."""
    tensors = [unit.weights, unit.fused, *unit.row_states.values(), *unit.elem_states.values()]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def copied_out(unit: StagedUnit) -> tuple[StagedUnit, int]:
    """The unit with its tensors copied out of its slab, and their bytes."""
    copy = dataclasses.replace(
        unit,
        weights=unit.weights.clone(),
        fused=None if unit.fused is None else unit.fused.clone(),
        row_states={n: t.clone() for n, t in unit.row_states.items()},
        elem_states={n: t.clone() for n, t in unit.elem_states.items()},
    )
    return copy, staged_bytes(copy)


def _raise_failed(writes: list[concurrent.futures.Future[None]]) -> None:
    for future in writes:
        if future.done() and future.exception() is not None:
            raise future.exception()  # type: ignore[misc]
