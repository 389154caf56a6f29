"""The persist of a save: its files, the ranks' agreement and the manifest that commits it.

Runs on the persist thread (inline with ``pipeline="off"``) and changes no saver state: it
returns the committed manifest or raises, the same on every rank, and the training thread
applies that outcome (``save/transaction.py``). Order: the last piece is staged (the next weight
update waits for it), rows and dense files are written, ranks agree (gathering what each wrote,
in the same collective), rank 0 writes the manifest, ranks agree again; then, with
``keep_last`` set, rank 0 applies retention and the ranks meet once more. On any failure rank 0
deletes the step's files.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from embckpt import dense, failpoints
from embckpt.codecs import Codec
from embckpt.errors import SaveError, SaveRankError, as_error
from embckpt.policy import Decision
from embckpt.save.commit_manifest import CommitFacts, Reported, build_manifest
from embckpt.save.context import SaveContext
from embckpt.save.copier import ThreadSink, run_copier
from embckpt.save.cow import CowSession
from embckpt.save.guards import UpdateGuard
from embckpt.save.process_sink import ProcessSink
from embckpt.save.snapshot import StagedUnit, Unit
from embckpt.save.transaction import SaveState, SaveTransaction
from embckpt.save.writer import PACKED_FILE_BYTES, RowFileWriter
from embckpt.save.writer_process import WriterProcess
from embckpt.storage.layout import DENSE_FILE, MANIFEST_NAME, rank_file
from embckpt.storage.manifest import PART_ROLES, FileEntry, Manifest, PartEntry, WrittenFile
from embckpt.storage.phases import PhaseClock
from embckpt.storage.rank_parts import index_metadata, part_of
from embckpt.storage.retention import apply_retention

log = logging.getLogger(__name__)


@dataclass
class Snapshot:
    """Everything one checkpoint writes, staged; ``pending`` is the part the persist stages."""

    step: int
    decision: Decision
    dirty_fraction: float
    touched_fraction: float  # of all rows, touched since the previous checkpoint
    started: float
    clock: PhaseClock
    transaction: SaveTransaction
    codec: Codec  # the row codec of this save
    restores: int  # restores the job went through, recorded in the manifest
    dense: dict[str, Any] | None = None
    rank: dict[str, Any] = field(default_factory=dict)
    pending: list[Unit] = field(default_factory=list)
    session: CowSession | None = None  # a copy-on-write window: the copier runs in the persist
    staged: list[StagedUnit] = field(default_factory=list)
    entries: list[FileEntry] = field(default_factory=list)
    part: PartEntry | None = None  # this rank's part (format 5): its rank file indexes its rows
    error: BaseException | None = None
    on_copied: Callable[[float], None] | None = None  # told when every row is copied

    def copied(self, at: float | None = None) -> None:
        """Every row the save writes is copied off the model (at ``at``, else now)."""
        if self.on_copied is not None:
            self.on_copied(time.perf_counter() if at is None else at)


class Persister:
    """Writes and commits snapshots.

    Args:
        context: the model, directory and settings.
        state: read only here: the chain head the manifest continues.
        writer: the rows-file writer.
        stage: copies a piece into the staging arena (the saver's).
        guard: holds weight updates back until the last piece is staged (``pipeline="full"``).
        process: the rank's writer process, which writes copy-on-write saves (None: the
            writer's threads in this process do).
    """

    def __init__(
        self,
        context: SaveContext,
        state: SaveState,
        writer: RowFileWriter,
        stage: Callable[[list[Unit]], list[StagedUnit]],
        guard: UpdateGuard | None,
        process: WriterProcess | None = None,
    ) -> None:
        self.ctx = context
        self.process = process
        self.state = state
        self.writer = writer
        # Set here rather than where the writer is built: every save goes through this.
        writer.pack_below_bytes = context.config.pack_below_bytes
        self._stage_piece = stage
        self._guard = guard

    def _release_guard(self) -> None:
        if self._guard is not None:
            self._guard.release()

    def persist(self, snapshot: Snapshot) -> Manifest:
        """Writes, agrees, commits (persist thread). Changes no saver state: the outcome is
        applied by :meth:`PendingCheckpoint.settle` on the training thread."""
        ctx = self.ctx
        comm, step = ctx.comm, snapshot.step
        started = time.perf_counter()
        try:
            error = snapshot.error
            if error is None and snapshot.session is not None:
                error = self._copy_and_write(snapshot, snapshot.session)
            elif error is None and snapshot.pending:
                try:
                    with snapshot.clock.time("snapshot"):
                        snapshot.staged = self._stage_piece(snapshot.pending)
                    snapshot.copied()
                except Exception as exc:
                    error = exc
            elif error is None:
                snapshot.copied()
            self._release_guard()
            if error is None:
                error = self._write_rest(snapshot)
            error = as_save_error(error, step, comm.rank)
            # One collective agrees and gathers what each rank wrote, with its phases and the
            # moment it arrived (see _waited).
            agreeing = time.perf_counter()
            gathered = comm.gather_checked(
                (self._reported(snapshot), snapshot.clock.seconds(), time.time()),
                error,
                f"saving step {step}",
                SaveRankError,
            )
            took = time.perf_counter() - agreeing
            manifest = self._manifest(snapshot, _waited(gathered, comm.rank, took))
            error = None
            if comm.rank == 0:
                try:
                    failpoints.hit("save.manifest")
                    ctx.lock.check_held()  # a job that lost the directory never commits
                    key = ctx.signing_key
                    text = manifest.to_json(None if key is None else key.sign)
                    ctx.store.write_atomic(ctx.store.step_path(step, MANIFEST_NAME), text.encode())
                except Exception as exc:
                    error = exc
            comm.check(
                as_save_error(error, step, comm.rank, "writing the manifest"),
                f"committing step {step}",
                SaveRankError,
            )
        except BaseException:
            self._release_guard()
            self._discard_step(step)
            raise
        if ctx.tiers is not None:  # manifest copies, replica, durable copy, retention per tier
            ctx.tiers.committed(manifest)
        elif self.ctx.config.keep_last:  # without retention, the commit's agreement is the last
            if comm.rank == 0:
                self._apply_retention(step)
            self._await_retention(step)
        return manifest.with_stats(persist_seconds=time.perf_counter() - started)

    def _copy_and_write(self, snapshot: Snapshot, session: CowSession) -> BaseException | None:
        """Runs a copy-on-write window's copier, units written as they are copied: by the
        writer process, or by the writer's threads."""

        def write(units: list[StagedUnit]) -> None:
            entries = self.writer.write(
                snapshot.step,
                units,
                snapshot.decision,
                snapshot.codec,
                snapshot.transaction.edits,
                snapshot.clock,
            )
            snapshot.entries.extend(entries)

        process = self.process
        sink: ThreadSink | ProcessSink | None = None
        try:
            failpoints.hit("save.stage")
            with snapshot.clock.time("snapshot"):
                if process is None:
                    sink = ThreadSink(
                        session,
                        write,
                        self.writer.pack_below_bytes,
                        PACKED_FILE_BYTES,
                        self.writer.threads,
                    )
                else:
                    sink = ProcessSink(session, process, _begin(snapshot))
                snapshot.copied(run_copier(session, sink))
        except Exception as exc:
            return exc
        finally:
            if isinstance(sink, ProcessSink):
                self._took(snapshot, sink)
        return None

    def _took(self, snapshot: Snapshot, sink: ProcessSink) -> None:
        """What the writer process wrote, as the save's own."""
        assert self.process is not None
        self.process.reference.written(sink.reference_ready)
        snapshot.entries.extend(sink.entries)
        sink.record(snapshot.clock)
        capture = snapshot.transaction.edits.capture
        if capture is not None:
            for rows in sink.captured:
                capture.add(rows)

    def _discard_step(self, step: int) -> None:
        """Rank 0, after a failed save: deletes its files, manifest first if one was written
        (then every rank agreed it failed, so it is not a checkpoint). Best effort, and only
        while this job holds the directory: a folder left behind is a leftover, never read."""
        if self.ctx.comm.rank != 0:
            return
        try:
            self.ctx.lock.check_held()
            self.ctx.store.remove_step(step)
        except Exception as exc:  # the save's own error is the one raised
            log.warning("could not delete the files of failed step %d: %s", step, exc)

    def _apply_retention(self, step: int) -> None:
        """Rank 0, after the commit: drop what is not kept. Its failure never fails the save
        (the checkpoint is committed): it is logged and retried after the next one."""
        try:
            failpoints.hit("save.retention")
            apply_retention(self.ctx.store, self.ctx.config.keep_last)
        except Exception as exc:
            log.warning("retention after step %d failed: %s", step, exc)

    def _await_retention(self, step: int) -> None:
        """Every rank returns once rank 0's retention is done, so a rank that lists the
        directory after ``wait()`` sees what is kept. The save is committed whatever happens
        here: a failed agreement is logged, and the next save's collectives report it."""
        try:
            self.ctx.comm.all_gather(None)
        except Exception as exc:
            log.warning("step %d is committed, but the ranks did not meet after it: %s", step, exc)

    def _write_rest(self, snapshot: Snapshot) -> BaseException | None:
        """Writes the last piece's rows and the dense files; returns the error, if any."""
        step, clock = snapshot.step, snapshot.clock
        store, rank = self.ctx.store, self.ctx.comm.rank
        try:
            if snapshot.staged:
                snapshot.entries.extend(
                    self.writer.write(
                        step,
                        snapshot.staged,
                        snapshot.decision,
                        snapshot.codec,
                        snapshot.transaction.edits,
                        clock,
                    )
                )
            failpoints.hit("save.dense")
            # write_file's own time, less its write and fsync, is the file's checksum.
            if snapshot.dense is not None:
                with clock.time("encode"):
                    data = dense.encode_tree(snapshot.dense)
                with clock.time("hash"):
                    written = store.write_file(step, DENSE_FILE, data, clock=clock)
                snapshot.entries.append(_entry(written, "dense", rank))
            rows = [e for e in snapshot.entries if e.role == "rows"]
            with clock.time("encode"):
                index = index_metadata(rows) if self.ctx.tiers is None else None
                data = dense.encode_tree(snapshot.rank, metadata=index)
            with clock.time("hash"):
                written = store.write_file(step, rank_file(rank), data, clock=clock)
            if index is None:
                snapshot.entries.append(_entry(written, "rank", rank))
            else:
                snapshot.part = part_of(rank, data, written, rows)
            failpoints.hit("save.agree")
        except Exception as exc:
            return exc
        return None

    def _reported(self, snapshot: Snapshot) -> Reported:
        """What this rank tells the others at the commit: its part and its files outside it
        (format 5: the dense file, on rank 0), or no part and every file it wrote."""
        if snapshot.part is None:
            return Reported(None, snapshot.entries)
        return Reported(snapshot.part, [e for e in snapshot.entries if e.role not in PART_ROLES])

    def _manifest(
        self, snapshot: Snapshot, gathered: list[tuple[Reported, dict[str, float]]]
    ) -> Manifest:
        ctx = self.ctx
        return build_manifest(
            CommitFacts(
                step=snapshot.step,
                decision=snapshot.decision,
                policy=ctx.policy.name,
                world_size=ctx.comm.world_size,
                rank=ctx.comm.rank,
                codec=snapshot.codec.get_config(),
                tables=ctx.tables,
                head=self.state.head,
                full_fp32_bytes=ctx.full_fp32_bytes,
                dirty_fraction=snapshot.dirty_fraction,
                touched_fraction=snapshot.touched_fraction,
                started=snapshot.started,
                restores=snapshot.restores,
            ),
            gathered,
            [e for e in snapshot.entries if e.role == "rows"],
        )


def _begin(snapshot: Snapshot) -> tuple[Any, ...]:
    """The writer process's ``begin`` message of a save: step, decision, codec, the reference
    edit (None, or whether it restarts the chain), capture, whether the reference is rebuilt."""
    transaction = snapshot.transaction
    edit = transaction.edits.reference
    return (
        snapshot.step,
        snapshot.decision,
        dict(snapshot.codec.get_config()),
        None if edit is None else edit.restarts_chain,
        transaction.edits.capture is not None,
        transaction.rebuilds_reference,
    )


def _waited(
    gathered: list[tuple[Reported, dict[str, float], float]], rank: int, took: float
) -> list[tuple[Reported, dict[str, float]]]:
    """Each rank's report, its ``commit`` phase holding its time in the agreement: its wait for
    the last rank, by the ranks' clocks (the agreement gathers the phases, so no rank can time
    it before sending them), plus the collective's latency as this rank saw it (``took``, its
    own time in it, less its wait)."""
    last = max(arrived for _, _, arrived in gathered)
    latency = max(0.0, took - (last - gathered[rank][2]))
    return [
        (report, {**phases, "commit": phases["commit"] + max(0.0, last - arrived) + latency})
        for report, phases, arrived in gathered
    ]


def as_save_error(
    error: BaseException | None, step: int, rank: int, what: str = "writing"
) -> BaseException | None:
    """``error`` as a :class:`SaveError` naming the step and rank (its message names the
    file where the failure had one)."""
    if error is None:
        return None
    return as_error(SaveError, error, f"step {step}: rank {rank}: {what} failed")


def _entry(written: WrittenFile, role: str, rank: int) -> FileEntry:
    return FileEntry(
        path=written.path,
        bytes=written.bytes,
        checksum=written.checksum,
        role=role,
        rank=rank,
        digest=written.digest,
    )
