"""Restore: read a checkpoint chain and load it into the live, sharded model, whatever world
size and sharding plan wrote it.

Stages (every rank, together):

1. choose  - rank 0 lists committed steps and broadcasts the one to restore;
2. chain   - read the manifests from the target back through its parents to the full base,
             each checking its own checksum; a missing link is named with what needs it;
3. match   - the model's tables (names, shapes, dtypes) must equal the checkpoint's;
4. stage   - (see :mod:`embckpt.read.reader`) each rank fetches, with its own threads, only the row
             groups of the chain's files that overlap its own blocks, and checks every byte
             it fetched; the dense and per-rank files are read whole and checked. Only the
             reader's own plan is needed: files are addressed by global rows and columns;
5. agree   - ranks exchange success; any failure raises on every rank before anything is
             loaded, so a failed restore never leaves a half-loaded model;
6. apply   - the dense state, RNG and stateful objects (:mod:`embckpt.read.side_state`),
             then decode and write the chain in order into this rank's blocks (delta codecs
             add). The result lists the rows the
             chain's diffs changed; the caller (``Checkpointer``) rebuilds its tracker from it.

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
  is logged and listed in :attr:`RestoreResult.skipped`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from embckpt import failpoints
from embckpt.dtypes import dtype_name
from embckpt.errors import (
    ChainIncompleteError,
    ModelMismatchError,
    RankError,
    RestoreError,
    RestoreRankError,
    as_error,
)
from embckpt.read.reader import (
    ReadCost,
    StagedFile,
    apply_staged,
    plan_reads,
    release,
    stage,
)
from embckpt.read.side_state import SideState, apply_side_state, read_side_state
from embckpt.read.target import RestoreTarget
from embckpt.storage.chain import read_chain
from embckpt.storage.fs import MANIFEST_NAME, CheckpointStore
from embckpt.storage.manifest import Manifest
from embckpt.storage.phases import RESTORE_PHASES, PhaseClock

log = logging.getLogger(__name__)

PROGRESS_MIN_BYTES = 256 << 20  # a progress bar only for restores reading more than this


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
        seconds: wall time of the whole restore; ``stage_seconds`` of plan + stage + agree.
        phases: busy seconds of this rank's plan, fetch, verify, decode and apply, each summed
            over the threads that worked in it (see ``PhaseClock``); ``plan`` includes reading
            the chain's manifests.
        skipped: per-rank state that was not restored, with the reason (world size changed).
        diff_rows: (block key, local rows) this rank restored from the chain's diffs: the rows
            that changed since the chain's full base (the caller's tracker marks them).
    """

    manifest: Manifest
    chain: tuple[int, ...]
    cost: ReadCost
    seconds: float
    stage_seconds: float
    skipped: tuple[str, ...]
    diff_rows: tuple[tuple[str, torch.Tensor], ...] = ()
    phases: dict[str, float] = field(default_factory=dict)


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
    started = time.perf_counter()
    comm, store = into.comm, into.store
    threads = into.threads
    choice: tuple[int | None, str | None, str | None] = (None, None, None)
    if comm.rank == 0:
        try:
            committed = store.committed_steps()
        except Exception as exc:  # broadcast: the other ranks must not wait for a choice
            choice = (None, None, f"cannot list the checkpoints of {store.uri}: {exc}")
        else:
            if step is None:
                choice = (committed[-1] if committed else None, None, None)
            elif step in committed:
                choice = (step, None, None)
            else:
                known = ", ".join(map(str, committed)) or "none"
                choice = (
                    None,
                    f"no committed checkpoint of step {step} in {store.uri} (committed: {known})",
                    None,
                )
    try:
        target, missing, unlisted = comm.broadcast(choice)
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
    try:
        with clock.time("plan"):
            chain = read_chain(store, target)
            check_model_matches(into, chain[-1], store.step_path(target))
            failpoints.hit("restore.plan")
            reads = plan_reads(chain, into.sharded.shards)
        total = sum(r.planned_bytes for r in reads)
        show = comm.rank == 0 and (
            progress if progress is not None else total >= PROGRESS_MIN_BYTES and _tty()
        )
        failpoints.hit("restore.fetch")
        staged, cost = stage(store, len(chain), reads, threads=threads, progress=show, clock=clock)
        failpoints.hit("restore.side_state")
        side = read_side_state(into, chain[-1], cost)
    except Exception as exc:  # gathered below so that every rank raises
        error = as_error(RestoreError, exc, f"step {target}: rank {comm.rank}: reading failed")
    try:
        comm.check(error, what, RestoreRankError)
    except BaseException:
        release([file for files in staged for file in files])
        raise
    stage_seconds = time.perf_counter() - started

    assert side is not None  # read above, or every rank raised
    # The side state first: it runs user code (statefuls) and optimizer loading, and rolls back
    # on failure; the rows, verified and matched already, are applied last. A failure while
    # applying them (after every byte verified: a bug, or memory) leaves the model partly
    # loaded, raises on every rank, and the Checkpointer's next save is a full.
    apply_side_state(into, side)
    applied = []
    try:
        failpoints.hit("restore.apply")
        applied = apply_staged(staged, threads, clock)
    except Exception as exc:
        error = as_error(
            RestoreError, exc, f"step {target}: rank {comm.rank}: applying the rows failed"
        )
        release([file for files in staged for file in files])
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
        diff_rows=tuple((p.shard.key, p.local_rows) for p in applied if p.from_diff),
        phases=clock.seconds(),
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


