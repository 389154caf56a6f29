"""The handle ``save`` returns: the outcome of a save in flight, applied once on the training
thread."""

from __future__ import annotations

import concurrent.futures
import threading

from embckpt.save.transaction import SaveTransaction
from embckpt.storage.manifest import Manifest


class PendingCheckpoint:
    """A save in progress. ``wait()`` returns its manifest or raises
    the error that stopped it (the manifest as this rank built it: its ``files`` list this
    rank's rows files and every rank's rank file; ``storage.chain.read_manifest`` reads every
    rank's, ``Manifest.complete`` says which); ``blocked_s`` is how long ``save`` held the
    training thread; ``copied_s``, once known, how long after ``save()`` was called every row
    it writes was copied off the model (the copy-on-write window closed; None until then).

    Call ``wait()`` from the training thread: it also applies the save's outcome."""

    def __init__(
        self,
        step: int,
        future: concurrent.futures.Future[Manifest | None],
        transaction: SaveTransaction | None = None,
        started: float | None = None,
    ) -> None:
        self.step = step
        self.blocked_s = 0.0
        self.copied_s: float | None = None
        self._started = started
        self._future = future
        self._transaction = transaction
        self._settled = False
        self._lock = threading.Lock()
        self.observed = False

    def copied(self, at: float) -> None:
        """Every row is copied off the model at ``at`` (``time.perf_counter()``)."""
        if self._started is not None:
            self.copied_s = at - self._started

    def done(self) -> bool:
        return self._future.done()

    def settle(self) -> None:
        """Waits for the outcome and applies it (once): commit or roll back."""
        error = self._future.exception()
        with self._lock:
            if self._settled:
                return
            self._settled = True
            if self._transaction is None:
                return
            if error is None:
                manifest = self._future.result()
                assert manifest is not None
                self._transaction.commit(manifest)
            else:
                self._transaction.roll_back()

    def wait(self) -> Manifest | None:
        self.settle()
        self.observed = True
        return self._future.result()
