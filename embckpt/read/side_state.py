"""The non-table part of a restore: the dense model and optimizer state, RNG streams, stateful
objects and managed-collision modules' state (:mod:`embckpt.mch`).

Read and checked with the rows, before anything is loaded (dense keys and shapes, the dense
optimizer's parts, groups and state shapes, the statefuls' keys); applied by
:func:`embckpt.read.restore.restore_checkpoint` before the rows. Applying runs user code
(optimizer and stateful ``load_state_dict``) that may still fail: every rank keeps copies of
what it overwrites (all of it small), the ranks agree, and if any rank failed every rank puts
its copies back and raises, so a failed restore changes nothing.
"""

from __future__ import annotations

import copy
import logging
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torchrec.optim.keyed import KeyedOptimizer

from embckpt import dense, mch
from embckpt.errors import (
    CheckpointCorruptError,
    ConfigError,
    EmbckptError,
    ModelMismatchError,
    RestoreRankError,
)
from embckpt.mch import MchLoad
from embckpt.read.target import RestoreTarget
from embckpt.sharding import ShardedModel
from embckpt.storage.layout import MANIFEST_NAME
from embckpt.storage.manifest import Manifest

log = logging.getLogger(__name__)


@dataclass
class SideState:
    """The non-table part of a restore: what to load, and what will not be."""

    dense: dict[str, Any]
    rank: dict[str, Any] | None = None  # this rank's own file, same world size
    statefuls: dict[str, Any] = field(default_factory=dict)  # other world size: from rank 0
    skipped: list[str] = field(default_factory=list)
    unused_statefuls: list[str] = field(default_factory=list)  # saved, but not given to load
    mch: list[MchLoad] = field(default_factory=list)
    dense_path: str = ""
    bytes_read: int = 0  # of the dense and per-rank files
    from_rank0: bool = False  # other world size: statefuls decided by rank 0 (share_side_state)
    # As check_dense found them, for load_side_state: the model's state_dict() and each
    # optimizer with its saved state.
    live: dict[str, Any] = field(default_factory=dict, repr=False)
    optimizers: list[tuple] = field(default_factory=list, repr=False)


def read_side_state(into: RestoreTarget, head: Manifest) -> SideState:
    """Reads the dense and per-rank files of ``head`` and checks them against the live model,
    optimizer and statefuls; the result says how many bytes it read.

    Raises:
        CheckpointCorruptError: a file is missing or damaged.
        ModelMismatchError: the live model, optimizer or statefuls would refuse the state.
    """
    store, comm = into.store, into.comm
    manifest_path = store.step_path(head.step, MANIFEST_NAME)
    dense_entry = next((f for f in head.files if f.role == "dense"), None)
    if dense_entry is None:
        raise CheckpointCorruptError(manifest_path, "lists no dense file")
    raw = store.read_checked(head.step, dense_entry.written)
    dense_path = store.step_path(head.step, dense_entry.path)
    side = SideState(
        dense=dense.decode_tree(raw.to_pybytes()), dense_path=dense_path, bytes_read=raw.size
    )
    side.live, side.optimizers = check_dense(into, side.dense, dense_path)
    rank_files = sorted((f for f in head.files if f.role == "rank"), key=lambda f: f.rank)
    if head.world_size == comm.world_size:
        own = next((f for f in rank_files if f.rank == comm.rank), None)
        if own is None:
            raise CheckpointCorruptError(manifest_path, f"lists no file of rank {comm.rank}")
        store.check_contained(head.step, [own.path], manifest_path)  # a part's rank file
        raw = store.read_checked(head.step, own.written)
        side.bytes_read += raw.size
        side.rank = dense.decode_tree(raw.to_pybytes())
        saved = side.rank["statefuls"]
        absent = sorted(set(into.statefuls) - set(saved))
        if absent:
            raise ModelMismatchError(
                f"statefuls {absent}: not in checkpoint {store.step_path(head.step, own.path)} "
                f"(it holds {sorted(saved)})"
            )
        _note_unused(side, into, set(saved))
        _plan_mch(into, head, side, {comm.rank: side.rank})
        return side
    side.skipped.append(
        f"RNG streams: written by {head.world_size} ranks, restoring onto {comm.world_size}"
    )
    if not into.sharded.mch and comm.rank != 0:
        side.from_rank0 = True  # rank 0 reads every writer's file; share_side_state sends
        return side
    trees = _read_rank_files(into, head, side, {})
    states = [trees[rank]["statefuls"] for rank in sorted(trees)]
    _note_unused(side, into, {name for s in states for name in s})
    for name in into.statefuls:
        saved_states = [s.get(name) for s in states]
        if not saved_states or any(s is None for s in saved_states):
            side.skipped.append(f"stateful {name!r}: not in every rank's file of step {head.step}")
        elif any(
            dense.encode_tree(s) != dense.encode_tree(saved_states[0]) for s in saved_states[1:]
        ):
            side.skipped.append(
                f"stateful {name!r}: differs between the {head.world_size} writing ranks"
            )
        else:
            side.statefuls[name] = saved_states[0]
    _plan_mch(into, head, side, trees)
    return side


