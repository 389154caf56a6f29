"""Restore: read a checkpoint chain and load it into the live, sharded model, whatever world
size and sharding plan wrote it.

The flow, in the phases ``RestoreResult.phases`` times (every rank, together):

1. plan    - rank 0 lists committed steps and broadcasts the one to restore; every rank reads
             the manifests from it back through its parents to the full base (each checks its
             own checksum; a missing link is named with what needs it), checks that the
             model's tables (names, shapes, dtypes) equal the checkpoint's, and lists the
             files and row groups its own blocks overlap (``plan.py``). Only the reader's own
             plan is needed: files are addressed by global rows and columns. Each rank picks
             its threads from what it and the other ranks of its host restore, as the
             manifests tell it (``_threads``: no collective);
2. fetch   - each rank's threads fetch those row groups, newest checkpoint first, skipping what
             newer checkpoints already give (``stage.py``); the dense and per-rank files are
             read whole;
3. verify  - every fetched byte against the manifest's checksums. On the world size that
             wrote the checkpoint, each rank then loads its dense state, RNG and stateful
             objects (:mod:`embckpt.read.side_state`), keeping what they held. Then the ranks
             agree: any failure so far raises on every rank, each rank putting back what it
             loaded, so a failed restore never leaves a half-loaded model (onto another world
             size, rank 0's statefuls are shared after this agreement, then loaded, and the
             ranks agree on that);
4. decode  - the codecs named in each file decode bounded batches (``apply.py``);
5. apply   - FBGEMM's row caches flushed and emptied (:mod:`embckpt.kernel_cache`) and the
             rows written into this rank's blocks (additive codecs add, in chain order); the
             ranks agree once more. The result lists the rows the chain's diffs changed; the
             caller (``Checkpointer``) rebuilds its tracker from it.

Resharding (writer plan -> this plan):

* weights and element-wise optimizer states are addressed by global (row, column): exact;
* row-wise optimizer states (one value per row per column block, e.g. row-wise Adagrad's
  momentum) are exact when a block's columns lie inside one writer block; a block that spans
  several writer blocks gets their mean weighted by column overlap;
* a table cannot change to or from data-parallel: its optimizer state belongs to the dense
  optimizer there and to the fused one elsewhere (refused before anything is loaded);
* the dense state is replicated and always restored. Per-rank state on the same world size
  is each rank's own; on another world size RNG streams are not restored (they belong to
  ranks that no longer exist), and each stateful is loaded from writer rank 0 only when every
  writer rank saved the same state for it and it accepts that state; anything not restored
  is logged and listed in :attr:`RestoreResult.skipped`, and so is, on any world size, a
  stateful the checkpoint holds that the restore was not given
  (:attr:`RestoreResult.unused_statefuls`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from embckpt import failpoints, kernel_cache
from embckpt.collective import Collective
from embckpt.cores import balanced_restore_threads, local_ranks, restore_threads
from embckpt.dtypes import dtype_name
from embckpt.errors import (
    ChainIncompleteError,
    ModelMismatchError,
    RankError,
    RestoreError,
    RestoreRankError,
    as_error,
)
from embckpt.read.apply import apply_staged
from embckpt.read.cells import WrittenRows, listed
from embckpt.read.heap import trim_heap
from embckpt.read.plan import FileRead, plan_reads, writer_ranks
from embckpt.read.side_state import (
    PriorState,
    SideState,
    apply_side_state,
    load_side_state,
    read_side_state,
    roll_back_side_state,
    share_side_state,
    shared_by_rank0,
)
from embckpt.read.stage import ReadCost, StagedFile, release, stage
from embckpt.read.target import RestoreTarget
from embckpt.storage.chain import read_chain
from embckpt.storage.layout import MANIFEST_NAME
from embckpt.storage.manifest import Manifest, collector_paused, ids_of_bare_names
from embckpt.storage.phases import RESTORE_PHASES, PhaseClock

log = logging.getLogger(__name__)

PROGRESS_MIN_BYTES = 256 << 20  # a progress bar only for restores reading more than this


def named_as_model(chain: list[Manifest], into: RestoreTarget, path: str) -> list[Manifest]:
    """A chain written before tables carried their module path (format 1 and 2) with its bare
    table names replaced by the model's identities.

    Raises:
        ModelMismatchError: a bare name fits several of the model's tables (two collections
            with a table of that name), so the checkpoint cannot say which one it holds.
    """
    ids = into.sharded.table_shapes.keys()
    renamed = []
    for manifest in chain:
        if manifest.qualified_tables:
            renamed.append(manifest)
            continue
        names = [t.name for t in manifest.tables]
        mapping = ids_of_bare_names(names, ids)
        for name in names:
            fits = [t for t in ids if t.rsplit(".", 1)[-1] == name]
            if name not in mapping and len(fits) > 1:
                raise ModelMismatchError(
                    f"table {name}: checkpoint {path} names it without its module, and the "
                    f"model has {len(fits)} tables of that name ({', '.join(sorted(fits))})"
                )
        renamed.append(manifest.with_table_ids(mapping))
    return renamed


def check_model_matches(into: RestoreTarget, manifest: Manifest, path: str) -> None:
    """Raises ModelMismatchError naming the first table that differs."""
    model_tables = into.sharded.table_shapes
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
        model_dtype = dtype_name(into.sharded.table_dtypes[name])
        if entry.dtype != model_dtype:
            raise ModelMismatchError(
                f"table {name}: checkpoint {path} has dtype {entry.dtype}, the model {model_dtype}"
            )


# -- the collective restore ---------------------------------------------------------------------
@dataclass(frozen=True)
class RestoreResult:
    """What a restore loaded, on this rank.

    Attributes:
        manifest: the restored checkpoint's manifest.
        chain: the steps applied, base first.
        cost: what this rank read.
        seconds: wall time of the whole restore; ``stage_seconds`` of plan + stage + agree
            (with the side state loaded, on the world size that wrote the checkpoint).
        phases: busy seconds of this rank's plan, fetch, verify, decode and apply, each summed
            over the threads that worked in it (see ``PhaseClock``); ``plan`` includes reading
            the chain's manifests.
        skipped: per-rank state that was not restored, with the reason (world size changed,
            or a stateful the checkpoint holds that the restore was not given).
        diff_rows: (block key, local rows) this rank restored from the chain's diffs: the rows
            that changed since the chain's full base (the caller's tracker marks them).
        unused_statefuls: names of the statefuls the checkpoint holds that the restore was not
            given (``statefuls=``), sorted; also listed, with the reason, in ``skipped``.
        bytes_by_tier, seconds_by_tier: with a node-local tier (``tiers/``), the bytes this
            rank read from each tier (``local``, ``peer``: sent by another node over the process
            group, ``durable``) and the busy seconds spent there; empty without one.
        refused_copies: copies that failed their checks and were passed over for the next
            one (path: reason).
        partial: a partial recovery's report (``tiers.restore.PartialRecovery``): which
            blocks came from which older step, and the fraction lost; None for a whole restore.
    """

    manifest: Manifest
    chain: tuple[int, ...]
    cost: ReadCost
    seconds: float
    stage_seconds: float
    skipped: tuple[str, ...]
    diff_rows: tuple[tuple[str, torch.Tensor], ...] = ()
    phases: dict[str, float] = field(default_factory=dict)
    unused_statefuls: tuple[str, ...] = ()
    bytes_by_tier: dict[str, int] = field(default_factory=dict)
    seconds_by_tier: dict[str, float] = field(default_factory=dict)
    refused_copies: tuple[str, ...] = ()
    partial: Any = None


def restore_checkpoint(
    into: RestoreTarget, step: int | None = None, *, progress: bool | None = None
) -> RestoreResult | None:
    """Restores checkpoint ``step`` (latest if None) into ``into``'s model (collective).

    Args:
        into: the model and state to load; any world size and sharding plan.
        step: the step to restore; None for the latest committed one.
        progress: a progress bar on rank 0; None shows one when the restore reads more than
            ``PROGRESS_MIN_BYTES`` and stderr is a terminal.

    Returns:
        What was restored (nothing else is changed: the caller continues the chain); None on
        every rank if the directory holds no committed checkpoint.

    Raises:
        ChainIncompleteError: ``step`` or a checkpoint its chain needs is not committed.
        CheckpointCorruptError: a file is missing, truncated or altered (named); nothing was
            loaded on any rank.
        ModelMismatchError: the model's tables differ from the checkpoint's.
        RestoreRankError: another rank failed; its reason is quoted.
    """
    # Python's cyclic collector is off meanwhile: a restore makes tens of thousands of small
    # objects and no cycle worth collecting, and they set off full passes over the job's
    # heap: on the 2-core machine of benchmarks/results/, one pass of 0.3 s in about every
    # 20th restore of a 16-link chain (benchmarks/family.py's dim128 model).
    with collector_paused():
        return _restore(into, step, progress)


def _restore(into: RestoreTarget, step: int | None, progress: bool | None) -> RestoreResult | None:
    started = time.perf_counter()
    comm, store = into.comm, into.store
    choice: tuple[int | None, str | None, str | None] = (None, None, None)
    if comm.rank == 0:
        try:  # the newest, or the one asked for: a look or two, not one per checkpoint
            if step is None:
                choice = (store.newest_committed(), None, None)
            elif store.is_committed(step):
                choice = (step, None, None)
            else:
                known = ", ".join(map(str, store.committed_steps())) or "none"
                choice = (
                    None,
                    f"no committed checkpoint of step {step} in {store.uri} (committed: {known})",
                    None,
                )
        except Exception as exc:  # broadcast: the other ranks must not wait for a choice
            choice = (None, None, f"cannot list the checkpoints of {store.uri}: {exc}")
    try:
        target, missing, unlisted = _share_choice(comm, choice)
    except RankError as exc:
        raise RestoreRankError(f"choosing the step to restore: {exc}") from exc
    if unlisted is not None:
        raise RestoreError(f"rank 0: {unlisted}")
    if missing is not None:
        raise ChainIncompleteError(store.step_path(int(step or 0), MANIFEST_NAME), missing)
    if target is None:
        return None

    error: BaseException | None = None
    chain: list[Manifest] = []
    staged: list[list[StagedFile]] = []
    cost = ReadCost()
    side: SideState | None = None
    clock = PhaseClock(RESTORE_PHASES)
    what = f"restoring step {target}"
    reads: list[FileRead] = []
    try:
        with clock.time("plan"):
            path = store.step_path(target)
            shards = into.row_shards()
            chain = read_chain(store, target, lambda m: writer_ranks(m, shards))
            chain = named_as_model(chain, into, path)
            check_model_matches(into, chain[-1], path)
            failpoints.hit("restore.plan")
            reads = plan_reads(chain, shards)
    except Exception as exc:  # gathered below so that every rank raises
        error = as_error(RestoreError, exc, f"step {target}: rank {comm.rank}: reading failed")
    total = sum(r.planned_bytes for r in reads)
    threads = 1
    try:
        if error is None:
            threads = _threads(into, total, chain)
            show = comm.rank == 0 and (
                progress if progress is not None else total >= PROGRESS_MIN_BYTES and _tty()
            )
            failpoints.hit("restore.fetch")
            staged, cost = stage(
                store, len(chain), reads, threads=threads, progress=show, clock=clock
            )
            failpoints.hit("restore.side_state")
            side = read_side_state(into, chain[-1])
            cost.other_bytes += side.bytes_read
    except Exception as exc:  # gathered below so that every rank raises
        error = as_error(RestoreError, exc, f"step {target}: rank {comm.rank}: reading failed")
    # The side state first: it runs user code (statefuls) and optimizer loading, and rolls back
    # on failure; the rows, verified and matched already, are applied last. On the world size
    # that wrote it, each rank loads its own before the ranks agree, and puts it back if any
    # rank failed: one agreement for both, not one each (each cost 1-2 ms by median on the
    # 2-core machine of benchmarks/results/), and a rank loads it while another still reads.
    prior: PriorState | None = None
    if error is None and side is not None and not shared_by_rank0(into, side):
        try:
            prior = load_side_state(into, side)
        except Exception as exc:  # its own error, as a failure of the dense state raises
            error = exc
    try:
        comm.check(error, what, RestoreRankError)
        assert side is not None  # read above, or every rank raised
        if shared_by_rank0(into, side):  # onto another world size: rank 0's, then loaded
            share_side_state(into, side)
            apply_side_state(into, side)
    except BaseException:
        if prior is not None:
            roll_back_side_state(into, prior)
        release([file for files in staged for file in files])
        raise
    del prior  # its copies of the dense state, not held while the rows are applied
    stage_seconds = time.perf_counter() - started

    # A failure while applying the rows (after every byte verified: a bug, or memory) leaves
    # the model partly loaded, raises on every rank, and the Checkpointer's next save is a full.
    written = []
    try:
        failpoints.hit("restore.apply")
        # No cached row may shadow a restored one, nor be written back over it later.
        kernel_cache.drop_cached_rows(into.sharded.caching)
        written = apply_staged(staged, threads, clock)
    except Exception as exc:
        error = as_error(
            RestoreError, exc, f"step {target}: rank {comm.rank}: applying the rows failed"
        )
        release([file for files in staged for file in files])
    del staged
    with clock.time("apply"):
        trim_heap()  # the decode buffers' pages, kept by the allocators otherwise (heap.py)
    comm.check(error, what, RestoreRankError)
    for reason in side.skipped:
        log.warning("restore of step %d: not restored: %s", target, reason)
    result = RestoreResult(
        manifest=chain[-1],
        chain=tuple(m.step for m in chain),
        cost=cost,
        seconds=time.perf_counter() - started,
        stage_seconds=stage_seconds,
        skipped=tuple(side.skipped),
        diff_rows=_rows_by_block(written),
        phases=clock.seconds(),
        unused_statefuls=tuple(side.unused_statefuls),
    )
    log.info(
        "restored step %d (chain %s) in %.3f s: read %.1f MB of rows files for %.1f MB needed",
        target,
        result.chain,
        result.seconds,
        cost.bytes_read / 1e6,
        cost.bytes_needed / 1e6,
    )
    return result


def _rows_by_block(written: Sequence[WrittenRows]) -> tuple[tuple[str, torch.Tensor], ...]:
    """The rows the chain's diffs wrote, one array per block (its files' runs joined): the
    caller marks each in its tracker, one call per block rather than per file and column
    segment (a 32-table model's 10-link chain marked 32 runs per link, 0.2 ms)."""
    runs: dict[str, list[np.ndarray]] = {}
    for w in written:
        if w.from_diff:
            runs.setdefault(w.shard.key, []).append(listed(w.local_rows))
    return tuple(
        (key, torch.as_tensor(rows[0] if len(rows) == 1 else np.concatenate(rows)))
        for key, rows in runs.items()
    )


def _share_choice(
    comm: Collective, choice: tuple[int | None, str | None, str | None]
) -> tuple[int | None, str | None, str | None]:
    """Rank 0's ``choice`` (step, why it is missing, why none could be listed) on every rank:
    the step as a number, and the messages, pickled, only when there is one (every restore
    agrees on its step; few fail to)."""
    step, missing, unlisted = choice
    reason = missing is not None or unlisted is not None
    sent, found, failed = comm.broadcast_numbers(
        [float(step or 0), float(step is not None), float(reason)]
    )
    if failed:
        return comm.broadcast(choice)
    return (int(sent) if found else None), None, None


def _threads(into: RestoreTarget, planned: int, chain: list[Manifest]) -> int:
    """This rank's reader threads: as asked (``RestoreTarget.threads``), else its share of the
    cores plus what the other ranks of its host leave idle while it restores more than they do
    (``cores.balanced_restore_threads``, fed by :func:`host_work`); from a store that is not a
    local disk, where threads wait on the network, :func:`~embckpt.cores.restore_threads`.

    Why not exchange the planned bytes: one collective more in every restore, each cost 1-2 ms
    by median on the 2-core machine of ``benchmarks/results/`` (2 gloo ranks; a 4-bit full of
    ``benchmarks/family.py``'s dim128 model restored in 28.6 ms by median without it, 30.7 ms
    with it, interleaved in the training processes), and the manifests tell what each writer
    rank wrote."""
    if into.threads is not None:
        return into.threads
    if not into.store.is_local:
        return restore_threads()
    mine, others = host_work(chain, into.comm.rank, into.comm.world_size, local_ranks(), planned)
    return balanced_restore_threads(mine, others)


def host_work(
    chain: Sequence[Manifest], rank: int, world_size: int, host: int, planned: int
) -> tuple[float, list[float]]:
    """Bytes this rank and each other rank of its host (``host`` ranks each) restore, as the
    chain's manifests tell: onto the world size that wrote every link (which restores each
    writer rank's blocks on the same rank, unless the plan changed), what each writer rank
    wrote along the chain (``PartEntry.files_bytes``); else ``planned`` for this rank, and an
    even share of the rest of the chain's bytes for each other rank."""
    first = rank - rank % host
    peers = [r for r in range(first, min(first + host, world_size)) if r != rank]
    if all(m.world_size == world_size and m.parts for m in chain):
        wrote = [0.0] * world_size
        for manifest in chain:
            for part in manifest.parts:
                wrote[part.rank] += part.files_bytes
        return wrote[rank], [wrote[r] for r in peers]
    rest = max(0.0, sum(m.total_bytes for m in chain) - planned)
    return float(planned), [rest / max(world_size - 1, 1)] * len(peers)


def _tty() -> bool:
    import sys

    return sys.stderr.isatty()