def _tty() -> bool:
    import sys

    return sys.stderr.isatty()


# -- the `embckpt restore` command ----------------------------------------------------------------
_RECIPE = """\
To resume a job from step {step}, run on every rank of the new job (any world size, any
sharding plan), after building the sharded model and its dense optimizer:

    import embckpt

    ckpt = embckpt.Checkpointer(
        dmp, {directory!r}, optimizer=dense_optimizer, config=config,
        statefuls={{"data": sampler}},  # the writer's statefuls (data position, schedulers)
    )
    step = ckpt.restore({step})  # collective; None on every rank if there is no checkpoint
    for step in range(step + 1, total_steps + 1):
        train_step(dmp, dense_optimizer, next(batches))
        ckpt.maybe_save(step)  # the next checkpoint continues this chain
    ckpt.close()

`ckpt.restore()` without a step takes the latest committed checkpoint. On another world size
the RNG streams are not restored, and a stateful is restored only if every writing rank saved
the same state for it and it accepts it (see the warnings the restore logs)."""


def describe_restore(directory: str, step: int | None = None) -> tuple[str, bool]:
    """What ``embckpt restore`` prints: the chain of ``step`` (the latest if None), whether
    every file of it verifies, and how to resume a job from it.

    Returns:
        The text, and whether the chain verified.

    Raises:
        ChainIncompleteError: no committed checkpoint, or a link of the chain is missing.
        CheckpointCorruptError: a manifest of the chain is damaged.
    """
    from embckpt.storage.verify import verify

    store = CheckpointStore(directory)
    chain = read_chain(store, step)
    step = chain[-1].step
    head = chain[-1]
    lines = [f"step {step} of {store.uri}: a chain of {len(chain)} checkpoint(s), base first"]
    for m in chain:
        rows = sum(1 for f in m.files if f.role == "rows")
        lines.append(
            f"  step {m.step}: {m.kind}, {rows} rows files, {m.total_bytes:,} bytes, "
            f"{m.rows_written:,} rows, written by {m.world_size} ranks, codec {m.codec.get('id')}"
        )
    lines.append(f"tables (as step {step}'s writer sharded them):")
    for t in head.tables:
        states = ", ".join(t.row_states + t.elem_states) or "none"
        lines.append(
            f"  {t.name}: {t.rows} x {t.cols} {t.dtype}, {t.sharding_type} in "
            f"{len(t.shards)} block(s), optimizer states: {states}"
        )
    report = verify(store, step)
    if report.ok:
        lines.append(f"verify: OK ({report.files_checked} files of steps {report.checked})")
    else:
        lines.append(f"verify: FAILED, {len(report.problems)} problem(s):")
        lines.extend(f"  BAD {path}: {reason}" for path, reason in report.problems)
    lines.extend(["", _RECIPE.format(step=step, directory=str(directory))])
    return "\n".join(lines), report.ok