def share_side_state(into: RestoreTarget, side: SideState) -> None:
    """Onto another world size, without managed-collision tables (whose rows every rank needs
    from every writer), only rank 0 reads every writer's rank file, and sends the statefuls it
    restores and what it skipped (collective; call once every rank read its side state): a rank
    then reads one file of metadata size, not one per writer rank (288 MB at 4,096 ranks,
    ``benchmarks/scale.py``)."""
    if not shared_by_rank0(into, side):
        return
    shared = (side.statefuls, side.skipped, side.unused_statefuls)  # rank 0's is sent
    statefuls, skipped, unused = into.comm.broadcast(shared)
    if side.from_rank0:
        side.statefuls, side.skipped, side.unused_statefuls = statefuls, skipped, unused
        side.from_rank0 = False


def _note_unused(side: SideState, into: RestoreTarget, saved: set[str]) -> None:
    """Lists the statefuls the checkpoint holds that the restore was not given: their state
    is not loaded, most likely a name that changed or a stateful left out by mistake."""
    side.unused_statefuls = sorted(saved - set(into.statefuls))
    side.skipped.extend(
        f"stateful {name!r}: the checkpoint holds it, but statefuls= does not name it"
        for name in side.unused_statefuls
    )


def _read_rank_files(
    into: RestoreTarget, head: Manifest, side: SideState, trees: dict[int, dict[str, Any]]
) -> dict[int, dict[str, Any]]:
    """Every writer rank's file of ``head``, decoded, by rank (those in ``trees`` not re-read)."""
    entries = [f for f in head.files if f.role == "rank" and f.rank not in trees]
    manifest_path = into.store.step_path(head.step, MANIFEST_NAME)
    into.store.check_contained(head.step, [f.path for f in entries], manifest_path)
    for entry in entries:
        raw = into.store.read_checked(head.step, entry.written)
        side.bytes_read += raw.size
        trees[entry.rank] = dense.decode_tree(raw.to_pybytes())
    return dict(sorted(trees.items()))


def _plan_mch(
    into: RestoreTarget, head: Manifest, side: SideState, trees: dict[int, dict[str, Any]]
) -> None:
    """Plans the managed-collision loads: from this rank's own file when it holds exactly this
    rank's rows (same world size and plan), else from every writer rank's."""
    tables = into.sharded.mch
    path = into.store.step_path(head.step)
    own = trees.get(into.comm.rank, {}).get("mch", {})
    if head.world_size == into.comm.world_size and mch.own_entries_match(tables, own):
        side.mch, skipped = mch.plan_loads(tables, [own], own, path)
    else:
        trees = _read_rank_files(into, head, side, trees)
        saved = [tree.get("mch", {}) for tree in trees.values()]
        side.mch, skipped = mch.plan_loads(tables, saved, None, path)
    side.skipped.extend(skipped)


