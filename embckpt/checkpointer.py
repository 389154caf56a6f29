"""``Checkpointer``: differential, sharded, pipelined checkpoints of a TorchRec model.

Pipeline of one ``save(step)`` (every rank calls it together):

1. wait     - the previous checkpoint's persist must be done (one in flight); its failure, if
              nobody saw it yet, is raised here;
2. decide   - fold the row trackers, combine dirty fractions and interval measurements over
              ranks, ask the policy (identical inputs everywhere, so an identical decision);
3. snapshot - take the tracker view the decision consumes, copy the dense state, and copy the
              rows to write (all, or the dirty rows) with their optimizer state into the staging
              arena. A checkpoint larger than the staging budget is staged and written piece by
              piece; only the last piece leaves the training thread. With ``pipeline="full"``
              the last piece's copy also runs in the background, and the next weight update
              (the fused backward, the dense optimizer step) waits for it;
4. persist  - in the background: encode and write Parquet files and the dense files, agree
              across ranks, rank 0 writes the manifest last, which commits the checkpoint;
5. account  - on success the manifest becomes the chain's head; on failure the taken tracker
              bits are given back, so the next checkpoint still writes those rows.

``save`` returns after step 3. Restores are in :mod:`embckpt.read.restore`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import torch
from torch import nn

from embckpt import dense
from embckpt.codecs import Codec, make_codec
from embckpt.collective import Collective
from embckpt.config import CheckpointConfig, codec_for
from embckpt.errors import ConfigError, SaveError
from embckpt.interval import AdaptiveInterval, IntervalMeasurements, IterationClock
from embckpt.policy import Decision, Kind, PolicyInput, bits_for_restores, make_policy
from embckpt.read.reader import default_threads
from embckpt.read.restore import RestoreResult, restore_checkpoint
from embckpt.read.target import RestoreTarget
from embckpt.save.guards import UpdateGuard
from embckpt.save.snapshot import StagedUnit, Unit, plan_pieces, plan_units, stage
from embckpt.save.staging import StagingArena
from embckpt.save.tables import table_entries
from embckpt.save.writer import RowFileWriter
from embckpt.sharding import ShardedModel, discover
from embckpt.storage.fs import MANIFEST_NAME, CheckpointStore, WrittenFile
from embckpt.storage.lock import DirectoryLock
from embckpt.storage.manifest import FileEntry, HistoryEntry, Manifest
from embckpt.storage.phases import PhaseClock
from embckpt.storage.retention import apply_retention, discard_newer
from embckpt.tracking import RowTracker, View

log = logging.getLogger(__name__)

DENSE_FILE = "dense/model.safetensors"


def rank_file(rank: int) -> str:
    return f"dense/rank_{rank:05d}.safetensors"


class PendingCheckpoint:
    """A save in progress. ``wait()`` returns its manifest (None if the policy skipped) or raises
    the error that stopped it; ``blocked_s`` is how long ``save`` held the training thread."""

    def __init__(self, step: int, future: concurrent.futures.Future[Manifest | None]) -> None:
        self.step = step
        self.blocked_s = 0.0
        self._future = future
        self.observed = False

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> Manifest | None:
        self.observed = True
        return self._future.result()


@dataclass
class _Snapshot:
    """Everything one checkpoint writes, staged; ``pending`` is the part the persist stages."""

    step: int
    decision: Decision
    dirty_fraction: float
    touched_fraction: float  # of all rows, touched since the previous checkpoint
    started: float
    taken: dict[View, list[torch.Tensor]]
    dense: dict[str, Any] | None
    rank: dict[str, Any]
    clock: PhaseClock
    pending: list[Unit] = field(default_factory=list)
    staged: list[StagedUnit] = field(default_factory=list)
    entries: list[FileEntry] = field(default_factory=list)
    error: BaseException | None = None


class Checkpointer:
    """Checkpoints a ``DistributedModelParallel`` model into ``directory``.

    All ranks construct it, and call ``save`` / ``maybe_save`` / ``restore``, together.

    Args:
        model: the DMP model.
        directory: local path or ``pyarrow.fs`` URI; created if missing.
        optimizer: the dense optimizer (a torch optimizer or TorchRec ``KeyedOptimizer``), or
            a ``CombinedOptimizer`` that also holds ``dmp.fused_optimizer`` (whose state is
            saved with the tables' rows either way).
        config: how to checkpoint; defaults to :class:`CheckpointConfig`'s defaults.
        statefuls: extra per-rank state saved with every checkpoint (data iterator, schedulers).
        filesystem: a configured ``pyarrow.fs.FileSystem`` (endpoint, retry strategy,
            credentials); ``directory`` is then the path inside it.

    Raises:
        ConfigError: the optimizer or a stateful cannot be saved and restored (the message says
            what to pass).
    """

    def __init__(
        self,
        model: nn.Module,
        directory: str | Path,
        *,
        optimizer: Any | None = None,
        config: CheckpointConfig | None = None,
        statefuls: Mapping[str, dense.Stateful] | None = None,
        filesystem: pafs.FileSystem | None = None,
    ) -> None:
        dense.optimizer_parts(optimizer, model)  # refuses what could not be saved or restored
        for name, obj in (statefuls or {}).items():
            if not (
                callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))
            ):
                raise ConfigError(
                    f"stateful {name!r}: a {type(obj).__name__} has no state_dict() and "
                    "load_state_dict(); pass objects that have both (e.g. ResumableSampler)"
                )
        self.model = model
        self.optimizer = optimizer
        self.config = config or CheckpointConfig()
        self.statefuls = dict(statefuls or {})
        self.comm = Collective()
        self.store = CheckpointStore(directory, fsync=self.config.fsync, filesystem=filesystem)
        self._lock = DirectoryLock(
            self.store.fs, self.store.root, self.store.is_local, self.config.lock_lease_s
        )
        error: BaseException | None = None
        if self.comm.rank == 0:
            try:
                self.store.create_root()
                if self._lock.acquire():
                    cleaned = self.store.clean_leftovers()
                    if cleaned:
                        log.info("removed leftovers of interrupted saves: steps %s", cleaned)
            except Exception as exc:  # raised on every rank below
                error = exc
        # The root exists and is ours before any rank lists it.
        self.comm.check(error, f"opening {self.store.uri}")
        self.sharded: ShardedModel = discover(model, self.comm.rank)
        self.tracker = RowTracker(model, self.sharded.shards, self.comm.group)
        self.policy = make_policy(self.config)
        self.codec: Codec = codec_for(self.config)
        self.restores = 0  # restores this job went through, carried from manifest to manifest
        self._follow_expected_restores()  # a codec without bits fails here, not at a save
        self.writer = RowFileWriter(
            self.store,
            state_codec=make_codec(self.config.optimizer_codec),
            base_codec=make_codec(self.config.base_codec),
            rank=self.comm.rank,
            row_group_rows=self.config.row_group_rows,
            threads=self.config.io_threads,
            track_chain=self.policy.mixes_diffs,
        )
        self.head: Manifest | None = None  # the last checkpoint of this run's chain
        device = (
            self.sharded.shards[0].weight.device if self.sharded.shards else torch.device("cpu")
        )
        self._arena = StagingArena(self.config.staging_budget_bytes, device)
        self._side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._persister = concurrent.futures.ThreadPoolExecutor(1, "embckpt-persist")
        self._inflight: PendingCheckpoint | None = None
        self._guard = UpdateGuard(model, optimizer) if self.config.pipeline == "full" else None
        self.interval = AdaptiveInterval(self.config.interval, self.config.stall_bound)
        self._clock = IterationClock()
        self._blocked_since_tick = 0.0
        self._last_blocked_s = 0.0
        self._next_step: int | None = None
        self._full_fp32_bytes = int(self.comm.all_sum([self.sharded.local_fp32_bytes()])[0])
        state_names: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        for names in self.comm.all_gather(self.sharded.state_names()):
            state_names.update(names)
        self._tables = table_entries(self.sharded, state_names)

    # -- when to save -------------------------------------------------------------------------
    def maybe_save(self, step: int) -> PendingCheckpoint | None:
        """Call once per iteration, after the optimizer step: saves when the interval says so.

        With ``config.adaptive_interval`` the interval is re-chosen at every checkpoint from
        measured costs so that checkpointing stays under ``config.stall_bound`` of training time.
        """
        busy = self._inflight is not None and not self._inflight.done()
        self._clock.tick(time.perf_counter(), busy, self._blocked_since_tick)
        self._blocked_since_tick = 0.0
        if self._next_step is None:
            self._next_step = step + self.interval.interval - 1
        if step < self._next_step:
            return None
        return self.save(step)

    # -- save ---------------------------------------------------------------------------------
    def save(self, step: int) -> PendingCheckpoint:
        """Checkpoints the model as of ``step`` (collective); returns once the state is staged.

        Raises:
            SaveError: the step is already committed; or the previous checkpoint's persist
                failed and that error was not yet seen through ``wait()`` (raised once).
        """
        started = time.perf_counter()
        self._finish_inflight()
        self._follow_expected_restores()
        decision, dirty = self._decide(step)
        future: concurrent.futures.Future[Manifest | None] = concurrent.futures.Future()
        handle = PendingCheckpoint(step, future)
        if decision.kind is Kind.SKIP:
            future.set_result(None)
            return handle
        clock = PhaseClock()
        self.store.clock = clock  # the store's writes report their write and fsync time to it
        snapshot = self._snapshot(step, decision, dirty, started, clock)
        mode = self.config.pipeline
        if mode == "off":
            _run_into(future, self._persist, snapshot)
            if future.exception() is not None:
                handle.observed = True
                future.result()
        else:
            if mode == "persist" and snapshot.pending:
                with clock.time("snapshot"):
                    snapshot.staged = self._stage_piece(snapshot.pending)
                snapshot.pending = []
            elif snapshot.pending and self._guard is not None:
                self._guard.hold()  # weight updates wait until the background copy is done
            self._persister.submit(_run_into, future, self._persist, snapshot)
        handle.blocked_s = time.perf_counter() - started
        self._blocked_since_tick += handle.blocked_s
        self._last_blocked_s = handle.blocked_s
        self._inflight = handle
        return handle

    def _follow_expected_restores(self) -> None:
        """Widens the codes once more restores happened than the job expected (a new codec only
        when the width changes, so codecs keep their caches)."""
        if self.config.expected_restores is None:
            return
        bits = bits_for_restores(self.config.expected_restores, self.restores)
        if getattr(self.codec, "bits", None) != bits:
            self.codec = codec_for(dataclasses.replace(self.config, bits=bits))

    def _finish_inflight(self) -> None:
        """Waits for the checkpoint in flight; raises its failure if nobody has seen it."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        try:
            inflight._future.result()
        except BaseException:
            if not inflight.observed:
                inflight.observed = True
                raise

    def _decide(self, step: int) -> tuple[Decision, dict[View, float]]:
        problem = self.comm.broadcast(
            self._prepare_step_folder(step) if self.comm.rank == 0 else None
        )
        if problem is not None:
            raise SaveError(problem)
        self.tracker.fold()
        self._mark_moving_replicated_tables()
        local = [0.0, 0.0, 0.0]
        for shard in self.sharded.writer_shards():
            local[0] += self.tracker.count(shard.key, View.SINCE_LAST) * shard.num_cols
            local[1] += self.tracker.count(shard.key, View.SINCE_FULL) * shard.num_cols
            local[2] += shard.num_rows * shard.num_cols
        since_last, since_full, total = self.comm.all_sum(local)
        measured = self._clock.collect(self._last_blocked_s)
        worst = self.comm.all_max(
            [measured.clean_iter_s, measured.busy_extra_s, measured.blocked_s]
        )
        if self.config.adaptive_interval and measured.iterations:
            clean, extra, blocked = worst
            self.interval.update(IntervalMeasurements(clean, extra, blocked, measured.iterations))
        self._next_step = step + self.interval.interval
        dirty = {
            View.SINCE_LAST: since_last / max(total, 1.0),
            View.SINCE_FULL: since_full / max(total, 1.0),
        }
        history = self.head.history if self.head is not None else ()
        decision = self.policy.decide(
            PolicyInput(
                step,
                dirty[View.SINCE_LAST],
                dirty[View.SINCE_FULL],
                history,
                None if self.head is None else _chain_bytes(self.head),
            )
        )
        if self.codec.delta and decision.kind is Kind.DIFF and not self.writer.reference.ready:
            # Deltas need the reconstruction of their base, which only a full written by this
            # process provides (not kept across a restart or a restore).
            decision = Decision(Kind.FULL, reason="delta codec: no reconstructed base yet")
        return decision, dirty

    def _mark_moving_replicated_tables(self) -> None:
        """Marks the rows of data-parallel tables that their dense optimizer moves without a
        lookup (non-zero momentum, or every row under weight decay): the lookups alone do not
        say which changed."""
        moving = dense.moving_rows(dense.optimizer_parts(self.optimizer, self.model))
        for shard in self.sharded.writer_shards():
            if shard.sharding_type != "data_parallel" or shard.weight.data_ptr() not in moving:
                continue
            rows = moving[shard.weight.data_ptr()]
            if rows is None:
                marked = torch.arange(shard.num_rows, device=shard.weight.device)
            else:
                marked = torch.nonzero(rows).flatten()
            for view in View:
                self.tracker.mark(shard.key, marked, view)

    def _prepare_step_folder(self, step: int) -> str | None:
        """Rank 0, before any rank writes: refuses a committed step and a step older than a
        committed one (the newer chain would stay "latest" and a later restore would silently
        skip this one), clears an interrupted one."""
        if self.store.is_committed(step):
            return (
                f"step {step}: {self.store.step_path(step, MANIFEST_NAME)} already exists; "
                "a committed checkpoint is never overwritten (to resume from an older step "
                "and drop the newer checkpoints, restore it with discard_newer=True)"
            )
        newer = [s for s in self.store.committed_steps() if s > step]
        if newer:
            return (
                f"step {step}: {self.store.uri} already holds newer checkpoints (steps "
                f"{', '.join(map(str, newer))}), which a restore would take over this one; to "
                "resume from an older step and drop them, restore it with discard_newer=True"
            )
        try:
            if step in self.store.leftover_steps():
                self.store.remove_step(step)  # debris of an interrupted save of this step
        except OSError as exc:
            return f"step {step}: cannot clear the leftover folder: {exc}"
        return None

    @torch.no_grad()
    def _snapshot(
        self,
        step: int,
        decision: Decision,
        dirty: dict[View, float],
        started: float,
        clock: PhaseClock,
    ) -> _Snapshot:
        selected = []
        for shard in self.sharded.writer_shards():
            if decision.kind is Kind.FULL:
                rows = torch.arange(shard.num_rows, device=shard.weight.device)
                selected.append((shard, rows, True))
            else:
                rows = self.tracker.dirty(shard.key, decision.view or View.SINCE_LAST)
                selected.append((shard, rows, False))
        taken = {View.SINCE_LAST: self.tracker.take(View.SINCE_LAST)}
        if decision.kind is Kind.FULL:
            taken[View.SINCE_FULL] = self.tracker.take(View.SINCE_FULL)
        dense_state = None
        with clock.time("snapshot"):
            if self.comm.rank == 0:
                dense_state = dense.detached_copy(
                    dense.dense_state(
                        self.model,
                        self.optimizer,
                        self.sharded.table_keys,
                        self.sharded.scalar_states,
                    )
                )
            rank_state = dense.detached_copy(dense.rank_state(self.statefuls))
        fraction = 1.0 if decision.kind is Kind.FULL else dirty[decision.view or View.SINCE_LAST]
        snapshot = _Snapshot(
            step=step,
            decision=decision,
            dirty_fraction=fraction,
            touched_fraction=dirty[View.SINCE_LAST],
            started=started,
            taken=taken,
            dense=dense_state,
            rank=rank_state,
            clock=clock,
        )
        units = plan_units(selected, self.config.max_file_rows, self.config.staging_budget_bytes)
        pieces = plan_pieces(units, self.config.staging_budget_bytes)
        # Pieces beyond the budget are staged and written now, on the training thread: the state
        # must stay as of this step until every piece is copied. Errors go to the persist, which
        # reports them on every rank.
        for piece in pieces[:-1]:
            if snapshot.error is None:
                try:
                    with clock.time("snapshot"):
                        staged = self._stage_piece(piece)
                    snapshot.entries.extend(
                        self.writer.write(step, staged, snapshot.decision, self.codec)
                    )
                except Exception as exc:
                    snapshot.error = exc
        snapshot.pending = pieces[-1]
        return snapshot

    def _stage_piece(self, piece: list[Unit]) -> list[StagedUnit]:
        staged = stage(piece, self._arena, self._side_stream)
        if self._side_stream is not None:
            self._side_stream.synchronize()
        return staged

    def _persist(self, snapshot: _Snapshot) -> Manifest:
        step = snapshot.step
        started = time.perf_counter()
        try:
            error = snapshot.error
            if error is None and snapshot.pending:
                try:
                    with snapshot.clock.time("snapshot"):
                        snapshot.staged = self._stage_piece(snapshot.pending)
                finally:
                    self._release_guard()
            if error is None:
                error = self._write_rest(snapshot)
            agreeing = time.perf_counter()
            self.comm.check(_as_save_error(error, step), f"saving step {step}")
            phases = snapshot.clock.seconds()  # commit: the agreement (the gather is not counted)
            phases["commit"] += time.perf_counter() - agreeing
            gathered = self.comm.all_gather((snapshot.entries, phases))
            entries = [e for rank_entries, _ in gathered for e in rank_entries]
            manifest = self._manifest(snapshot, entries, [phases for _, phases in gathered])
            error = None
            if self.comm.rank == 0:
                try:
                    self._lock.check_held()  # a job that lost the directory never commits
                    self.store.write_atomic(
                        self.store.step_path(step, MANIFEST_NAME), manifest.to_json().encode()
                    )
                    self._apply_retention(step)
                except Exception as exc:
                    error = exc
            self.comm.check(
                _as_save_error(error, step, "writing the manifest"), f"committing step {step}"
            )
        except BaseException:
            self._release_guard()
            for view, bits in snapshot.taken.items():
                self.tracker.give_back(view, bits)
            raise
        self.head = manifest.with_stats(persist_seconds=time.perf_counter() - started)
        return self.head

    def _apply_retention(self, step: int) -> None:
        """Rank 0, after the commit and before any rank returns from it: drop what is not kept."""
        if not self.config.keep_last:
            return
        try:
            apply_retention(self.store, self.config.keep_last)
        except OSError as exc:  # the checkpoint is committed; clean-up can wait for the next
            log.warning("retention after step %d failed: %s", step, exc)

    def _release_guard(self) -> None:
        if self._guard is not None:
            self._guard.release()

    def _write_rest(self, snapshot: _Snapshot) -> BaseException | None:
        """Writes the last piece's rows and the dense files; returns the error, if any."""
        step = snapshot.step
        clock = snapshot.clock
        try:
            snapshot.entries.extend(
                self.writer.write(step, snapshot.staged, snapshot.decision, self.codec)
            )
            # write_file's own time, less its write and fsync, is the file's checksum.
            if snapshot.dense is not None:
                with clock.time("encode"):
                    data = dense.encode_tree(snapshot.dense)
                with clock.time("hash"):
                    written = self.store.write_file(step, DENSE_FILE, data)
                snapshot.entries.append(_entry(written, "dense", self.comm.rank))
            with clock.time("encode"):
                data = dense.encode_tree(snapshot.rank)
            with clock.time("hash"):
                written = self.store.write_file(step, rank_file(self.comm.rank), data)
            snapshot.entries.append(_entry(written, "rank", self.comm.rank))
        except Exception as exc:
            return exc
        return None

    def _manifest(
        self, snapshot: _Snapshot, files: list[FileEntry], phases: list[dict[str, float]]
    ) -> Manifest:
        full = snapshot.decision.kind is Kind.FULL
        slowest = max(range(len(phases)), key=lambda r: sum(phases[r].values()))
        head = self.head
        total = sum(f.bytes for f in files)
        entry = HistoryEntry(
            snapshot.step, snapshot.decision.kind.value, total, snapshot.dirty_fraction
        )
        history = (entry,) if full or head is None else (*head.history, entry)
        return Manifest(
            step=snapshot.step,
            kind=snapshot.decision.kind.value,
            policy=self.policy.name,
            base_step=snapshot.step if full or head is None else head.base_step,
            parent_step=None if full or head is None else _parent(head, snapshot.decision),
            world_size=self.comm.world_size,
            codec=self.codec.get_config(),
            tables=self._tables,
            files=tuple(sorted(files, key=lambda f: f.path)),
            history=history,
            stats={
                "rows_written": sum(f.rows for f in files if f.role == "rows"),
                "dirty_fraction": snapshot.dirty_fraction,
                "touched_fraction": snapshot.touched_fraction,
                "full_fp32_bytes": self._full_fp32_bytes,
                "save_seconds": time.perf_counter() - snapshot.started,
                "phase_seconds": phases[slowest],
                "phase_rank": slowest,
                "reason": snapshot.decision.reason,
                "chain_bytes": total
                + (0 if full or head is None else _chain_bytes(head, snapshot.decision.view)),
                "restores": self.restores,
                "created_unix": time.time(),
            },
        )

    # -- restore ------------------------------------------------------------------------------
    def restore(self, step: int | None = None, *, discard_newer: bool = False) -> int | None:
        """Loads checkpoint ``step`` (the latest committed one if None) into the live model.

        Waits for a checkpoint in flight first. Resuming from a step older than the latest
        needs ``discard_newer=True``: the newer checkpoints are then moved aside (see
        :meth:`load`); without it a warning says so, and saving a step that is still committed
        fails.

        Returns:
            The restored step, the same on every rank; None on every rank if the directory
            holds no committed checkpoint.

        Raises:
            CheckpointCorruptError: a file of the chain is missing, truncated or altered
                (the message names it); nothing was loaded.
            ChainIncompleteError: a checkpoint the chain needs is not committed.
            ModelMismatchError: the model's tables differ from the checkpoint's.
            LeaseLostError: ``discard_newer`` while this job no longer holds the directory.
        """
        result = self.load(step, discard_newer=discard_newer)
        return None if result is None else result.manifest.step

    def load(
        self,
        step: int | None = None,
        *,
        threads: int | None = None,
        progress: bool | None = None,
        discard_newer: bool = False,
    ) -> RestoreResult | None:
        """:meth:`restore`, returning what was restored: the chain, the bytes read, the time
        taken and the state that could not be restored (see ``RestoreResult``).

        Args:
            step: the checkpoint; the latest committed one if None.
            threads: reader threads per rank (default: ``EMBCKPT_RESTORE_THREADS``, else the
                rank's share of the cores).
            progress: a progress bar on rank 0 (None: for large restores on a terminal).
            discard_newer: after a successful restore, rank 0 moves every committed checkpoint
                newer than the restored one to ``discarded/`` under the directory (manifest
                first: never a broken committed checkpoint; ``storage/retention.py``), so the
                job continues from here and ``restore()`` of the latest finds its new saves.

        Raises:
            LeaseLostError: ``discard_newer`` while this job no longer holds the directory
                (the restore itself is done); others as :meth:`restore`.
        """
        self._finish_inflight()
        target = RestoreTarget(
            model=self.model,
            optimizer=self.optimizer,
            sharded=self.sharded,
            statefuls=self.statefuls,
            comm=self.comm,
            store=self.store,
            threads=threads or default_threads(),
        )
        result = restore_checkpoint(target, step, progress=progress)
        self.writer.reference.clear()
        self._next_step = None
        if result is None:
            self.head = None
            return None
        # The restored rows that diffs changed are "changed since the full" for the next diff.
        self.tracker.reset()
        for key, local_rows in result.diff_rows:
            self.tracker.mark(key, local_rows, View.SINCE_FULL)
        self.head = result.manifest  # the next checkpoint continues this chain
        self.restores = int(result.manifest.stats.get("restores", 0)) + 1
        self._settle_newer(result.manifest.step, discard_newer)
        return result

    def _settle_newer(self, step: int, discard: bool) -> None:
        """Rank 0 moves checkpoints newer than the restored ``step`` aside, or warns that they
        are there; every rank raises if that failed."""
        error: BaseException | None = None
        if self.comm.rank == 0:
            try:
                newer = [s for s in self.store.committed_steps() if s > step]
                if newer and discard:
                    self._lock.check_held()
                    moved, into = discard_newer(self.store, step)
                    log.warning("resumed from step %d: moved steps %s to %s", step, moved, into)
                elif newer:
                    log.warning(
                        "restored step %d of %s, which also holds newer checkpoints %s: saving "
                        "one of those steps again will fail, and restore() of the latest would "
                        "skip this run's saves; restore with discard_newer=True to move them "
                        "aside",
                        step,
                        self.store.uri,
                        newer,
                    )
            except Exception as exc:  # raised on every rank below
                error = exc
        self.comm.check(error, f"moving checkpoints newer than step {step} aside")

    def close(self) -> None:
        """Finishes the checkpoint in flight (raising its failure if unseen), removes hooks."""
        try:
            self._finish_inflight()
        finally:
            self._persister.shutdown(wait=True)
            self.writer.close()
            self.tracker.close()
            if self._guard is not None:
                self._guard.close()
            self._lock.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _run_into(future: concurrent.futures.Future[Manifest | None], fn: Any, *args: Any) -> None:
    """Runs ``fn`` and settles ``future`` with its result or its exception."""
    try:
        future.set_result(fn(*args))
    except BaseException as exc:  # delivered through the future, raised on wait()/next save()
        future.set_exception(exc)


def _as_save_error(
    error: BaseException | None, step: int, what: str = "writing"
) -> BaseException | None:
    if error is None or isinstance(error, SaveError):
        return error
    wrapped = SaveError(f"step {step}: {what} failed: {error}")
    wrapped.__cause__ = error
    return wrapped


def _chain_bytes(head: Manifest, view: View | None = View.SINCE_LAST) -> int:
    """Bytes a restore reads for a diff after ``head`` seen as ``view``'s parent: the whole chain
    up to ``head`` (incremental), or its full alone (one-shot). Manifests without the figure
    count as one-shot chains (their full and themselves)."""
    full = head.history[0].bytes
    if view is View.SINCE_FULL:
        return full
    known = head.stats.get("chain_bytes")
    if isinstance(known, int):
        return known
    return full if head.kind == "full" else full + head.history[-1].bytes


def _parent(head: Manifest, decision: Decision) -> int:
    """One-shot diffs sit on the full checkpoint; incremental ones on the previous checkpoint."""
    return head.base_step if decision.view == View.SINCE_FULL else head.step


def _entry(written: WrittenFile, role: str, rank: int) -> FileEntry:
    return FileEntry(
        path=written.path, bytes=written.bytes, checksum=written.checksum, role=role, rank=rank
    )
