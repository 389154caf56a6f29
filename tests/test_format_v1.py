"""Checkpoints in on-disk format v1 written by the code as it was before the reorganisation
(commit 4406621, see ``tests/fixtures/make_v1.py``) still verify, restore bit for bit into a
model of the current code, and a job restored from them saves the next checkpoint onto their
chain.

The fixture ``tests/fixtures/v1/`` holds two directories written by 2 ranks (steps 5 full, 10
and 15 diffs) and, per directory and rank, the state a restore of step 15 produced with the old
code (``<name>.expected_rank<rank>.safetensors``). Tests work on a copy of it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from embckpt.examples.launcher import run_ranks
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.verify import verify

FIXTURE = Path(__file__).parent / "fixtures" / "v1"
# As in make_v1.py: the toy DLRM with 96-row tables, batches from the first 80 rows.
ROWS = 96
HOT = 80
LAST = 15  # the fixture's latest step
NEXT = 16  # the step the restored job saves
# name -> (CheckpointConfig settings besides full_every=0, row_group_rows=64; step 16's parent).
# The quantized run writes whole-row diffs, as the old code did: delta diffs need the
# reconstruction of their base, which only a full of the running job provides, so with them
# the step after a restore is a full (tests/test_codec_checkpoints.py) and no longer a diff.
RUNS: dict[str, tuple[dict[str, Any], int]] = {
    "raw_one_shot": ({"policy": "one_shot", "codec": "raw"}, 5),
    "adaptive_incremental": (
        {
            "policy": "incremental",
            "codec": "adaptive",
            "bits": 4,
            "entropy": "huffman",
            "diff_deltas": False,
            "optimizer_codec": "raw",  # the fixture's: lossless state was the default then
        },
        15,
    ),
}


COLLECTION = "sparse_arch.embedding_bag_collection"  # the toy DLRM's module path


def _lossless(key: str) -> bool:
    """State a lossy row codec stores exactly: all but embedding weights (dp tables included)."""
    return not key.startswith("w:") and "embedding_bags" not in key


def _as_identities(expected: dict[str, Any]) -> dict[str, Any]:
    """The fixture's state keys, written when a block was keyed by its bare table name, keyed
    as blocks are now: by the table's identity, its collection's module path first."""
    return {
        f"{key[:2]}{COLLECTION}.{key[2:]}" if key[:2] in ("w:", "s:") else key: value
        for key, value in expected.items()
    }


def _restore_save_restore(rank: int, world_size: int, root: str) -> dict[str, dict[str, Any]]:
    import safetensors.torch
    import toy_model as tm

    from embckpt import CheckpointConfig, Checkpointer

    out: dict[str, dict[str, Any]] = {}
    for name, (settings, _) in RUNS.items():
        config = CheckpointConfig(**settings, full_every=0, row_group_rows=64)
        directory = f"{root}/{name}"
        saved = safetensors.torch.load_file(f"{root}/{name}.expected_rank{rank}.safetensors")
        expected = _as_identities(saved)
        model, opt = tm.build(world_size, seed=7, rows=ROWS)
        with Checkpointer(model, directory, optimizer=opt, config=config) as ckpt:
            restored = ckpt.restore()
            state = tm.snapshot_state(model, opt, rank)
            restore_diffs = tm.differences(state, expected)
            tm.train_step(model, opt, NEXT, rank, rows=ROWS, hot=HOT)
            ckpt.save(NEXT).wait()
        live = tm.snapshot_state(model, opt, rank)
        again, again_opt = tm.build(world_size, seed=8, rows=ROWS)
        with Checkpointer(again, directory, optimizer=again_opt, config=config) as ckpt:
            restored_again = ckpt.restore()
        reread = tm.snapshot_state(again, again_opt, rank)
        out[name] = {
            "restored": restored,
            "restore_diffs": restore_diffs,
            "restored_again": restored_again,
            "keys_differ": sorted(set(live) ^ set(reread)),
            "again_diffs": tm.differences(live, reread),
            "again_lossless_diffs": tm.differences(
                {k: v for k, v in live.items() if _lossless(k)},
                {k: v for k, v in reread.items() if _lossless(k)},
            ),
        }
    return out


def test_v1_fixture_restores_and_continues(tmp_path: Path) -> None:
    root = tmp_path / "v1"
    shutil.copytree(FIXTURE, root)
    for name in RUNS:
        store = CheckpointStore(root / name)
        assert store.committed_steps() == [5, 10, LAST], name
        report = verify(store)
        assert report.ok, (name, report.problems)
        assert report.checked == [5, 10, LAST] and not report.leftovers, (name, report)

    results = run_ranks(_restore_save_restore, 2, str(root))

    for name, (_, parent) in RUNS.items():
        for rank, result in enumerate(results):
            r = result[name]
            where = (name, rank)
            # (b) the old checkpoint restores into the new code exactly as the old code did
            assert r["restored"] == LAST, where
            assert r["restore_diffs"] == [], where
            # (c) the job saves step 16 onto the old chain, and that restores
            assert r["restored_again"] == NEXT, where
            assert r["keys_differ"] == [], where
            assert r["again_lossless_diffs"] == [], where
            if name == "raw_one_shot":  # lossless: the restore is the live state bit for bit
                assert r["again_diffs"] == [], where
        store = CheckpointStore(root / name)
        assert store.committed_steps() == [5, 10, LAST, NEXT], name
        report = verify(store)
        assert report.ok, (name, report.problems)
        manifest = json.loads(Path(store.step_path(NEXT, "MANIFEST.json")).read_text())
        assert (manifest["kind"], manifest["parent_step"], manifest["base_step"]) == (
            "diff",
            parent,
            5,
        ), name

    # the committed fixture is untouched: no lock, no new step
    assert not list(FIXTURE.rglob("LOCK"))
    assert not (FIXTURE / "raw_one_shot" / f"step_{NEXT:012d}").exists()
