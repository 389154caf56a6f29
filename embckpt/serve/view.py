"""What a reader of a follower holds: a view of one step's tables, pinned while it is open.

The follower keeps one copy of the tables and updates it in place, so a view is a lease on
that copy: while any view is open, the next update waits (it never writes under a reader),
and while an update waits or runs, new views wait for it (so a stream of readers cannot starve
it). A view is therefore *pinned*, not copied on write: a reader that must keep a step longer
than its lookups takes a copy (:meth:`View.copy`) and releases the view.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


class ViewLock:
    """Many readers or one updater; a waiting updater goes before new readers."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._updating = False
        self._waiting = 0
        self.waited_s = 0.0
        """Seconds updates have waited for open views, in all."""

    def acquire_read(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._updating and not self._waiting)
            self._readers += 1

    def release_read(self) -> None:
        with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    @contextmanager
    def updating(self) -> Iterator[None]:
        """Exclusive: waits until no view is open."""
        start = time.perf_counter()
        with self._cond:
            self._waiting += 1
            try:
                self._cond.wait_for(lambda: not self._readers and not self._updating)
            finally:
                self._waiting -= 1
            self._updating = True
        self.waited_s += time.perf_counter() - start
        try:
            yield
        finally:
            with self._cond:
                self._updating = False
                self._cond.notify_all()


class View(Mapping[str, torch.Tensor]):
    """One step's tables, ``{table name: tensor [rows, cols]}``, and its dense state.

    Valid until :meth:`release` (or the end of a ``with`` block): the tensors are the
    follower's own, which the next update writes once every view is released.

    Attributes:
        step: the checkpoint the view shows.
        dense: the writer's ``model.state_dict()`` entries that are not tables.
    """

    def __init__(
        self,
        step: int,
        tables: Mapping[str, torch.Tensor],
        dense: Mapping[str, Any],
        lock: ViewLock,
    ) -> None:
        self.step = step
        self.dense = dense
        self._tables = dict(tables)
        self._lock: ViewLock | None = lock

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._lock is None:
            raise RuntimeError(f"the view of step {self.step} was released")
        return self._tables[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tables)

    def __len__(self) -> int:
        return len(self._tables)

    @property
    def open(self) -> bool:
        return self._lock is not None

    def copy(self) -> dict[str, torch.Tensor]:
        """The tables copied: kept for as long as the caller wants, whatever the follower does."""
        return {name: self[name].clone() for name in self._tables}

    def save_safetensors(self, path: str | Path) -> None:
        """Writes the tables and the dense tensors as one safetensors file (the step in its
        metadata), under a temporary name renamed into place: a reader of ``path`` sees
        one step whole."""
        import safetensors.torch

        tensors = {name: self[name].contiguous() for name in self._tables}
        tensors.update(
            {k: v.contiguous() for k, v in self.dense.items() if isinstance(v, torch.Tensor)}
        )
        tmp = f"{path}.tmp-{os.getpid()}"
        safetensors.torch.save_file(tensors, tmp, metadata={"embckpt.step": str(self.step)})
        os.replace(tmp, path)

    def release(self) -> None:
        """Lets the follower apply its next update; the tensors may change after this."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release_read()

    def __enter__(self) -> View:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()
