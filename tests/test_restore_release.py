"""A restore and a close keep nothing alive: no staged file, thread, hook, process group, or
reference to the checkpointer or the model (2 gloo ranks).

What a process that restores again and again would otherwise collect (issue 22, part 4; the
resident memory itself is measured in benchmarks/restore_memory.py)."""

from __future__ import annotations

import gc
import tempfile
import threading
import weakref

import toy_model as tm

from embckpt.examples.launcher import run_ranks


def _hooks(model) -> int:
    """Hooks registered on the model's modules."""
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        for m in model.modules()
    )


def _groups() -> int:
    import torch.distributed as dist

    return len(dist.distributed_c10d._world.pg_map)


def _restore_releases(rank: int, world_size: int, root: str) -> dict:
    import embckpt.read.restore as restore_module
    from embckpt import CheckpointConfig, Checkpointer

    # What the fork server preloaded stays out of the collections below (0.2 s each otherwise);
    # everything this function makes is still collected.
    gc.freeze()
    config = CheckpointConfig(policy="incremental", full_every=0)
    model, opt = tm.build(world_size, seed=0)
    with Checkpointer(model, root, optimizer=opt, config=config) as ckpt:
        for step in range(1, 4):
            tm.train_step(model, opt, step, rank, hot=60)
            ckpt.save(step).wait()
    del model, opt, ckpt
    gc.collect()

    staged_refs: list[weakref.ref] = []
    apply_staged = restore_module.apply_staged

    def recording(by_position, *args, **kwargs):
        for files in by_position:
            staged_refs.extend(weakref.ref(f) for f in files)
            staged_refs.extend(weakref.ref(f.checked) for f in files)
        return apply_staged(by_position, *args, **kwargs)

    restore_module.apply_staged = recording  # type: ignore[assignment]
    try:
        out = []
        for threads in (1, 2):  # on the calling thread, and on worker threads
            fresh, fresh_opt = tm.build(world_size, seed=1)
            threads_before = {t.ident for t in threading.enumerate()}
            hooks_before, groups_before = _hooks(fresh), _groups()
            ckpt = Checkpointer(fresh, root, optimizer=fresh_opt, config=config)
            result = ckpt.load(threads=threads)
            assert result is not None and len(result.chain) == 3
            del result
            gc.collect()
            staged_alive = sum(r() is not None for r in staged_refs)
            ckpt.close()
            extra_threads = [t.name for t in threading.enumerate() if t.ident not in threads_before]
            hooks_left, groups_left = _hooks(fresh) - hooks_before, _groups() - groups_before
            ckpt_ref, model_ref = weakref.ref(ckpt), weakref.ref(fresh)
            del ckpt, fresh, fresh_opt
            gc.collect()
            out.append(
                {
                    "staged_files": len(staged_refs),
                    "staged_alive": staged_alive,
                    "extra_threads": extra_threads,
                    "hooks_left": hooks_left,
                    "groups_left": groups_left,
                    "checkpointer_alive": ckpt_ref() is not None,
                    "model_alive": model_ref() is not None,
                }
            )
            staged_refs.clear()
    finally:
        restore_module.apply_staged = apply_staged  # type: ignore[assignment]
    return {"runs": out}


def test_restore_and_close_keep_nothing_alive() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_restore_releases, 2, root)
    for rank, result in enumerate(results):
        for run in result["runs"]:
            assert run["staged_files"] > 0, (rank, run)
            assert run["staged_alive"] == 0, (rank, run)
            assert run["extra_threads"] == [], (rank, run)
            assert run["hooks_left"] == 0, (rank, run)
            assert run["groups_left"] == 0, (rank, run)
            assert not run["checkpointer_alive"], (rank, run)
            assert not run["model_alive"], (rank, run)
