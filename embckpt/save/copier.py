"""The copier of a copy-on-write snapshot (the persist thread): chunks copied and written.

Chunks are claimed and copied two in flight, each settled into a unit (the rows nobody claimed
before it) handed to a writer thread as soon as its copy is done, so copying, encoding and
writing overlap; the rows steps protected are handed over slab by slab. Slabs go back to the
pool once their rows are written, or at once when the rows were copied out of them.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable

import torch

from embckpt.save.cow import CowSession, Segment
from embckpt.save.snapshot import StagedUnit


def run_copier(session: CowSession, write: Callable[[list[StagedUnit]], None]) -> None:
    """The copier's loop (persist thread): chunks copied two in flight, units handed to
    ``write`` on a writer thread as they are ready; then the window closes and the last
    protected rows are written. Raises the first error once every started write ended, with
    every slab given back."""
    pool = session.pool
    writes: list[concurrent.futures.Future[None]] = []
    executor = concurrent.futures.ThreadPoolExecutor(1, "embckpt-cow-write")
    pending = collections.deque(session.early)
    session.early = []

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

    def settle(entry: tuple[Segment, torch.Tensor, torch.Tensor]) -> None:
        segment, slab, mask = entry
        try:
            unit, held = session.chunk_unit(segment, mask)
        except BaseException:
            pool.give(slab)
            raise
        if held or unit is None:  # the rows were copied out of the slab (or none is kept)
            pool.give(slab)
            hand_over([unit] if unit is not None else [], [], held)
        else:
            hand_over([unit], [slab], 0)

    def protected() -> None:
        for segments, slab in session.take_sealed():
            try:
                units, held = session.protected_units(segments)
            finally:
                pool.give(slab)
            hand_over(units, [], held)

    try:
        in_flight = min(2, pool.copier_slabs)
        for module, block, span in session.chunks():
            while len(pending) >= in_flight:
                settle(pending.popleft())
            pending.append(session.copy_chunk(module, block, span))
            protected()
            _raise_failed(writes)
        while pending:
            settle(pending.popleft())
        session.close_window()
        protected()
    finally:
        session.close_window()
        for segment, slab, _ in pending:  # a failure: copies end before their slabs go back
            segment.fence.synchronize()
            pool.give(slab)
        for segments, slab in session.take_sealed():
            for segment in segments:
                segment.fence.synchronize()
            pool.give(slab)
        executor.shutdown(wait=True)
    for future in writes:
        future.result()


def _raise_failed(writes: list[concurrent.futures.Future[None]]) -> None:
    for future in writes:
        if future.done() and future.exception() is not None:
            raise future.exception()  # type: ignore[misc]
