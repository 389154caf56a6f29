"""The non-table part of a restore: the dense model and optimizer state, RNG streams and
stateful objects. Read and checked with the rows (before anything is loaded), applied by
:func:`embckpt.read.restore.restore_checkpoint` before the rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from embckpt import dense
from embckpt.errors import CheckpointCorruptError, EmbckptError, ModelMismatchError
from embckpt.read.reader import ReadCost
from embckpt.read.target import RestoreTarget
from embckpt.storage.fs import MANIFEST_NAME
from embckpt.storage.manifest import Manifest


@dataclass
class SideState:
    """The non-table part of a restore: what to load, and what will not be."""

    dense: dict[str, Any]
    rank: dict[str, Any] | None = None  # this rank's own file, same world size
    statefuls: dict[str, Any] = field(default_factory=dict)  # other world size: from rank 0
    skipped: list[str] = field(default_factory=list)


def read_side_state(into: RestoreTarget, head: Manifest, cost: ReadCost) -> SideState:
    store, comm = into.store, into.comm
    manifest_path = store.step_path(head.step, MANIFEST_NAME)
    dense_entry = next((f for f in head.files if f.role == "dense"), None)
    if dense_entry is None:
        raise CheckpointCorruptError(manifest_path, "lists no dense file")
    raw = store.read_checked(head.step, dense_entry.written)
    cost.other_bytes += raw.size
    side = SideState(dense=dense.decode_tree(raw.to_pybytes()))
    check_dense(into, side.dense, store.step_path(head.step, dense_entry.path))
    rank_files = sorted((f for f in head.files if f.role == "rank"), key=lambda f: f.rank)
    if head.world_size == comm.world_size:
        own = next((f for f in rank_files if f.rank == comm.rank), None)
        if own is None:
            raise CheckpointCorruptError(manifest_path, f"lists no file of rank {comm.rank}")
        raw = store.read_checked(head.step, own.written)
        cost.other_bytes += raw.size
        side.rank = dense.decode_tree(raw.to_pybytes())
        return side
    side.skipped.append(
        f"RNG streams: written by {head.world_size} ranks, restoring onto {comm.world_size}"
    )
    states = []
    for entry in rank_files:
        raw = store.read_checked(head.step, entry.written)
        cost.other_bytes += raw.size
        states.append(dense.decode_tree(raw.to_pybytes())["statefuls"])
    for name in into.statefuls:
        saved = [s.get(name) for s in states]
        if not saved or any(s is None for s in saved):
            side.skipped.append(f"stateful {name!r}: not in every rank's file of step {head.step}")
        elif any(dense.encode_tree(s) != dense.encode_tree(saved[0]) for s in saved[1:]):
            side.skipped.append(
                f"stateful {name!r}: differs between the {head.world_size} writing ranks"
            )
        else:
            side.statefuls[name] = saved[0]
    return side


def check_dense(into: RestoreTarget, state: dict[str, Any], path: str) -> None:
    """Refuses, before anything is loaded, dense state the live model or optimizer would
    reject half-way through loading it."""
    live = into.model.state_dict()
    for key, value in state["model"].items():
        if key not in live or tuple(live[key].shape) != tuple(value.shape):
            found = tuple(live[key].shape) if key in live else "missing"
            raise ModelMismatchError(
                f"dense entry {key}: checkpoint {path} has shape {tuple(value.shape)}, the "
                f"model {found}"
            )
    saved = state["optimizer"]
    if into.optimizer is None or saved is None:
        return
    have = [len(g["params"]) for g in into.optimizer.state_dict().get("param_groups", [])]
    want = [len(g["params"]) for g in saved.get("param_groups", [])]
    if have != want:
        raise ModelMismatchError(
            f"dense optimizer: checkpoint {path} has parameter groups of {want} parameters, "
            f"the model's optimizer {have} (did a table change to or from data-parallel?)"
        )


def apply_side_state(into: RestoreTarget, side: SideState) -> None:
    state = dict(side.dense)
    # A rank holds scalar optimizer states (e.g. Adam's step) only for its own tables.
    state["fused_scalars"] = {
        k: v for k, v in state["fused_scalars"].items() if k in into.sharded.scalar_states
    }
    dense.apply_dense_state(state, into.model, into.optimizer, into.sharded.scalar_states)
    if side.rank is not None:
        dense.apply_rank_state(side.rank, into.statefuls)
        return
    for name, saved in side.statefuls.items():
        try:
            into.statefuls[name].load_state_dict(saved)
        except (EmbckptError, ValueError, KeyError, TypeError) as exc:
            side.skipped.append(f"stateful {name!r}: refused writer rank 0's state: {exc}")