def check_dense(
    into: RestoreTarget, state: dict[str, Any], path: str
) -> tuple[dict[str, Any], list[tuple]]:
    """Refuses, before anything is loaded, dense state the live model or optimizer would
    reject half-way through loading it; returns the model's ``state_dict()`` and each
    optimizer with its saved state, which loading uses again (a sharded model's state dict
    costs a pass over every module, the optimizers' split one over its parameters: 0.38 and
    0.17 ms for ``benchmarks/family.py``'s dim128 model on the 2-core machine of
    ``benchmarks/results/``)."""
    live = into.model.state_dict()
    for key, value in state["model"].items():
        if key not in live or tuple(live[key].shape) != tuple(value.shape):
            found = tuple(live[key].shape) if key in live else "missing"
            raise ModelMismatchError(
                f"dense entry {key}: checkpoint {path} has shape {tuple(value.shape)}, the "
                f"model {found}"
            )
    pairs = _optimizer_pairs(into, state, path)
    for optimizer, saved in pairs:
        check_optimizer(optimizer, saved, path)
    return live, pairs


def _optimizer_pairs(into: RestoreTarget, state: dict[str, Any], path: str) -> list[tuple]:
    try:
        parts = dense.optimizer_parts(into.optimizer, into.model)
        return dense.split_optimizer_state(parts, state["optimizer"])
    except ConfigError as exc:
        raise ModelMismatchError(f"checkpoint {path}: {exc}") from exc


def check_optimizer(optimizer: Any, saved: dict[str, Any], path: str) -> None:
    """Refuses a saved optimizer state whose parameters, groups or state shapes differ from
    the live optimizer's (compared with its state where it has some, else its parameters)."""
    where = f"dense optimizer ({type(optimizer).__name__}): checkpoint {path}"
    params = dense.param_keys(optimizer)
    if "param_groups" in saved:
        # Keyed optimizers name their parameters; torch optimizers number them in order.
        if isinstance(optimizer, KeyedOptimizer):
            key_of = {id(p): k for k, p in params.items()}
            have: list = sorted(
                sorted(key_of[id(p)] for p in g["params"]) for g in optimizer.param_groups
            )
            want: list = sorted(sorted(g["params"]) for g in saved["param_groups"])
        else:
            have = [len(g["params"]) for g in optimizer.param_groups]
            want = [len(g["params"]) for g in saved["param_groups"]]
        if have != want:
            raise ModelMismatchError(
                f"{where} has parameter groups {want}, the live optimizer {have} (did a "
                "table change to or from data-parallel?)"
            )
    unknown = sorted(map(str, set(saved.get("state", {})) - set(params)))
    if unknown:
        raise ModelMismatchError(
            f"{where} has state for parameters {unknown[:5]} the live optimizer does not "
            "have (did a table change to or from data-parallel?)"
        )
    for key, entries in saved.get("state", {}).items():
        param = params[key]
        live_state = optimizer.state.get(param) or {}
        for name, value in entries.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            live_value = live_state.get(name)
            expected = live_value.shape if isinstance(live_value, torch.Tensor) else param.shape
            if tuple(value.shape) != tuple(expected):
                raise ModelMismatchError(
                    f"{where}: state {name!r} of parameter {key} has shape "
                    f"{tuple(value.shape)}, the live one {tuple(expected)}"
                )


