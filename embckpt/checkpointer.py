"""``Checkpointer``: differential, sharded, pipelined checkpoints of a TorchRec model.

The façade: it builds the pieces and wires the two flows. Saves are in :mod:`embckpt.save.saver`
(each one a transaction, :mod:`embckpt.save.transaction`); restores in
:mod:`embckpt.read.restore`, after which the saver's state is reset to the restored chain.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import torch
from torch import nn

from embckpt import dense
from embckpt.codecs import Codec, make_codec
from embckpt.collective import Collective
from embckpt.config import CheckpointConfig, state_codec_name
from embckpt.cores import writer_threads
from embckpt.errors import ConfigError
from embckpt.interval import AdaptiveInterval, IterationClock
from embckpt.mch import MchTable, watch_evictions
from embckpt.policy import make_policy
from embckpt.read.restore import RestoreResult, restore_checkpoint
from embckpt.read.stage import asked_threads
from embckpt.read.target import RestoreTarget
from embckpt.save.capture import WriterReconstruction
from embckpt.save.context import SaveContext
from embckpt.save.pending import PendingCheckpoint
from embckpt.save.saver import Saver
from embckpt.save.tables import table_entries
from embckpt.save.transaction import SaveState
from embckpt.save.writer import RowFileWriter
from embckpt.sharding import ShardedModel, check_kernels, check_placeable, discover
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.lock import DirectoryLock
from embckpt.storage.manifest import Manifest
from embckpt.storage.retention import discard_newer
from embckpt.storage.signing import SigningKey, load_verify_keys
from embckpt.tiers.save import open_tiers
from embckpt.tracking import RowTracker, View

__all__ = ["Checkpointer", "PendingCheckpoint"]

log = logging.getLogger(__name__)


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
        verify_key: public keys (PEM file paths, PEM bytes or ``Ed25519PublicKey``; one or a
            list, for rotation): a restore reads only checkpoints signed by one of them, every
            file checked against its SHA-256 digest (``storage/signing.py``).

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
        verify_key: Any = None,
    ) -> None:
        dense.optimizer_parts(optimizer, model)  # refuses what could not be saved or restored
        check_placeable(model)  # refuses sharded state that is no table's
        check_kernels(model)  # and tables on kernels it cannot checkpoint exactly
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
        self.config = config = config or CheckpointConfig()
        self.statefuls = dict(statefuls or {})
        self.comm = Collective()
        self.store = CheckpointStore(
            directory,
            fsync=config.fsync,
            filesystem=filesystem,
            write_retries=config.write_retries,
            retry_backoff_s=config.retry_backoff_s,
            digests=config.signing_key is not None,
            verify_keys=load_verify_keys(verify_key),
        )
        self._signing_key = None if config.signing_key is None else SigningKey(config.signing_key)
        self._lock = DirectoryLock(
            self.store.fs, self.store.root, self.store.is_local, config.lock_lease_s
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
        sharded: ShardedModel | None = None
        mine: tuple[dict[str, tuple[tuple[str, ...], tuple[str, ...]]], float] = ({}, 0.0)
        try:
            sharded = discover(model, self.comm.rank)
            mine = (sharded.state_names(), sharded.local_fp32_bytes())
        except Exception as exc:  # raised on every rank below, not left to hang the others
            error = error or exc
        # The root exists and is ours before any rank lists it; the same collective gathers
        # every rank's state names and fp32 bytes.
        try:
            gathered = self.comm.gather_checked(mine, error, f"opening {self.store.uri}")
        except BaseException:  # nothing opened stays held: the lock, the gloo group
            self._lock.release()
            self.comm.close()
            raise
        assert sharded is not None  # discovered, or every rank raised
        self.sharded: ShardedModel = sharded
        self.tiers = open_tiers(config, self.comm, self.store, self._lock)
        save_store = self.store if self.tiers is None else self.tiers.local.own
        save_store.digests = self.store.digests
        every_row = self.sharded.every_row_blocks()
        if every_row:
            log.info(
                "blocks %s: every checkpoint writes all their rows: their fused optimizer "
                "rewrites every row, looked up or not (%s)",
                sorted(every_row),
                "; ".join(sorted(set(every_row.values()))),
            )
        self.tracker = RowTracker(model, self.sharded.shards, self.comm.group)
        self._unwatch = watch_evictions(self.sharded.mch, self._evicted)
        self.policy = make_policy(config)
        self.interval = AdaptiveInterval(config.interval, config.stall_bound)
        self.writer = RowFileWriter(
            save_store,
            state_codec=make_codec(state_codec_name(config)),
            base_codec=make_codec(config.base_codec),
            rank=self.comm.rank,
            row_group_rows=config.row_group_rows,
            threads=writer_threads(config.io_threads),
        )
        state_names: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        for names, _ in gathered:
            state_names.update(names)
        context = SaveContext(
            model=model,
            optimizer=optimizer,
            statefuls=self.statefuls,
            config=config,
            comm=self.comm,
            store=save_store,
            lock=self._lock,
            sharded=self.sharded,
            policy=self.policy,
            tables=table_entries(self.sharded, state_names),
            full_fp32_bytes=int(sum(fp32_bytes for _, fp32_bytes in gathered)),
            tiers=self.tiers,
            signing_key=self._signing_key,
        )
        self._state = SaveState(
            tracker=self.tracker,
            reference=self.writer.reference,
            interval=self.interval,
            clock=IterationClock(),
        )
        self._saver = Saver(context, self._state, self.writer)

    def _evicted(self, table: MchTable, local_rows: torch.Tensor) -> None:
        """Rows an eviction re-initialised without a lookup: the next checkpoints write them."""
        for shard in self.sharded.shards:
            if (
                shard.name == table.table
                and (not table.owner or shard.fqn.startswith(f"{table.owner}."))
                and shard.row_offset == table.row_offset
            ):
                for view in View:
                    self.tracker.mark(shard.key, local_rows, view)

    @property
    def head(self) -> Manifest | None:
        """The last committed checkpoint of this run's chain (None before the first)."""
        return self._state.head

    @property
    def codec(self) -> Codec:
        """The row codec the next checkpoint uses."""
        return self._saver.codec

    @property
    def restores(self) -> int:
        """Restores this job went through (carried from manifest to manifest)."""
        return self._saver.restores

    # -- save ---------------------------------------------------------------------------------
    def maybe_save(self, step: int) -> PendingCheckpoint | None:
        """Call once per iteration, after the optimizer step: saves when the interval says so.

        With ``config.adaptive_interval`` the interval is re-chosen at every checkpoint from
        measured costs so that checkpointing stays under ``config.stall_bound`` of training time.
        A failed save puts the schedule back: the next call tries again.
        """
        return self._saver.maybe_save(step)

    def save(self, step: int) -> PendingCheckpoint:
        """Checkpoints the model as of ``step`` (collective); returns once the state is staged.

        A save is a transaction: if it fails on any rank, in any phase, every rank raises
        (``SaveError``; ``SaveRankError`` on the ranks whose own part went well) and nothing
        that a later save or restore reads has changed (see ``save/transaction.py``).

        Raises:
            SaveError: the step is already committed; or the previous checkpoint's persist
                failed and that error was not yet seen through ``wait()`` (raised once); with
                ``pipeline="off"``, this save failed.
        """
        return self._saver.save(step)

    # -- the writer's reconstruction (debug) ---------------------------------------------------
    def track_reconstruction(self) -> None:
        """Debug: from now on, keep what a restore of the latest committed checkpoint gives for
        this rank's blocks (known after the next full checkpoint or restore). Costs an fp32
        copy of the rank's blocks and a decode of every row written; for tests."""
        self._saver.finish_inflight()
        if self._state.reconstruction is None:
            self._state.reconstruction = WriterReconstruction()

    def reconstruction(self) -> dict[str, dict[str, torch.Tensor]]:
        """Debug: per block key (``TableShard.key``) of this rank's writer blocks, the fp32
        ``weight``, ``row:<state>`` and ``elem:<state>`` values that a restore of the latest
        committed checkpoint gives, as the writer meant them (see :meth:`track_reconstruction`;
        ``save/capture.py``). Resolves the save in flight first.

        Raises:
            RuntimeError: not tracked, or not known yet.
        """
        self._saver.finish_inflight()
        if self._state.reconstruction is None:
            raise RuntimeError("call track_reconstruction() first")
        return self._state.reconstruction.blocks()

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
            RestoreError: any other failure, on any rank (``RestoreRankError`` on the ranks
                whose own part went well). The next save is then a full checkpoint.
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
                rank's share of the cores plus those the ranks of its host leave idle while it
                restores more than they do, ``cores.balanced_restore_threads``).
            progress: a progress bar on rank 0 (None: for large restores on a terminal).
            discard_newer: after a successful restore, rank 0 moves every committed checkpoint
                newer than the restored one to ``discarded/`` under the directory (manifest
                first: never a broken committed checkpoint; ``storage/retention.py``), so the
                job continues from here and ``restore()`` of the latest finds its new saves.
                With a node-local tier, each node's leader also deletes its newer local and
                replica checkpoints.

        Raises:
            LeaseLostError: ``discard_newer`` while this job no longer holds the directory
                (the restore itself is done); others as :meth:`restore`.
        """
        self._saver.finish_inflight()
        target = RestoreTarget(
            model=self.model,
            optimizer=self.optimizer,
            sharded=self.sharded,
            statefuls=self.statefuls,
            comm=self.comm,
            store=self.store,
            threads=threads or asked_threads(),
        )
        try:
            if self.tiers is None:
                result = restore_checkpoint(target, step, progress=progress)
            else:
                result = self.tiers.restore(target, step, progress=progress)
        except BaseException:
            self._saver.restore_failed()
            raise
        if result is None:
            self._saver.restored(None)
        else:
            self._saver.restored(result.manifest, result.diff_rows)
        if result is not None and result.partial is not None:
            self._saver.restore_failed()  # no chain holds this mix of steps: the next is a full
        if result is not None:
            if step is not None or self.tiers is not None:
                # Without a step, the restore took the newest committed one: nothing newer to
                # move or warn of (only the job holding the directory commits), so no listing
                # and no collective.
                self._settle_newer(result.manifest.step, discard_newer)
            if self.tiers is not None:
                self.tiers.settle_newer(result.manifest.step, discard_newer)
        return result

    def _settle_newer(self, step: int, discard: bool) -> None:
        """Rank 0 moves checkpoints newer than the restored ``step`` aside, or warns that they
        are there; every rank raises if that failed."""
        error: BaseException | None = None
        if self.comm.rank == 0:
            try:
                newer = self.store.committed_after(step)
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
            self._saver.close()
        finally:
            self._unwatch()
            self.tracker.close()
            self._lock.release()
            self.comm.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
