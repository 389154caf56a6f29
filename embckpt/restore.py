"""Restore: read a checkpoint chain and load it into the live, sharded model.

Stages (every rank, together):

1. choose   - rank 0 lists committed steps and broadcasts the one to restore;
2. chain    - read the manifests from the target back through its parents to the full base,
              checking each manifest's own checksum;
3. match    - the model's tables (names, shapes, dtypes) must equal the checkpoint's;
4. stage    - each rank reads only the files whose row/column block overlaps one of its own
              blocks, checks size and SHA-256 before parsing, keeps only the overlapping rows
              (Parquet row-group statistics prune the rest) and decodes them;
5. agree    - ranks exchange success; any failure raises on every rank before anything is
              loaded, so a failed restore never leaves a half-loaded model;
6. apply    - write the staged rows in chain order (later diffs overwrite earlier rows), then
              the dense state, RNG and stateful objects; rebuild the trackers' since-full view
              from the rows the chain's diffs changed.

Because rows are addressed by global row id and column offset, this also restores onto another
world size or sharding plan.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from embckpt import dense
from embckpt.codecs import codec_from_config
from embckpt.codecs.base import dtype_name
from embckpt.errors import ChainIncompleteError, CheckpointCorruptError, ModelMismatchError
from embckpt.sharding import TableShard
from embckpt.storage.fs import MANIFEST_NAME, CheckpointStore
from embckpt.storage.manifest import Manifest
from embckpt.storage.shardfile import decode_file

if TYPE_CHECKING:
    from embckpt.checkpointer import Checkpointer

log = logging.getLogger(__name__)


def read_manifest(store: CheckpointStore, step: int) -> Manifest:
    """Reads and checks one committed manifest.

    Raises:
        ChainIncompleteError: the step has no manifest.
        CheckpointCorruptError: the manifest is damaged.
    """
    path = store.step_path(step, MANIFEST_NAME)
    if not store.is_committed(step):
        raise ChainIncompleteError(path, f"checkpoint of step {step} is not committed")
    manifest = Manifest.from_json(store.read_file(step, MANIFEST_NAME).to_pybytes().decode(), path)
    if manifest.step != step:
        raise CheckpointCorruptError(path, f"manifest says step {manifest.step}, folder {step}")
    return manifest


def read_chain(store: CheckpointStore, step: int) -> list[Manifest]:
    """The manifests a restore of ``step`` needs, base (full) first.

    Raises:
        ChainIncompleteError: a parent is missing; names its manifest path.
    """
    chain = [read_manifest(store, step)]
    while chain[-1].parent_step is not None:
        parent = chain[-1].parent_step
        if parent in {m.step for m in chain} or parent >= chain[-1].step:
            raise CheckpointCorruptError(
                store.step_path(chain[-1].step, MANIFEST_NAME), f"parent step {parent} is not older"
            )
        try:
            chain.append(read_manifest(store, parent))
        except ChainIncompleteError as exc:
            raise ChainIncompleteError(
                exc.path,
                f"needed by step {step} (chain from base {chain[-1].base_step}) but not committed",
            ) from None
    if chain[-1].kind != "full":
        raise ChainIncompleteError(
            store.step_path(chain[-1].step, MANIFEST_NAME),
            "chain does not start at a full checkpoint",
        )
    return chain[::-1]


def check_model_matches(ckpt: Checkpointer, manifest: Manifest, path: str) -> None:
    """Raises ModelMismatchError naming the first table that differs."""
    model_tables = ckpt.sharded.table_shapes
    saved = {t.name: t for t in manifest.tables}
    for name in sorted(set(model_tables) | set(saved)):
        if name not in saved:
            raise ModelMismatchError(f"table {name}: in the model but not in checkpoint {path}")
        if name not in model_tables:
            raise ModelMismatchError(f"table {name}: in checkpoint {path} but not in the model")
        entry = saved[name]
        if (entry.rows, entry.cols) != model_tables[name]:
            raise ModelMismatchError(
                f"table {name}: checkpoint {path} has shape {(entry.rows, entry.cols)}, "
                f"the model {model_tables[name]}"
            )
        model_dtype = dtype_name(ckpt.sharded.table_dtypes[name])
        if entry.dtype != model_dtype:
            raise ModelMismatchError(
                f"table {name}: checkpoint {path} has dtype {entry.dtype}, the model {model_dtype}"
            )


@dataclass
class _Staged:
    """Decoded rows of one file for one local block, ready to write."""

    shard: TableShard
    local_rows: torch.Tensor
    col_lo: int
    col_hi: int
    weights: torch.Tensor
    row_states: dict[str, torch.Tensor]
    elem_states: dict[str, torch.Tensor]
    from_diff: bool


def _stage_rows(ckpt: Checkpointer, chain: list[Manifest]) -> list[_Staged]:
    staged: list[_Staged] = []
    for manifest in chain:
        cache: dict[str, Any] = {}
        for shard in ckpt.sharded.shards:
            row_lo, row_hi = shard.row_offset, shard.row_offset + shard.num_rows
            col_lo, col_hi = shard.col_offset, shard.col_offset + shard.num_cols
            for entry in manifest.files:
                if entry.role != "rows" or entry.table != shard.table:
                    continue
                if not entry.overlaps(row_lo, row_hi, col_lo, col_hi):
                    continue
                if entry.path not in cache:
                    cache[entry.path] = ckpt.store.read_checked(manifest.step, entry.written)
                path = ckpt.store.step_path(manifest.step, entry.path)
                block = decode_file(cache[entry.path], path, row_lo, row_hi)
                codec = codec_from_config(block.metadata["codec"])
                state_codec = codec_from_config(block.metadata["state_codec"])
                weights = codec.decode(block.encoded, entry.shard_cols)
                # The overlap of the file's columns with this block's, in file coordinates.
                lo, hi = (
                    max(col_lo, entry.col_offset),
                    min(col_hi, entry.col_offset + entry.shard_cols),
                )
                a, b = lo - entry.col_offset, hi - entry.col_offset
                staged.append(
                    _Staged(
                        shard=shard,
                        local_rows=torch.from_numpy(block.rows - row_lo),
                        col_lo=lo,
                        col_hi=hi,
                        weights=weights[:, a:b],
                        row_states={
                            n: torch.from_numpy(np.array(v, copy=True))
                            for n, v in block.row_states.items()
                        },
                        elem_states={
                            n: state_codec.decode(s, entry.shard_cols)[:, a:b]
                            for n, s in block.elem_states.items()
                        },
                        from_diff=manifest.kind == "diff",
                    )
                )
    return staged


@torch.no_grad()
def _apply(ckpt: Checkpointer, staged: list[_Staged]) -> None:
    for piece in staged:
        shard = piece.shard
        shard.write_rows(piece.local_rows, piece.weights, piece.col_lo, piece.col_hi)
        for name, values in piece.elem_states.items():
            if name in shard.elem_states:
                shard.write_rows(
                    piece.local_rows, values, piece.col_lo, piece.col_hi, shard.elem_states[name]
                )
        for name, values in piece.row_states.items():
            if name in shard.row_states:
                target = shard.row_states[name]
                target.index_copy_(0, piece.local_rows.to(target.device), values.to(target))


def restore_into(ckpt: Checkpointer, step: int | None) -> Manifest | None:
    """Restores checkpoint ``step`` (latest if None) into ``ckpt``'s model; see module doc."""
    comm, store = ckpt.comm, ckpt.store
    choice: tuple[int | None, str | None] = (None, None)
    if comm.rank == 0:
        committed = store.committed_steps()
        if step is None:
            choice = (committed[-1] if committed else None, None)
        elif step in committed:
            choice = (step, None)
        else:
            choice = (None, f"no committed checkpoint of step {step} in {store.uri}")
    target, missing = comm.broadcast(choice)
    if missing is not None:
        raise ChainIncompleteError(store.step_path(int(step or 0), MANIFEST_NAME), missing)
    if target is None:
        return None

    error: BaseException | None = None
    chain: list[Manifest] = []
    staged: list[_Staged] = []
    dense_state = rank_state = None
    try:
        chain = read_chain(store, target)
        check_model_matches(ckpt, chain[-1], store.step_path(target))
        staged = _stage_rows(ckpt, chain)
        head = chain[-1]
        dense_entry = next(f for f in head.files if f.role == "dense")
        dense_state = dense.decode_tree(
            store.read_checked(target, dense_entry.written).to_pybytes()
        )
        if head.world_size == comm.world_size:
            own = next(f for f in head.files if f.role == "rank" and f.rank == comm.rank)
            rank_state = dense.decode_tree(store.read_checked(target, own.written).to_pybytes())
        else:
            log.warning(
                "step %d was written by %d ranks, restoring onto %d: RNG and per-rank state "
                "(data position) are not restored",
                target,
                head.world_size,
                comm.world_size,
            )
    except Exception as exc:  # gathered below so that every rank raises
        error = exc
    comm.check(error, f"restoring step {target}")

    _apply(ckpt, staged)
    assert dense_state is not None  # read above, or every rank raised
    dense.apply_dense_state(dense_state, ckpt.model, ckpt.optimizer, ckpt.sharded.scalar_states)
    if rank_state is not None:
        dense.apply_rank_state(rank_state, ckpt.statefuls)
    ckpt.tracker.reset()
    for piece in staged:
        if piece.from_diff:
            ckpt.tracker.mark(piece.shard.key, piece.local_rows, "since_full")
    return chain[-1]
