"""The decide step of a save: the same decision on every rank, and what the snapshot takes.

Rank 0 prepares the step folder (refusing a committed or an older step); every rank folds its
trackers, marks the rows that change without a lookup, takes its statefuls' state and its
fused-optimizer counters, and gathers, in one collective, its dirty fractions, its interval
measurements, whether its writer's reference is set and any error (rank 0's refusal among
them); the policy, fed identical inputs, then decides identically everywhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from embckpt import dense, failpoints
from embckpt.codecs import Codec
from embckpt.errors import SaveError, SaveRankError
from embckpt.interval import IntervalMeasurements
from embckpt.policy import Decision, Kind, PolicyInput
from embckpt.save.commit_manifest import chain_bytes
from embckpt.save.context import SaveContext
from embckpt.save.persist import as_save_error
from embckpt.save.transaction import SaveState, SaveTransaction
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import MANIFEST_NAME
from embckpt.tracking import RowTracker, View


def tracker_view(decision: Decision) -> View:
    """The tracker view whose rows a diff writes: where a policy's decision meets the tracker
    (the policy knows diffs by :class:`~embckpt.policy.DiffBase`, not by tracker views)."""
    return View.SINCE_FULL if decision.one_shot else View.SINCE_LAST


@dataclasses.dataclass(frozen=True)
class Decided:
    """What a save's decision hands its snapshot: the same on every rank but ``states``."""

    decision: Decision
    dirty: dict[View, float]
    states: dict[str, Any]  # this rank's statefuls' state, checked
    fused_scalars: dict[str, torch.Tensor]  # every rank's fused-optimizer counters


def decide(
    ctx: SaveContext, state: SaveState, codec: Codec, step: int, transaction: SaveTransaction
) -> Decided:
    """Decides the checkpoint, the same on every rank, and takes what the snapshot copies:
    the statefuls' state and every rank's fused-optimizer counters."""
    comm = ctx.comm
    # Rank 0's refusal is its error in the agreement below, which every rank reaches.
    refusal = prepare_step_folder(ctx.store, step) if comm.rank == 0 else None
    try:
        state.tracker.fold()  # collective for replicated tables: before anything may raise
    except RuntimeError as exc:  # the group itself failed (a peer died)
        raise SaveRankError(f"step {step}: folding trackers across ranks failed: {exc}") from exc
    local = [0.0, 0.0, 0.0]
    scalars: dict[str, Scalar] = {}
    measured = state.clock.collect(state.last_blocked_s)
    states: dict[str, Any] = {}
    error: BaseException | None = None if refusal is None else SaveError(refusal)
    if error is None:  # a refused step takes nothing
        try:
            failpoints.hit("save.decide")
            states = take_statefuls(ctx, step)
            mark_moving_rows(ctx, state.tracker)
            scalars = {k: scalar_of(v) for k, v in ctx.sharded.scalar_states.items()}
            for shard in ctx.sharded.writer_shards():
                local[0] += state.tracker.count(shard.key, View.SINCE_LAST) * shard.num_cols
                local[1] += state.tracker.count(shard.key, View.SINCE_FULL) * shard.num_cols
                local[2] += shard.num_rows * shard.num_cols
        except Exception as exc:  # raised on every rank by the agreement below
            error = as_save_error(exc, step, comm.rank, "deciding")
    times = (measured.clean_iter_s, measured.busy_extra_s, measured.blocked_s)
    # Every rank's reference: a writer process that died took its rank's with it.
    ready = state.reference.ready
    gathered = comm.gather_checked(
        (local, times, scalars, ready), error, f"deciding step {step}", SaveRankError
    )
    fused_scalars = {k: tensor_of(v) for g in gathered for k, v in g[2].items()}
    since_last, since_full, total = (sum(g[0][i] for g in gathered) for i in range(3))
    clean, extra, blocked = (max(g[1][i] for g in gathered) for i in range(3))
    if ctx.config.adaptive_interval and measured.iterations:
        state.interval.update(IntervalMeasurements(clean, extra, blocked, measured.iterations))
    state.next_step = step + state.interval.interval
    dirty = {
        View.SINCE_LAST: since_last / max(total, 1.0),
        View.SINCE_FULL: since_full / max(total, 1.0),
    }
    head = state.head
    decision = ctx.policy.decide(
        PolicyInput(
            step,
            dirty[View.SINCE_LAST],
            dirty[View.SINCE_FULL],
            head.history if head is not None else (),
            None if head is None else chain_bytes(head),
            ctx.full_fp32_bytes,
        )
    )
    if codec.additive and decision.kind is Kind.DIFF and not all(g[3] for g in gathered):
        # Deltas need the reconstruction of their base, which only a full written by this
        # process provides (not kept across a restart, a restore or a failed full).
        decision = Decision(Kind.FULL, reason="additive codec: no reconstructed base yet")
    transaction.decided(decision, codec.additive, ctx.policy.mixes_diffs)
    return Decided(decision, dirty, states, fused_scalars)