def fused_scalar_values(sharded: ShardedModel, saved: Mapping[str, Any]) -> dict[str, Any]:
    """The saved value of each of this rank's fused-optimizer scalars (``<block>/<name>``):
    the block's own; on another plan, the largest of its table's saved blocks; from older
    writers, the table's (``<fqn>/<name>``). Blocks of one kernel share its counter, which gets
    the largest of their values. A scalar nothing saved is left out: it stays as it is."""
    by_table: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for key, value in saved.items():
        by_table[_table_and_name(key)].append(value)
    fqns = {s.key: s.fqn for s in sharded.shards}
    found: dict[str, list[Any]] = {}
    for key in sharded.scalar_states:
        block, _, name = key.rpartition("/")
        legacy = f"{fqns[block]}/{name}"
        if key in saved:
            found[key] = [saved[key]]
        elif _table_and_name(key) in by_table:
            found[key] = by_table[_table_and_name(key)]
        elif legacy in saved:
            found[key] = [saved[legacy]]
    shared: dict[int, list[str]] = defaultdict(list)  # keys of one live tensor
    for key in found:
        shared[sharded.scalar_states[key].data_ptr()].append(key)
    values: dict[str, Any] = {}
    for keys in shared.values():
        candidates = [v for k in keys for v in found[k]]
        largest = max(candidates, key=lambda v: v.item())
        if keys[0].endswith("/iter") and any(v.item() != largest.item() for v in candidates):
            log.warning(
                "blocks %s share one FBGEMM step counter, saved with different values %s: "
                "restoring the largest",
                sorted(k.rpartition("/")[0] for k in keys),
                sorted({v.item() for v in candidates}),
            )
        values.update(dict.fromkeys(keys, largest))
    return values


def _table_and_name(key: str) -> tuple[str, str]:
    """``<table>/r<row>_c<col>/<name>`` -> (table, name)."""
    block, _, name = key.rpartition("/")
    return block.rpartition("/")[0], name


@dataclass
class PriorState:
    """Copies of everything :func:`load_side_state` overwrites, to put back on failure."""

    model: dict[str, torch.Tensor]
    scalars: dict[str, torch.Tensor]
    optimizers: list[tuple[Any, dict[Any, Any], list[dict[str, Any]]]]
    rank: dict[str, Any]  # RNG streams
    statefuls: dict[str, Any]
    mch: list[MchLoad]


def shared_by_rank0(into: RestoreTarget, side: SideState) -> bool:
    """Whether rank 0 sends the statefuls before they are loaded (:func:`share_side_state`,
    a collective): onto another world size, without managed-collision tables. The same on
    every rank that read its side state."""
    return not into.sharded.mch and side.rank is None


def load_side_state(into: RestoreTarget, side: SideState) -> PriorState:
    """Loads the side state on this rank alone; returns what it overwrote, for
    :func:`roll_back_side_state` should another rank fail. On failure here, puts everything
    back and raises.

    Raises:
        ModelMismatchError: the live optimizer refused its state after creating it; whatever a
            stateful's or an optimizer's ``load_state_dict`` raised.
    """
    state = dict(side.dense)
    state["fused_scalars"] = fused_scalar_values(into.sharded, state.get("fused_scalars", {}))
    pairs, live = side.optimizers, side.live  # as read_side_state checked them
    loading = into.statefuls if side.rank is not None else side.statefuls
    prior = _capture(into, live, state, [opt for opt, _ in pairs], list(loading), side.mch)
    try:
        _apply(into, live, side, state, pairs, prior.statefuls)
    except BaseException:
        roll_back_side_state(into, prior)
        raise
    return prior


def apply_side_state(into: RestoreTarget, side: SideState) -> None:
    """Loads the side state on every rank (collective), or, if it fails on any rank, leaves
    the model, optimizers, RNG and statefuls of every rank as they were and raises.

    Raises:
        ModelMismatchError: the live optimizer refused its state after creating it.
        RestoreRankError: another rank failed; its reason is quoted. Whatever a stateful's or an
            optimizer's ``load_state_dict`` raised is re-raised on its own rank.
    """
    prior: PriorState | None = None
    error: Exception | None = None
    try:
        prior = load_side_state(into, side)
    except Exception as exc:  # gathered below, so that every rank rolls back
        error = exc
    try:
        into.comm.check(error, "restoring the dense state, RNG and statefuls", RestoreRankError)
    except BaseException:
        if prior is not None:
            roll_back_side_state(into, prior)
        raise


