"""What ``embckpt restore`` prints: a checkpoint's chain, whether it verifies, and the code
that resumes a job from it (the command restores nothing itself: restoring needs the job's
model)."""

from __future__ import annotations

from embckpt.storage.chain import read_chain
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.verify import verify

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
    store = CheckpointStore(directory)
    chain = read_chain(store, step)
    step = chain[-1].step
    head = chain[-1]
    lines = [f"step {step} of {store.uri}: a chain of {len(chain)} checkpoint(s), base first"]
    for m in chain:
        rows = len({f.path for f in m.files if f.role == "rows"})  # a packed file holds several
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
