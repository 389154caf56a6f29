"""Eight real ranks (gloo on loopback): a chain saved by 8, restored exactly on 8 (each rank
reading its own part and the replicas' writer's, no other), resharded onto 3 and 5, and a
failure on one rank during a commit that every rank agrees on (issue 40)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import toy_model as tm
from shard_compare import assemble, blocks, compare, differences, state_numpy

from embckpt.examples.launcher import run_ranks
from embckpt.storage.chain import read_manifest
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import MANIFEST_NAME

KINDS = ("tw", "rw", "twrw", "dp")  # column-wise needs more columns than 8 ranks share
STEPS = (2, 4, 6)  # full, diff, diff (incremental)
FAILED_STEP = 8
HOT = 40


def _config() -> Any:
    from embckpt import CheckpointConfig

    return CheckpointConfig(policy="incremental", full_every=0, row_group_rows=16)


def _save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Saves the chain, then a save that rank 5 fails at its commit; what each rank saw."""
    from embckpt import Checkpointer, failpoints
    from embckpt.errors import SaveError

    model, opt = tm.build(world_size, seed=0, kinds=KINDS)
    out: dict[str, Any] = {}
    with Checkpointer(model, root, optimizer=opt, config=_config()) as ckpt:
        for step in range(1, STEPS[-1] + 1):
            tm.train_step(model, opt, step, rank, kinds=KINDS, hot=HOT)
            if step in STEPS:
                ckpt.save(step).wait()
        out["at_save"] = blocks(model, opt, rank)
        out["state"] = state_numpy(model, opt, rank)
        tm.train_step(model, opt, STEPS[-1] + 1, rank, kinds=KINDS, hot=HOT)
        out["continued"] = state_numpy(model, opt, rank)
        if rank == 5:
            failpoints.arm("save.agree")  # after its files, before the ranks agree
        try:
            ckpt.save(FAILED_STEP).wait()
            out["failed"] = None
        except SaveError as exc:
            out["failed"] = type(exc).__name__
        finally:
            failpoints.disarm()
        out["committed"] = ckpt.store.committed_steps()
    return out


def _continues_alike(a: dict[str, np.ndarray], b: dict[str, np.ndarray], rank: int) -> None:
    """One step after the restore, the tables and their optimizer state (``w:``, ``s:``) equal
    the writer's bit for bit; dense parameters and their optimizer state (``d:``, ``o:``) to
    float rounding: DDP averages their gradients in buckets that a fresh DDP lays out unlike
    one that already ran, and over 8 ranks gloo's sums then round differently (over 2, the
    sum of two values is the same either way, and 2-rank tests compare them exactly)."""
    assert sorted(a) == sorted(b), rank
    for key in a:
        if key.startswith(("w:", "s:")):
            assert np.array_equal(a[key], b[key]), (rank, key)
        else:
            assert np.allclose(a[key], b[key], rtol=1e-5, atol=1e-7), (rank, key)


def _restore(rank: int, world_size: int, root: str, same_plan: bool) -> dict[str, Any]:
    """Restores the latest step into a differently seeded model of ``world_size`` ranks; on
    the writer's plan, trains one step on."""
    from embckpt import Checkpointer

    model, opt = tm.build(world_size, seed=100 + world_size, kinds=KINDS)
    with Checkpointer(model, root, optimizer=opt, config=_config()) as ckpt:
        result = ckpt.load()
        assert result is not None
        out: dict[str, Any] = {
            "step": result.manifest.step,
            "chain": result.chain,
            "parts": sorted(result.manifest.loaded or ()),
            "skipped": result.skipped,
            "side_bytes": result.cost.other_bytes,
            "blocks": blocks(model, opt, rank),
        }
        if same_plan:
            out["state"] = state_numpy(model, opt, rank)
            tm.train_step(model, opt, STEPS[-1] + 1, rank, kinds=KINDS, hot=HOT)
            out["continued"] = state_numpy(model, opt, rank)
    return out


def test_eight_ranks_save_restore_reshard_and_agree_on_a_failed_commit() -> None:
    with tempfile.TemporaryDirectory() as root:
        written = run_ranks(_save, 8, root, timeout_s=900)
        # The failed save: rank 5 raised its own error, the others one quoting it, and no
        # rank committed it.
        assert [w["failed"] for w in written] == [
            "SaveError" if r == 5 else "SaveRankError" for r in range(8)
        ]
        assert all(w["committed"] == list(STEPS) for w in written)
        # Objects per checkpoint: at most 2 per rank (its rank file, which indexes its rows,
        # and one packed rows file: its blocks share one layout) plus the manifest, the dense
        # file and rank 0's data-parallel table (a layout of its own: no fused state).
        store = CheckpointStore(root)
        for step in STEPS:
            files = {f.path for f in read_manifest(store, step).files}
            folder = Path(store.step_path(step))
            assert {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} == (
                files | {MANIFEST_NAME}
            )
            assert len(files) + 1 <= 2 * 8 + 3, (step, sorted(files))

        same = run_ranks(_restore, 8, root, True, timeout_s=900)
        for rank, r in enumerate(same):
            assert (r["step"], r["chain"]) == (STEPS[-1], STEPS), rank
            # Its own part, and rank 0's (the writer of the data-parallel table): no other.
            assert r["parts"] == sorted({0, rank}), (rank, r["parts"])
            assert differences(written[rank]["state"], r["state"]) == [], rank
            _continues_alike(written[rank]["continued"], r["continued"], rank)

        truth = assemble([w["at_save"] for w in written])
        dense_truth = written[0]["at_save"]["dense"]
        head = read_manifest(store, STEPS[-1])
        dense_bytes = sum(f.bytes for f in head.files if f.role == "dense")
        rank_bytes = sum(f.bytes for f in head.files if f.role == "rank")
        for world_size in (3, 5):
            onto = run_ranks(_restore, world_size, root, False, timeout_s=900)
            # Onto another world size, rank 0 alone reads every writer's rank file (statefuls).
            assert [r["side_bytes"] for r in onto] == [dense_bytes + rank_bytes] + [dense_bytes] * (
                world_size - 1
            ), world_size
            restored = [r["blocks"] for r in onto]
            assert compare(truth, restored, dense_truth) == [], world_size
            for r in onto:
                assert (r["step"], r["chain"]) == (STEPS[-1], STEPS), world_size
                assert len(r["parts"]) < 8, (world_size, r["parts"])  # not every writer's
