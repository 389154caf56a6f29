"""``Checkpointer``: differential, sharded checkpoints of a TorchRec model.

Pipeline of one ``save(step)`` (every rank calls it together):

1. decide   - fold the row trackers, sum dirty fractions over ranks, ask the policy
              (identical inputs on every rank, so an identical decision);
2. snapshot - copy the rows to write (all rows, or the dirty rows of the policy's view), their
              optimizer state and the dense state off the live model, and take the tracker
              view the decision consumes;
3. persist  - encode each block, write Parquet files and the dense files, report every file to
              all ranks; rank 0 writes the manifest last, which commits the checkpoint;
4. account  - on success record the manifest as the chain's head; on failure give the taken
              tracker bits back, so the next checkpoint still writes those rows.

Restores (``restore``) are in :mod:`embckpt.restore`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from embckpt import dense
from embckpt.codecs import Codec, codec_for, make_codec
from embckpt.codecs.base import dtype_name
from embckpt.collective import Collective
from embckpt.config import CheckpointConfig
from embckpt.errors import SaveError
from embckpt.policy import Decision, Kind, PolicyInput, make_policy
from embckpt.sharding import ShardedModel, TableShard, discover
from embckpt.storage.fs import MANIFEST_NAME, CheckpointStore
from embckpt.storage.manifest import FileEntry, HistoryEntry, Manifest, TableEntry
from embckpt.storage.shardfile import encode_file
from embckpt.tracking import RowTracker

log = logging.getLogger(__name__)

DENSE_FILE = "dense/model.safetensors"


def rank_file(rank: int) -> str:
    return f"dense/rank_{rank:05d}.safetensors"


class PendingCheckpoint:
    """A save in progress. ``wait()`` returns its manifest (None if the policy skipped) or raises
    the error that stopped it."""

    def __init__(self, step: int, future: concurrent.futures.Future[Manifest | None]) -> None:
        self.step = step
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> Manifest | None:
        return self._future.result()


@dataclass
class _BlockSnapshot:
    """A copy of the rows of one block that a checkpoint writes."""

    shard: TableShard
    local_rows: torch.Tensor
    weights: torch.Tensor
    row_states: dict[str, torch.Tensor]
    elem_states: dict[str, torch.Tensor]


@dataclass
class _Snapshot:
    step: int
    decision: Decision
    blocks: list[_BlockSnapshot]
    dense: dict[str, Any] | None
    rank: dict[str, Any]
    dirty_fraction: float
    started: float


class Checkpointer:
    """Checkpoints a ``DistributedModelParallel`` model into ``directory``.

    All ranks construct it, and call ``save`` and ``restore``, together.

    Args:
        model: the DMP model (a single-process sharded model works too).
        directory: local path or ``pyarrow.fs`` URI; created if missing.
        optimizer: the dense optimizer (the fused embedding optimizer is found on the model).
        config: how to checkpoint; defaults to :class:`CheckpointConfig`'s defaults.
        statefuls: extra per-rank state saved with every checkpoint (data iterator, schedulers).
    """

    def __init__(
        self,
        model: nn.Module,
        directory: str | Path,
        *,
        optimizer: Any | None = None,
        config: CheckpointConfig | None = None,
        statefuls: Mapping[str, dense.Stateful] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.config = config or CheckpointConfig()
        self.statefuls = dict(statefuls or {})
        self.comm = Collective()
        self.store = CheckpointStore(directory, fsync=self.config.fsync)
        if self.comm.rank == 0:
            self.store.create_root()
        self.comm.broadcast(None)  # the root exists before any rank lists it
        self.sharded: ShardedModel = discover(model, self.comm.rank)
        self.tracker = RowTracker(model, self.sharded.shards, self.comm.group)
        self.policy = make_policy(self.config)
        self.codec: Codec = codec_for(self.config)
        self.state_codec: Codec = make_codec(self.config.optimizer_codec)
        self.head: Manifest | None = None  # the last checkpoint of this run's chain

    # -- save -------------------------------------------------------------------------------
    def save(self, step: int) -> PendingCheckpoint:
        """Checkpoints the model as of ``step`` (collective).

        Returns:
            A handle; this version persists synchronously, so it is already done.

        Raises:
            SaveError: the step is already committed, or writing failed on some rank; the
                previous checkpoint stays restorable.
        """
        future: concurrent.futures.Future[Manifest | None] = concurrent.futures.Future()
        started = time.perf_counter()
        decision, dirty = self._decide(step)
        if decision.kind is Kind.SKIP:
            future.set_result(None)
            return PendingCheckpoint(step, future)
        snapshot, taken = self._snapshot(step, decision, dirty, started)
        try:
            manifest = self._persist(snapshot)
        except BaseException:
            self.tracker.give_back("since_last", taken["since_last"])
            if "since_full" in taken:
                self.tracker.give_back("since_full", taken["since_full"])
            raise
        self.head = manifest
        future.set_result(manifest)
        return PendingCheckpoint(step, future)

    def _decide(self, step: int) -> tuple[Decision, dict[str, float]]:
        committed = self.comm.broadcast(
            self.store.is_committed(step) if self.comm.rank == 0 else None
        )
        if committed:
            raise SaveError(
                f"step {step}: {self.store.step_path(step, MANIFEST_NAME)} already exists; "
                "a committed checkpoint is never overwritten"
            )
        self.tracker.fold()
        local = [0.0, 0.0, 0.0]
        for shard in self.sharded.writer_shards():
            local[0] += self.tracker.count(shard.key, "since_last") * shard.num_cols
            local[1] += self.tracker.count(shard.key, "since_full") * shard.num_cols
            local[2] += shard.num_rows * shard.num_cols
        since_last, since_full, total = self.comm.all_sum(local)
        dirty = {
            "since_last": since_last / max(total, 1.0),
            "since_full": since_full / max(total, 1.0),
        }
        history = self.head.history if self.head is not None else ()
        decision = self.policy.decide(
            PolicyInput(step, dirty["since_last"], dirty["since_full"], history)
        )
        return decision, dirty

    @torch.no_grad()
    def _snapshot(
        self, step: int, decision: Decision, dirty: dict[str, float], started: float
    ) -> tuple[_Snapshot, dict[str, list[torch.Tensor]]]:
        blocks = []
        for shard in self.sharded.writer_shards():
            if decision.kind is Kind.FULL:
                rows = torch.arange(shard.num_rows, device=shard.weight.device)
            else:
                rows = self.tracker.dirty(shard.key, decision.view or "since_last")
            blocks.append(
                _BlockSnapshot(
                    shard=shard,
                    local_rows=rows.cpu(),
                    weights=shard.weight.index_select(0, rows).cpu(),
                    row_states={
                        n: t.index_select(0, rows).cpu() for n, t in shard.row_states.items()
                    },
                    elem_states={
                        n: t.index_select(0, rows).cpu() for n, t in shard.elem_states.items()
                    },
                )
            )
        dense_state = None
        if self.comm.rank == 0:
            dense_state = _detached_copy(
                dense.dense_state(
                    self.model, self.optimizer, self.sharded.table_keys, self.sharded.scalar_states
                )
            )
        taken = {"since_last": self.tracker.take("since_last")}
        if decision.kind is Kind.FULL:
            taken["since_full"] = self.tracker.take("since_full")
        fraction = 1.0 if decision.kind is Kind.FULL else dirty[decision.view or "since_last"]
        snapshot = _Snapshot(
            step=step,
            decision=decision,
            blocks=blocks,
            dense=dense_state,
            rank=_detached_copy(dense.rank_state(self.statefuls)),
            dirty_fraction=fraction,
            started=started,
        )
        return snapshot, taken

    def _persist(self, snapshot: _Snapshot) -> Manifest:
        step = snapshot.step
        entries: list[FileEntry] = []
        error: BaseException | None = None
        try:
            if self.comm.rank == 0 and step in self.store.leftover_steps():
                self.store.remove_step(step)  # debris of an interrupted save of this step
        except Exception as exc:  # reported collectively below
            error = exc
        self.comm.check(error, f"cleaning step {step}")
        try:
            for block in snapshot.blocks:
                entries.extend(self._write_block(step, block))
            if snapshot.dense is not None:
                written = self.store.write_file(step, DENSE_FILE, dense.encode_tree(snapshot.dense))
                entries.append(_entry(written, "dense", self.comm.rank))
            written = self.store.write_file(
                step, rank_file(self.comm.rank), dense.encode_tree(snapshot.rank)
            )
            entries.append(_entry(written, "rank", self.comm.rank))
        except Exception as exc:
            error = SaveError(f"step {step}: writing failed: {exc}")
            error.__cause__ = exc
        self.comm.check(error, f"saving step {step}")
        all_entries = [e for rank_entries in self.comm.all_gather(entries) for e in rank_entries]
        manifest = self._manifest(snapshot, all_entries)
        error = None
        if self.comm.rank == 0:
            try:
                self.store.write_atomic(
                    self.store.step_path(step, MANIFEST_NAME), manifest.to_json().encode()
                )
            except Exception as exc:
                error = SaveError(f"step {step}: writing the manifest failed: {exc}")
                error.__cause__ = exc
        self.comm.check(error, f"committing step {step}")
        return manifest

    def _write_block(self, step: int, block: _BlockSnapshot) -> list[FileEntry]:
        shard = block.shard
        entries = []
        global_rows = (block.local_rows + shard.row_offset).numpy()
        limit = self.config.max_file_rows
        for part, lo in enumerate(range(0, len(global_rows), limit)):
            hi = lo + limit
            data = encode_file(
                rows=global_rows[lo:hi],
                encoded=self.codec.encode(block.weights[lo:hi]),
                row_states={n: t[lo:hi].numpy() for n, t in block.row_states.items()},
                elem_states={
                    n: self.state_codec.encode(t[lo:hi]) for n, t in block.elem_states.items()
                },
                metadata={
                    "table": shard.table,
                    "row_offset": shard.row_offset,
                    "col_offset": shard.col_offset,
                    "cols": shard.num_cols,
                    "codec": self.codec.get_config(),
                    "state_codec": self.state_codec.get_config(),
                },
                row_group_rows=self.config.row_group_rows,
            )
            relative = (
                f"tables/{shard.table}/r{shard.row_offset}_c{shard.col_offset}.p{part}.parquet"
            )
            written = self.store.write_file(step, relative, data)
            entries.append(
                FileEntry(
                    path=written.path,
                    bytes=written.bytes,
                    sha256=written.sha256,
                    role="rows",
                    rank=self.comm.rank,
                    table=shard.table,
                    row_offset=shard.row_offset,
                    col_offset=shard.col_offset,
                    shard_rows=shard.num_rows,
                    shard_cols=shard.num_cols,
                    rows=int(min(hi, len(global_rows)) - lo),
                )
            )
        return entries

    def _manifest(self, snapshot: _Snapshot, files: list[FileEntry]) -> Manifest:
        full = snapshot.decision.kind is Kind.FULL
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
            tables=self._table_entries(),
            files=tuple(sorted(files, key=lambda f: f.path)),
            history=history,
            stats={
                "rows_written": sum(f.rows for f in files if f.role == "rows"),
                "dirty_fraction": snapshot.dirty_fraction,
                "full_fp32_bytes": self._full_fp32_bytes(),
                "save_seconds": time.perf_counter() - snapshot.started,
                "reason": snapshot.decision.reason,
                "created_unix": time.time(),
            },
        )

    def _table_entries(self) -> tuple[TableEntry, ...]:
        tables = []
        example = {s.table: s for s in self.sharded.shards}
        for name, (rows, cols) in sorted(self.sharded.table_shapes.items()):
            shard = example.get(name)
            tables.append(
                TableEntry(
                    name=name,
                    rows=rows,
                    cols=cols,
                    dtype=dtype_name(self.sharded.table_dtypes[name]),
                    sharding_type=self.sharded.sharding_types[name],
                    row_states=tuple(sorted(shard.row_states)) if shard else (),
                    elem_states=tuple(sorted(shard.elem_states)) if shard else (),
                    shards=tuple(self.sharded.placements[name]),
                )
            )
        return tuple(tables)

    def _full_fp32_bytes(self) -> int:
        """What one uncompressed fp32 checkpoint of every table and its optimizer state takes."""
        local = 0.0
        for shard in self.sharded.writer_shards():
            per_row = shard.num_cols * (1 + len(shard.elem_states)) + len(shard.row_states)
            local += 4.0 * shard.num_rows * per_row
        return int(self.comm.all_sum([local])[0])

    # -- restore ----------------------------------------------------------------------------
    def restore(self, step: int | None = None) -> int | None:
        """Loads checkpoint ``step`` (the latest committed one if None) into the live model.

        Returns:
            The restored step, the same on every rank; None on every rank if the directory
            holds no committed checkpoint.

        Raises:
            CheckpointCorruptError: a file of the chain is missing, truncated or altered
                (the message names it); nothing was loaded.
            ChainIncompleteError: a checkpoint the chain needs is not committed.
            ModelMismatchError: the model's tables differ from the checkpoint's.
        """
        from embckpt.restore import restore_into

        manifest = restore_into(self, step)
        self.head = manifest
        return None if manifest is None else manifest.step

    def close(self) -> None:
        """Removes the tracking hooks. Call after the last save."""
        self.tracker.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parent(head: Manifest, decision: Decision) -> int:
    """One-shot diffs sit on the full checkpoint; incremental ones on the previous checkpoint."""
    return head.base_step if decision.view == "since_full" else head.step


def _entry(written: Any, role: str, rank: int) -> FileEntry:
    return FileEntry(
        path=written.path, bytes=written.bytes, sha256=written.sha256, role=role, rank=rank
    )


def _detached_copy(tree: Any) -> Any:
    """A copy of every tensor in a state tree, so training may go on changing the originals."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, np.ndarray):
        return tree.copy()
    if isinstance(tree, Mapping):
        return {k: _detached_copy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_detached_copy(v) for v in tree)
    return tree
