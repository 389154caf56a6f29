"""Every codec through a real 2-rank save and restore: weights come back within the codec's
error, optimizer state exactly; delta chains (``exponent``, and every quantizer's diffs) restore
exactly what the writer took its deltas against."""

from __future__ import annotations

import tempfile

import pytest
import torch
import toy_model as tm

from embckpt.examples.launcher import run_ranks

pytestmark = pytest.mark.slow(25)  # seconds here, on 2 cores: see conftest.py

CODECS = (
    ("fp16", None),
    ("bf16", None),
    ("symmetric", 4),
    ("asymmetric", 4),
    ("adaptive", 4),
    ("adaptive", 2),
    ("kmeans", 4),
    ("exponent", 3),
)


def _relative_error(expected: dict, got: dict) -> tuple[float, list[str]]:
    """Worst per-block mean relative row error of the weights; optimizer keys that differ."""
    worst, inexact = 0.0, []
    for key, value in expected.items():
        if key.startswith("w:"):
            rows = (got[key] - value).norm(dim=1) / value.norm(dim=1).clamp_min(1e-12)
            worst = max(worst, float(rows.mean()))
        elif key.startswith("s:") and not torch.equal(value, got[key]):
            inexact.append(key)
    return worst, inexact


def _each_codec(rank: int, world_size: int, root: str) -> dict:
    from embckpt import CheckpointConfig, Checkpointer

    out = {}
    for codec, bits in CODECS:
        for policy in ("one_shot", "incremental"):
            name = f"{codec}{bits or ''}-{policy}"
            # The row codec alone: optimizer state kept lossless (log8: test_state_codec.py).
            config = CheckpointConfig(
                policy=policy, full_every=0, codec=codec, bits=bits, optimizer_codec="raw"
            )
            model, opt = tm.build(world_size, seed=0)
            with Checkpointer(model, f"{root}/{name}", optimizer=opt, config=config) as ckpt:
                kinds = []
                for step in range(1, 9):
                    tm.train_step(model, opt, step, rank, hot=120)
                    if step % 2 == 0:
                        kinds.append(ckpt.save(step).wait().kind)
                # What the writer believes a restore reproduces (additive codecs only).
                reference = {
                    s.key: ckpt.writer.reference.rows(s.key, torch.arange(s.num_rows))
                    for s in ckpt.sharded.writer_shards()
                    if ckpt.codec.additive and policy == "incremental"
                }
            expected = tm.snapshot_state(model, opt, rank)
            fresh, fresh_opt = tm.build(world_size, seed=7)
            with Checkpointer(fresh, f"{root}/{name}", optimizer=fresh_opt, config=config) as c:
                restored = c.restore()
            got = tm.snapshot_state(fresh, fresh_opt, rank)
            error, inexact = _relative_error(expected, got)
            mismatched = [k for k, v in reference.items() if not torch.equal(got[f"w:{k}"], v)]
            out[name] = {
                "kinds": kinds,
                "restored": restored,
                "error": error,
                "inexact": inexact,
                "reference_checked": len(reference),
                "reference_mismatch": mismatched,
            }
    # Bits from expected restores: 2 bits while at most 1 restore happened, then 3.
    config = CheckpointConfig(policy="one_shot", codec="adaptive", expected_restores=1)
    model, opt = tm.build(world_size, seed=0)
    with Checkpointer(model, f"{root}/restores", optimizer=opt, config=config) as ckpt:
        manifests = []
        for step in (1, 2, 3):
            if step > 1:
                ckpt.restore()
            tm.train_step(model, opt, step, rank)
            manifests.append(ckpt.save(step).wait())
    out["widths"] = [m.codec["bits"] for m in manifests]
    out["kinds_after_restores"] = [m.kind for m in manifests]
    return out


# Mean relative row error a restore may show, per codec (4-bit unless named); measured here:
# fp16 2e-4, bf16 1.6e-3, symmetric 0.062, asymmetric 0.045, adaptive 0.041 (2 bits: 0.19),
# kmeans 0.046, exponent 0.07-0.19 (its 7 buckets per file span the deltas of a toy model whose
# updates are as large as its weights; its reconstruction is checked exactly below).
BOUNDS = {
    "fp16": 1e-3,
    "bf16": 1e-2,
    "symmetric4": 0.12,
    "asymmetric4": 0.08,
    "adaptive4": 0.07,
    "adaptive2": 0.3,
    "kmeans4": 0.07,
    "exponent3": 0.4,
}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    with tempfile.TemporaryDirectory() as root:
        return run_ranks(_each_codec, 2, root)


