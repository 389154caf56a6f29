"""Lossless resume is bit-identical, for every policy, on every sharding type (2 gloo ranks)."""

from __future__ import annotations

import tempfile

import toy_model as tm

from embckpt.examples.launcher import run_ranks

POLICIES = ("full", "one_shot", "incremental")


def _resume_all_policies(rank: int, world_size: int, root: str) -> dict:
    from embckpt import CheckpointConfig, Checkpointer

    reference, ref_opt = tm.build(world_size, seed=0)
    for step in range(1, 31):
        tm.train_step(reference, ref_opt, step, rank, hot=60)
    expected = tm.snapshot_state(reference, ref_opt, rank)

    out: dict = {}
    for policy in POLICIES:
        directory = f"{root}/{policy}"
        config = CheckpointConfig(policy=policy, full_every=3)
        model, opt = tm.build(world_size, seed=0)
        with Checkpointer(model, directory, optimizer=opt, config=config) as ckpt:
            kinds = []
            for step in range(1, 23):  # "killed" at step 22, between checkpoints 20 and 25
                tm.train_step(model, opt, step, rank, hot=60)
                if step % 5 == 0:
                    manifest = ckpt.save(step).wait()
                    kinds.append((manifest.kind, manifest.parent_step, manifest.rows_written))
        fresh, fresh_opt = tm.build(world_size, seed=1234)  # different initial values
        with Checkpointer(fresh, directory, optimizer=fresh_opt, config=config) as ckpt:
            restored = ckpt.restore()
            for step in range(restored + 1, 31):
                tm.train_step(fresh, fresh_opt, step, rank, hot=60)
                if step % 5 == 0:
                    ckpt.save(step).wait()
        after_resume = tm.differences(expected, tm.snapshot_state(fresh, fresh_opt, rank))
        # The checkpoints written after the restore must themselves restore exactly.
        again, again_opt = tm.build(world_size, seed=99)
        with Checkpointer(again, directory, optimizer=again_opt, config=config) as ckpt:
            last = ckpt.restore()
        after_second = tm.differences(expected, tm.snapshot_state(again, again_opt, rank))
        out[policy] = {
            "kinds": kinds,
            "restored": restored,
            "last": last,
            "diff_resume": after_resume,
            "diff_second": after_second,
        }
    return out


def test_lossless_resume_is_bit_identical_for_every_policy() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_resume_all_policies, 2, root)
    for rank, per_policy in enumerate(results):
        for policy, result in per_policy.items():
            where = f"rank {rank}, policy {policy}"
            assert result["restored"] == 20, where
            assert result["last"] == 30, where
            assert result["diff_resume"] == [], f"{where}: differs after resume"
            assert result["diff_second"] == [], f"{where}: differs after second restore"
    kinds = {p: [k for k, _, _ in r["kinds"]] for p, r in results[0].items()}
    assert kinds["full"] == ["full"] * 4
    assert kinds["one_shot"] == ["full", "diff", "diff", "full"]
    assert kinds["incremental"] == ["full", "diff", "diff", "full"]
    parents = {p: [parent for _, parent, _ in r["kinds"]] for p, r in results[0].items()}
    assert parents["one_shot"] == [None, 5, 5, None]
    assert parents["incremental"] == [None, 5, 10, None]
    # Ids come from 60 of 240 rows: a diff writes far fewer rows than a full checkpoint.
    full_rows = results[0]["one_shot"]["kinds"][0][2]
    diff_rows = results[0]["one_shot"]["kinds"][1][2]
    assert diff_rows < full_rows / 2