@torch.no_grad()
def _apply(
    into: RestoreTarget,
    live: dict[str, Any],
    side: SideState,
    state: dict[str, Any],
    pairs: list,
    prior_statefuls: dict[str, Any],
) -> None:
    for key, value in state["model"].items():
        live[key].copy_(value)
    for item in side.mch:
        mch.load(item)
    for key, value in state["fused_scalars"].items():
        into.sharded.scalar_states[key].copy_(value)
    for kernel in into.sharded.kernels:
        kernel.reload_iter()
    for optimizer, saved in pairs:
        dense.create_missing_state(optimizer, set(saved.get("state", {})))
        check_optimizer(optimizer, saved, side.dense_path)
        optimizer.load_state_dict(saved)
    if side.rank is not None:
        dense.apply_rank_state(side.rank, into.statefuls)
        return
    for name, saved_state in side.statefuls.items():
        try:
            into.statefuls[name].load_state_dict(saved_state)
        except (EmbckptError, ValueError, KeyError, TypeError) as exc:
            # Skipped, not fatal (another world size); what it half-loaded is put back.
            into.statefuls[name].load_state_dict(prior_statefuls[name])
            side.skipped.append(f"stateful {name!r}: refused writer rank 0's state: {exc}")


def _capture(
    into: RestoreTarget,
    live: dict[str, Any],
    state: dict[str, Any],
    optimizers: list[Any],
    statefuls: list[str],
    mch_loads: list[MchLoad],
) -> PriorState:
    return PriorState(
        model={k: live[k].detach().clone() for k in state["model"]},
        scalars={k: into.sharded.scalar_states[k].clone() for k in state["fused_scalars"]},
        optimizers=[
            (
                opt,
                {p: dense.detached_copy(dict(s)) for p, s in opt.state.items()},
                [
                    {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                    for g in opt.param_groups
                ],
            )
            for opt in optimizers
        ],
        rank=dense.rank_state({}),  # fresh copies of the RNG streams already
        statefuls={
            name: dense.detached_copy(into.statefuls[name].state_dict()) for name in statefuls
        },
        mch=[
            MchLoad(
                table=item.table,
                buffers=dense.detached_copy(dict(item.table.buffers)),
                eviction=dense.detached_copy(mch.eviction_state(item.table.module)),
            )
            for item in mch_loads
        ],
    )


@torch.no_grad()
def roll_back_side_state(into: RestoreTarget, prior: PriorState) -> None:
    """Puts back what :func:`load_side_state` overwrote."""
    live = into.model.state_dict()
    for key, value in prior.model.items():
        live[key].copy_(value)
    for item in prior.mch:
        mch.load(item)
    for key, value in prior.scalars.items():
        into.sharded.scalar_states[key].copy_(value)
    for kernel in into.sharded.kernels:
        kernel.reload_iter()
    for optimizer, saved_state, groups in prior.optimizers:
        current = optimizer.state
        for param in [p for p in current if p not in saved_state]:
            del current[param]
        for param, entries in saved_state.items():
            current[param] = dense.detached_copy(entries)
        for group, saved_group in zip(optimizer.param_groups, groups, strict=True):
            for key in [k for k in group if k != "params" and k not in saved_group]:
                del group[key]
            group.update(copy.deepcopy(saved_group))
    dense.apply_rank_state(prior.rank, {})
    for name, saved in prior.statefuls.items():
        try:
            into.statefuls[name].load_state_dict(saved)
        except Exception as exc:  # the first failure is the one raised; this one is logged
            log.warning("restore failed; stateful %r refused its prior state too: %s", name, exc)