@pytest.mark.parametrize("codec", sorted(BOUNDS))
@pytest.mark.parametrize("policy", ["one_shot", "incremental"])
def test_codec_round_trips_through_a_sharded_checkpoint(results, codec: str, policy: str) -> None:
    for rank, out in enumerate(results):
        r = out[f"{codec}-{policy}"]
        assert r["restored"] == 8, rank
        assert r["kinds"] == ["full", "diff", "diff", "diff"], rank
        assert r["inexact"] == [], f"rank {rank}: optimizer state not lossless: {r['inexact']}"
        assert 0 < r["error"] <= BOUNDS[codec], (rank, r["error"])


@pytest.mark.parametrize("codec", ["exponent3", "adaptive4", "kmeans4", "symmetric4"])
def test_delta_chains_restore_exactly_what_the_writer_reconstructed(results, codec) -> None:
    for rank, out in enumerate(results):
        r = out[f"{codec}-incremental"]
        assert r["reference_checked"] > 0, rank
        assert r["reference_mismatch"] == [], rank


def test_bits_widen_as_restores_exceed_the_plan(results) -> None:
    # Planned 1 restore: 2 bits; after 1 restore, plan 2 -> 3 bits; after 2, plan 3 -> 3 bits.
    for out in results:
        assert out["widths"] == [2, 3, 3]


def test_delta_diffs_take_a_full_after_a_restore(results) -> None:
    # A restore leaves no reconstruction to take deltas against: the next save is a full.
    for out in results:
        assert out["kinds_after_restores"] == ["full", "full", "full"]


def _mixed_chain(rank: int, world_size: int, root: str) -> dict:
    """Full, one-shot, incremental, incremental, one-shot, incremental: a chain mixing both
    diff kinds (as ``intermittent`` with ``diffs: auto`` writes), with delta diffs."""
    from embckpt import CheckpointConfig, Checkpointer
    from embckpt.policy import POLICIES, Decision, DiffBase, Kind, Policy

    one_shot, incremental = DiffBase.LAST_FULL, DiffBase.PREVIOUS
    bases = [one_shot, incremental, incremental, one_shot, incremental]

    class Scripted(Policy):
        name = "test_mixed"
        mixes_diffs = True

        def _decide_diff(self, stats):  # type: ignore[no-untyped-def]
            return Decision(Kind.DIFF, base=bases[len(stats.history) - 1])

    POLICIES[Scripted.name] = Scripted
    config = CheckpointConfig(policy="test_mixed", full_every=0, codec="adaptive", bits=4)
    model, opt = tm.build(world_size, seed=0)
    with Checkpointer(model, f"{root}/mixed", optimizer=opt, config=config) as ckpt:
        manifests = []
        for step in range(1, 19):
            tm.train_step(model, opt, step, rank, hot=120)
            if step % 3 == 0:
                manifests.append(ckpt.save(step).wait())
        reference = {
            s.key: ckpt.writer.reference.rows(s.key, torch.arange(s.num_rows))
            for s in ckpt.sharded.writer_shards()
        }
    expected = tm.snapshot_state(model, opt, rank)
    fresh, fresh_opt = tm.build(world_size, seed=7)
    with Checkpointer(fresh, f"{root}/mixed", optimizer=fresh_opt, config=config) as c:
        c.restore()
    got = tm.snapshot_state(fresh, fresh_opt, rank)
    return {
        "parents": [m.parent_step for m in manifests],
        "chain_bytes": [m.stats["chain_bytes"] for m in manifests],
        "bytes": [m.total_bytes for m in manifests],
        "error": _relative_error(expected, got)[0],
        "mismatch": [k for k, v in reference.items() if not torch.equal(got[f"w:{k}"], v)],
    }


def test_a_chain_mixing_one_shot_and_incremental_deltas_restores_the_writers_state() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_mixed_chain, 2, root)
    for rank, r in enumerate(results):
        assert r["parents"] == [None, 3, 6, 9, 3, 15], rank
        b = r["bytes"]
        assert r["chain_bytes"] == [
            b[0],
            b[0] + b[1],
            b[0] + b[1] + b[2],
            sum(b[:4]),
            b[0] + b[4],
            b[0] + b[4] + b[5],
        ], rank
        assert r["mismatch"] == [], rank
        assert 0 < r["error"] <= BOUNDS["adaptive4"], rank
