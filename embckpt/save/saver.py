"""The save side of a ``Checkpointer``: decide, snapshot, persist and commit, as one transaction.

Pipeline of one ``save(step)`` (every rank calls it together):

1. resolve  - the previous checkpoint's persist must be done (one in flight); its outcome is
              applied (:mod:`embckpt.save.transaction`) and its failure, if nobody saw it yet,
              raised here;
2. decide   - fold the row trackers, take the statefuls' state (refusing what a checkpoint
              cannot hold), combine dirty fractions and interval measurements over ranks (with
              any rank's error), ask the policy (identical inputs everywhere, so an identical
              decision): ``save/decide.py``;
3. snapshot - take the tracker views the decision consumes, copy the dense state, and copy the
              rows to write (all, or the dirty rows) with their optimizer state into the staging
              arena. A checkpoint larger than the staging budget is staged and written piece by
              piece; only the last piece leaves the training thread. With ``pipeline="full"``
              the last piece's copy also runs in the background, and the next weight update
              (the fused backward, the dense optimizer step) waits for it. An error here is
              kept for the persist, which reports it on every rank;
4. encode   - in the background, on the persist thread (:mod:`embckpt.save.persist`): the
              staged rows through the codec into Parquet files, the dense state into
              safetensors;
5. write    - the files, each checksummed and indexed, retried on transient errors;
6. commit   - ranks agree, rank 0 writes the manifest last, which commits the checkpoint; ranks
              agree again, then rank 0 applies retention;
7. resolve  - the training thread applies the outcome at its next save, restore, ``wait()`` or
              ``close()``: committed, the staged changes take effect; failed, they are rolled
              back on every rank and rank 0 has deleted the step's files.

The timed phases (``storage/phases.py``) are snapshot, encode, write and commit, with write's
checksums (``hash``) and ``fsync`` timed apart.

``save`` returns after step 3.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any

import torch

from embckpt import dense, failpoints, kernel_cache
from embckpt.blocks import TableShard
from embckpt.codecs import Codec
from embckpt.config import codec_for
from embckpt.policy import Kind, bits_for_restores
from embckpt.save.backend import start_writer_process, uses_process, warm_kernels
from embckpt.save.context import SaveContext
from embckpt.save.decide import Decided, decide, mark_moving_rows, tracker_view
from embckpt.save.guards import UpdateGuard
from embckpt.save.pending import PendingCheckpoint
from embckpt.save.persist import Persister, Snapshot
from embckpt.save.protect import ProtectHooks, cow_supported, device_encoder, open_window
from embckpt.save.slabs import SlabPool
from embckpt.save.snapshot import Stager, plan_save
from embckpt.save.staging import StagingArena
from embckpt.save.transaction import SaveState, SaveTransaction
from embckpt.save.writer import RowFileWriter
from embckpt.storage.manifest import Manifest
from embckpt.storage.phases import PhaseClock
from embckpt.tracking import View

__all__ = ["PendingCheckpoint", "Saver"]


class Saver:
    """Takes checkpoints of one model: owns the :class:`SaveState` every save changes, the
    writer, the staging arena and the persist thread.

    Args:
        context: the model, its directory and settings.
        state: the tracker, reference, interval and chain head (see ``save/transaction.py``).
        writer: the rows-file writer (its reference is ``state.reference``).
    """

    def __init__(self, context: SaveContext, state: SaveState, writer: RowFileWriter) -> None:
        self.ctx = context
        self.state = state
        self.writer = writer
        self.restores = 0  # restores this job went through, carried from manifest to manifest
        self.codec: Codec = codec_for(context.config)
        self.follow_expected_restores()  # a codec without bits fails here, not at a save
        shards = context.sharded.shards
        device = shards[0].weight.device if shards else torch.device("cpu")
        self.arena = StagingArena(context.config.staging_budget_bytes, device)
        writer.staging = self.arena  # encoded buffers count against the same budget
        self._stage_piece = Stager(
            self.arena, torch.cuda.Stream(device) if device.type == "cuda" else None
        )
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "embckpt-persist")
        self._inflight: PendingCheckpoint | None = None
        self._guard = (
            UpdateGuard(
                context.model,
                context.optimizer,
                [k.module for k in context.sharded.kernels if k.every_row],
            )
            if context.config.pipeline == "full"
            else None
        )
        # Copy-on-write (pipeline "full" where every update follows a lookup): save() returns
        # once the window is open; the copier and the steps copy the rows (save/cow.py), and
        # the rank's writer process or the writer's threads write them (save/backend.py).
        cow = context.config.pipeline == "full" and cow_supported(context.sharded)
        self._hooks = ProtectHooks(state.tracker) if cow else None
        process = cow and uses_process(context.config, device)
        self.slabs = SlabPool(
            context.config.staging_budget_bytes, device.type == "cuda", shared=process
        )
        writers = list(context.sharded.writer_shards())
        self.process = (
            start_writer_process(context.store, writer, self.codec, writers, self.slabs)
            if process
            else None
        )
        if self.process is not None:
            state.reference = self.process.reference  # type: ignore[assignment]
        warm_kernels(None if process else writer, self.codec, writers, cow)
        self._blocked_since_tick = 0.0
        # No reference cycle back to the saver: it (and the process group its context holds)
        # is freed as soon as the Checkpointer is, not by a garbage collection at exit.
        self._persister = Persister(
            context, state, writer, self._stage_piece, self._guard, self.process
        )

    # -- when to save -------------------------------------------------------------------------
    def maybe_save(self, step: int) -> PendingCheckpoint | None:
        """See ``Checkpointer.maybe_save``."""
        inflight = self._inflight
        busy = inflight is not None and not inflight.done()
        if inflight is not None and not busy:
            inflight.settle()  # a failed save puts the next step back: it is tried again now
        state = self.state
        state.clock.tick(time.perf_counter(), busy, self._blocked_since_tick)
        self._blocked_since_tick = 0.0
        if state.next_step is None:
            state.next_step = step + state.interval.interval - 1
        if step < state.next_step:
            return None
        return self.save(step)

    # -- save ---------------------------------------------------------------------------------
    def save(self, step: int) -> PendingCheckpoint:
        """See ``Checkpointer.save``."""
        started = time.perf_counter()
        self.finish_inflight()
        if self.process is not None and not self.process.alive:
            self.process.restart()  # its reference died with it: this save is a full
        self.arena.reset_peak()
        self.slabs.reset_peak()
        self.follow_expected_restores()
        transaction = SaveTransaction(step, self.state)
        try:
            decided = self._decide(step, transaction)
        except BaseException:
            transaction.roll_back()
            raise
        future: concurrent.futures.Future[Manifest | None] = concurrent.futures.Future()
        handle = PendingCheckpoint(step, future, transaction, started)
        clock = PhaseClock()
        mode = self.ctx.config.pipeline
        try:
            snapshot = self._snapshot(step, decided, started, clock, transaction)
            snapshot.on_copied = handle.copied
            if mode == "off":
                _run_into(future, self._persister.persist, snapshot)
            else:
                if mode == "persist" and snapshot.pending and snapshot.error is None:
                    try:
                        with clock.time("snapshot"):
                            snapshot.staged = self._stage_piece(snapshot.pending)
                    except Exception as exc:  # reported on every rank by the persist
                        snapshot.error = exc
                    snapshot.pending = []
                elif snapshot.session is None and snapshot.pending and self._guard is not None:
                    self._guard.hold()  # weight updates wait until the background copy is done
                self._thread.submit(_run_into, future, self._persister.persist, snapshot)
        except BaseException:  # an interrupt: errors go to the persist, which reports them
            self._release_guard()
            transaction.roll_back()
            raise
        handle.blocked_s = time.perf_counter() - started
        self._blocked_since_tick += handle.blocked_s
        self.state.last_blocked_s = handle.blocked_s
        self._inflight = handle
        if mode == "off":
            self.finish_inflight()
        return handle

    def follow_expected_restores(self) -> None:
        """Widens the codes once more restores happened than the job expected (a new codec only
        when the width changes, so codecs keep their caches)."""
        config = self.ctx.config
        if config.expected_restores is None:
            return
        bits = bits_for_restores(config.expected_restores, self.restores)
        if getattr(self.codec, "bits", None) != bits:
            self.codec = codec_for(dataclasses.replace(config, bits=bits))
            if getattr(self, "_hooks", None) is not None:  # the device encoder's new kernels
                warm_kernels(None, self.codec, list(self.ctx.sharded.writer_shards()), True)

    def finish_inflight(self) -> None:
        """Waits for the checkpoint in flight, applies its outcome, and raises its failure if
        nobody has seen it."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        inflight.settle()
        if not inflight.observed:
            inflight.wait()  # raises its failure, once

    def _decide(self, step: int, transaction: SaveTransaction) -> Decided:
        """The checkpoint, decided the same on every rank (``save/decide.py``)."""
        return decide(self.ctx, self.state, self.codec, step, transaction)

    def mark_moving_rows(self) -> None:
        """See :func:`embckpt.save.decide.mark_moving_rows`."""
        mark_moving_rows(self.ctx, self.state.tracker)

    @torch.no_grad()
    def _snapshot(
        self,
        step: int,
        decided: Decided,
        started: float,
        clock: PhaseClock,
        transaction: SaveTransaction,
    ) -> Snapshot:
        """Stages what the checkpoint writes. Nothing here raises: an error is kept in the
        snapshot and reported on every rank by the persist (a rank that raised here alone would
        leave the others waiting in a collective)."""
        decision, dirty = decided.decision, decided.dirty
        fraction = 1.0 if decision.kind is Kind.FULL else dirty[tracker_view(decision)]
        snapshot = Snapshot(
            step=step,
            decision=decision,
            dirty_fraction=fraction,
            touched_fraction=dirty[View.SINCE_LAST],
            started=started,
            clock=clock,
            transaction=transaction,
            codec=self.codec,
            restores=self.restores,
        )
        try:
            selected = self._stage_state(snapshot, decided)
            if self._hooks is not None:
                self.writer.staging = self.slabs
                full = decision.kind is Kind.FULL
                encoder = device_encoder(self.codec, full, self.arena.model_device)
                with clock.time("snapshot"):
                    snapshot.session = open_window(
                        self.state.tracker,
                        selected,
                        self.slabs,
                        self._hooks,
                        self.ctx.config.max_file_rows,
                        encoder,
                    )
                return snapshot
            self.writer.staging = self.arena
            config = self.ctx.config
            pieces = plan_save(
                selected, config.staging_budget_bytes, self.writer.threads, config.max_file_rows
            )
            self._stage_piece.prepare(pieces)
        except Exception as exc:
            snapshot.error = exc
            return snapshot
        # Pieces beyond the budget are staged and written now, on the training thread: the state
        # must stay as of this step until every piece is copied.
        for piece in pieces[:-1]:
            try:
                with clock.time("snapshot"):
                    staged = self._stage_piece(piece)
                snapshot.entries.extend(
                    self.writer.write(step, staged, decision, self.codec, transaction.edits, clock)
                )
                del staged  # the piece is written: its views of the arena go
            except Exception as exc:
                snapshot.error = exc
                return snapshot
        snapshot.pending = pieces[-1]
        return snapshot

    def _stage_state(
        self, snapshot: Snapshot, decided: Decided
    ) -> list[tuple[TableShard, torch.Tensor | None]]:
        """Takes the tracker views, copies the dense and rank state (the statefuls' and the
        counters as taken at the decision); returns each block's rows to write (None: all)."""
        ctx, tracker = self.ctx, self.state.tracker
        decision = snapshot.decision
        selected: list[tuple[TableShard, torch.Tensor | None]] = [
            (
                s,
                None
                if decision.kind is Kind.FULL
                else tracker.dirty(s.key, tracker_view(decision)),
            )
            for s in ctx.sharded.writer_shards()
        ]
        snapshot.transaction.take_bits()
        with snapshot.clock.time("snapshot"):
            # Cached rows' updates reach UVM, where the copies read them (every rank).
            kernel_cache.flush(ctx.sharded.caching)
            if ctx.comm.rank == 0:
                snapshot.dense = dense.detached_copy(
                    dense.dense_state(
                        ctx.model,
                        ctx.optimizer,
                        ctx.sharded.table_keys,
                        decided.fused_scalars,
                    )
                )
            snapshot.rank = dense.detached_copy(dense.rank_state(decided.states, ctx.sharded.mch))
        failpoints.hit("save.plan")
        return selected

    def _release_guard(self) -> None:
        if self._guard is not None:
            self._guard.release()

    # -- after a restore ---------------------------------------------------------------------
    def restored(
        self,
        manifest: Manifest | None,
        diff_rows: tuple[tuple[str, torch.Tensor], ...] = (),
    ) -> None:
        """The model now holds ``manifest``'s step (None: the directory was empty): the next
        checkpoint continues that chain, and ``diff_rows`` (block key, local rows), the restored
        rows its diffs changed, count as changed since the full. The reference is gone until the
        next full. Takes the manifest and rows, not a restore's result: the save flow does not
        depend on the read flow."""
        if manifest is None:
            self.restore_failed()  # nothing to continue from, as after a failed restore
            return
        state = self.state
        state.reference.clear()
        state.next_step = None
        state.tracker.reset()
        for key, local_rows in diff_rows:
            state.tracker.mark(key, local_rows, View.SINCE_FULL)
        state.head = manifest
        self.restores = int(manifest.stats.get("restores", 0)) + 1
        if state.reconstruction is not None:
            state.reconstruction.reset_from_live(self.ctx.sharded.writer_shards())

    def restore_failed(self) -> None:
        """No chain describes the model (a restore raised and may have loaded part of it, or
        the directory was empty): the next save is a full."""
        state = self.state
        state.reference.clear()
        state.head = None
        state.next_step = None
        if state.reconstruction is not None:
            state.reconstruction.forget()

    def close(self) -> None:
        """Finishes the checkpoint in flight (raising its failure if unseen)."""
        try:
            self.finish_inflight()
        finally:
            self._thread.shutdown(wait=True)
            self.writer.close()
            if self.process is not None:
                self.process.close()
            self.slabs.close()
            if self._guard is not None:
                self._guard.close()
            if self._hooks is not None:
                self._hooks.close()


def _run_into(future: concurrent.futures.Future[Manifest | None], fn: Any, *args: Any) -> None:
    """Runs ``fn`` and settles ``future`` with its result or its exception."""
    try:
        future.set_result(fn(*args))
    except BaseException as exc:  # delivered through the future, raised on wait()/next save()
        future.set_exception(exc)
