"""A copy-on-write window's copies handed to the rank's writer process (``save/copier.Sink``).

What crosses is small: per chunk, the block, its file part, its local rows, where each tensor
lies in the shared slabs (offset, type, shape) and the mask of the rows it claimed; per sealed
slab of protected rows, the same for each segment. The process assembles the units
(``save/assemble.py``), encodes and writes them and frees each slab once it no longer reads
it; the pool gets it back then. Tensors outside the shared memory (data-parallel blocks copied
while ``save()`` ran, scratch slabs beyond the budget) are sent by value.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from embckpt.save.capture import CapturedRows
from embckpt.save.copier import Chunk
from embckpt.save.cow import CowSession, Segment, by_block
from embckpt.save.writer_process import WriterProcess
from embckpt.storage.manifest import FileEntry
from embckpt.storage.phases import PhaseClock


class ProcessSink:
    """Hands one save's copies to ``process``, which ``begin`` told what the save is.

    Args:
        session: the save's window.
        process: the rank's writer process.
        begin: the ``begin`` message's fields (step, decision, codec config, reference edit,
            capture, rebuild).
    """

    def __init__(self, session: CowSession, process: WriterProcess, begin: tuple[Any, ...]):
        self.session = session
        self.pool = session.pool
        self.process = process
        self._cond = threading.Condition()
        self._outstanding = 0
        self.error: BaseException | None = None
        self.entries: list[FileEntry] = []
        self.seconds: dict[str, float] = {}
        self.captured: list[CapturedRows] = []
        self.reference_ready = False
        process.save_error = None
        process.send(("begin", *begin))

    def chunk(self, entry: Chunk) -> None:
        segment, slab, mask = entry
        segment.fence.synchronize()
        keep = mask.numpy()
        if not keep.any():
            self.pool.give(slab)
            return
        self._hand_over(
            "chunk",
            [slab],
            segment.block.shard.key,
            self.session.part(segment.block),
            segment.local_rows.numpy(),
            self._described(segment.tensors),
            None if keep.all() else keep.copy(),
        )

    def protected(self, segments: list[Segment], slab: torch.Tensor) -> None:
        groups = [
            (
                parts[0].block.shard.key,
                self.session.part(parts[0].block),
                [(s.local_rows.numpy(), self._described(s.tensors)) for s in parts],
            )
            for parts in by_block(segments).values()
        ]
        self._hand_over("protected", [slab], groups)

    def _described(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Where each tensor lies in the shared memory, or its values."""
        memory = self.process.memory
        out: dict[str, Any] = {}
        for name, tensor in tensors.items():
            offset = memory.offset_of(tensor) if tensor.is_contiguous() else None
            if offset is None:
                out[name] = tensor.numpy().copy()
            else:
                out[name] = (offset, tensor.dtype, tuple(tensor.shape))
        return out

    def _hand_over(self, kind: str, slabs: list[torch.Tensor], *fields: Any) -> None:
        with self._cond:
            self._outstanding += 1

        def done(error: BaseException | None) -> None:
            for slab in slabs:
                self.pool.give(slab)
            with self._cond:
                self.error = self.error or error
                self._outstanding -= 1
                self._cond.notify_all()

        self.process.hand_over(kind, *fields, done=done)

    def raise_failed(self) -> None:
        error = self.error or self.process.save_error
        if error is not None:
            raise error

    def close(self, ok: bool) -> None:
        """Waits until the process read every slab it was handed and wrote the save; when
        ``ok``, takes its answer and raises its first error."""
        with self._cond:
            while self._outstanding:
                self._cond.wait()
        try:
            answer = self.process.finish()
        except BaseException:
            if ok:
                raise
            return
        entries, seconds, captured, ready, error = answer
        self.reference_ready = ready
        if not ok:
            return
        if error is not None:
            raise self.process.failed(*error)
        self.raise_failed()
        self.entries = list(entries)
        self.seconds = seconds
        self.captured = [_as_tensors(rows) for rows in captured or []]

    def record(self, clock: PhaseClock) -> None:
        """Adds the process's phase seconds to the save's."""
        for phase, seconds in self.seconds.items():
            clock.add(phase, seconds)


def _as_tensors(rows: tuple[Any, ...]) -> CapturedRows:
    key, num_rows, local_rows, values = rows
    return CapturedRows(
        key,
        num_rows,
        torch.from_numpy(np.asarray(local_rows)),
        {k: torch.from_numpy(np.asarray(v)) for k, v in values.items()},
    )