def take_statefuls(ctx: SaveContext, step: int) -> dict[str, Any]:
    """The statefuls' state, checked when the save is decided so that one a checkpoint
    cannot hold fails the save on every rank (the decision's agreement) before anything is
    written, naming the stateful and the key."""
    try:
        return dense.stateful_states(ctx.statefuls)
    except Exception as exc:
        rank = ctx.comm.rank
        raise SaveError(f"step {step}: rank {rank}: cannot save the statefuls: {exc}") from exc


def mark_moving_rows(ctx: SaveContext, tracker: RowTracker) -> None:
    """Marks the rows that change without a lookup, which the lookups alone do not say
    changed: of data-parallel tables, those their dense optimizer moves (non-zero momentum,
    or every row under weight decay); every row of blocks whose fused optimizer rewrites
    them all (EMA in place)."""
    moving = dense.moving_rows(dense.optimizer_parts(ctx.optimizer, ctx.model))
    every_row = ctx.sharded.every_row_blocks()
    for shard in ctx.sharded.writer_shards():
        if shard.key in every_row:
            rows = None
        elif shard.sharding_type == "data_parallel" and shard.weight.data_ptr() in moving:
            rows = moving[shard.weight.data_ptr()]
        else:
            continue
        if rows is None:
            marked = torch.arange(shard.num_rows, device=shard.weight.device)
        else:
            marked = torch.nonzero(rows).flatten()
        for view in View:
            tracker.mark(shard.key, marked, view)


def prepare_step_folder(store: CheckpointStore, step: int) -> str | None:
    """Rank 0, before any rank writes: refuses a committed step and a step older than a
    committed one (the newer chain would stay "latest" and a later restore would silently
    skip this one), clears an interrupted one."""
    try:
        # Only this step's folder and newer ones: each look is a request on an object store.
        states = store.step_states(at_least=step)
        if states.get(step):
            return (
                f"step {step}: {store.step_path(step, MANIFEST_NAME)} already exists; "
                "a committed checkpoint is never overwritten (to resume from an older step "
                "and drop the newer checkpoints, restore it with discard_newer=True)"
            )
        newer = [s for s, committed in states.items() if committed and s > step]
        if newer:
            return (
                f"step {step}: {store.uri} already holds newer checkpoints (steps "
                f"{', '.join(map(str, newer))}), which a restore would take over this one; "
                "to resume from an older step and drop them, restore it with "
                "discard_newer=True"
            )
        if states.get(step) is False:
            store.remove_step(step)  # debris of an interrupted save of this step
    except Exception as exc:  # a refusal: the other ranks must not wait for an answer
        return f"step {step}: rank 0: cannot prepare {store.step_path(step)}: {exc}"
    return None


Scalar = tuple[str, tuple[int, ...], Any]
"""A one-value tensor as (dtype name, shape, value): gathered as plain Python, because pickling
tensors through ``all_gather_object`` costs ~0.1 ms each (a few hundred counters: most of a
small model's save)."""


def scalar_of(tensor: torch.Tensor) -> Scalar:
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), tensor.item()


def tensor_of(scalar: Scalar) -> torch.Tensor:
    dtype, shape, value = scalar
    return torch.tensor(value, dtype=getattr(torch, dtype)).reshape(shape)
