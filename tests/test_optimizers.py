"""The optimizers TorchRec users pass: a torch optimizer, ``KeyedOptimizerWrapper`` and
``CombinedOptimizer([dmp.fused_optimizer, dense])`` save and restore (in a fresh process, into
optimizers without state yet), and a restore that fails while applying leaves every rank's
model, optimizers, RNG and statefuls bit-identical to before (2 gloo ranks)."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
import toy_model as tm

from embckpt.examples.launcher import run_ranks

KINDS = ("torch", "keyed", "combined")


class Counter:
    """A stateful whose ``load_state_dict`` can be told to fail on one rank, after changing."""

    def __init__(self, fail_on_rank: int | None = None) -> None:
        self.value = 0
        self.fail_on_rank = fail_on_rank

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = int(state["value"])
        if self.fail_on_rank == torch.distributed.get_rank():
            raise RuntimeError("injected stateful failure")


def _build(kind: str, world_size: int, seed: int):
    """The model and (what the Checkpointer gets, the dense Adam part) for ``kind``."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    model, _ = tm.build(world_size, seed)
    params = dict(in_backward_optimizer_filter(model.named_parameters()))
    if kind == "torch":
        dense = torch.optim.Adam(list(params.values()), lr=0.01)
        return model, dense, dense
    dense = KeyedOptimizerWrapper(params, lambda p: torch.optim.Adam(p, lr=0.01))
    if kind == "keyed":
        return model, dense, dense
    return model, CombinedOptimizer([model.fused_optimizer, dense]), dense


def _state(model, dense, rank: int, sampler, counter) -> dict[str, Any]:
    out = tm.snapshot_state(model, dense, rank)
    out["rng"] = torch.get_rng_state()
    out["sampler"] = torch.tensor(list(sampler.state_dict().values()))
    out["counter"] = torch.tensor(counter.value)
    return out


def _save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from embckpt import CheckpointConfig, Checkpointer, ConfigError, ResumableSampler

    model, _ = tm.build(world_size, seed=0)
    naive = torch.optim.SGD(model.parameters(), lr=0.1)  # the fused tables' weights too
    try:
        Checkpointer(model, f"{root}/refused", optimizer=naive)
        refused = ""
    except ConfigError as exc:
        refused = str(exc)
    saved: dict[str, Any] = {"refused": refused}
    for kind in KINDS:
        model, optimizer, dense = _build(kind, world_size, seed=0)
        sampler = ResumableSampler(640, tm.BATCH, rank=rank, world_size=world_size)
        counter = Counter()
        statefuls = {"data": sampler, "counter": counter}
        # A full at step 3, a diff at 6: dense Adam moves rows of the data-parallel table
        # that were not looked up (momentum), which the diff must still write.
        config = CheckpointConfig(policy="one_shot")
        with Checkpointer(
            model, f"{root}/{kind}", optimizer=optimizer, config=config, statefuls=statefuls
        ) as ckpt:
            for step in range(1, 9):
                next(sampler)
                counter.value = step
                tm.train_step(model, optimizer, step, rank, hot=60)
                if step % 3 == 0:
                    ckpt.save(step).wait()
                if step == 6:
                    state = tm.snapshot_state(model, dense, rank)
                    # numpy: tensors would go back through shared memory of an exited process
                    saved[kind] = {k: v.numpy() for k, v in state.items()}
    return saved


def _restore(rank: int, world_size: int, root: str, saved: list) -> dict[str, Any]:
    from embckpt import Checkpointer, ResumableSampler
    from embckpt.errors import EmbckptError

    out: dict[str, Any] = {"refused": saved[rank]["refused"]}
    for kind in KINDS:
        expected = {k: torch.from_numpy(v) for k, v in saved[rank][kind].items()}
        # A fresh optimizer has no state: the restore creates it, then loads it.
        model, optimizer, dense = _build(kind, world_size, seed=7)
        sampler = ResumableSampler(640, tm.BATCH, rank=rank, world_size=world_size)
        counter = Counter()
        with Checkpointer(
            model,
            f"{root}/{kind}",
            optimizer=optimizer,
            statefuls={"data": sampler, "counter": counter},
        ) as ckpt:
            restored = ckpt.restore()
        out[kind] = {
            "restored": restored,
            "diff": tm.differences(expected, tm.snapshot_state(model, dense, rank)),
            "position": sampler.position,
            "counter": counter.value,
        }

    # Failures injected while applying: a stateful raising on rank 0 (into a trained model
    # whose optimizers have state), and the dense optimizer raising on rank 1 after loading
    # part of its state (into a fresh one without state). Every rank must be left untouched.
    for case in ("stateful", "optimizer"):
        model, optimizer, dense = _build("combined", world_size, seed=3)
        sampler = ResumableSampler(640, tm.BATCH, rank=rank, world_size=world_size)
        counter = Counter(fail_on_rank=0 if case == "stateful" else None)
        if case == "stateful":
            for step in range(100, 104):
                next(sampler)
                tm.train_step(model, optimizer, step, rank)
            counter.value = 42
        else:
            load = dense.load_state_dict

            def failing_load(state: Any, load: Any = load) -> None:
                load(state)
                if rank == 1:
                    raise RuntimeError("injected optimizer failure")

            dense.load_state_dict = failing_load
        torch.manual_seed(1000 + rank)
        before = _state(model, dense, rank, sampler, counter)
        had_state = len(dense.state)
        with Checkpointer(
            model,
            f"{root}/combined",
            optimizer=optimizer,
            statefuls={"data": sampler, "counter": counter},
        ) as ckpt:
            try:
                ckpt.restore()
                raised = ""
            except (EmbckptError, RuntimeError) as exc:
                raised = str(exc)
        after = _state(model, dense, rank, sampler, counter)
        out[case] = {
            "raised": raised,
            "diff": tm.differences(before, after),
            "state_entries": (had_state, len(dense.state)),
        }
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as root:
        saved = run_ranks(_save, 2, root)
        return run_ranks(_restore, 2, root, saved)  # fresh processes: no optimizer state yet


@pytest.mark.parametrize("kind", KINDS)
def test_each_optimizer_kind_restores_bit_identically(results: list, kind: str) -> None:
    for rank, result in enumerate(results):
        got = result[kind]
        assert got["restored"] == 6, f"rank {rank}"
        assert got["diff"] == [], f"rank {rank}, {kind}: differs from step 6's state"
        assert (got["position"], got["counter"]) == (6, 6), f"rank {rank}, {kind}"


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("stateful", "injected stateful failure"),
        ("optimizer", "injected optimizer failure"),
    ],
)
def test_failed_restore_changes_nothing_on_any_rank(results: list, case: str, message: str) -> None:
    for rank, result in enumerate(results):
        got = result[case]
        assert got["raised"], f"rank {rank}: the restore did not fail"
        assert message in got["raised"], f"rank {rank}: {got['raised']}"
        assert got["diff"] == [], f"rank {rank}: changed by a failed restore: {got['diff']}"
        had, now = got["state_entries"]
        assert had == now, f"rank {rank}: optimizer state entries {had} -> {now}"


def test_constructor_refuses_an_optimizer_over_fused_tables(results: list) -> None:
    for rank, result in enumerate(results):  # tried by _save
        assert "fused optimizer already updates" in result["refused"], f"rank {rank}"


def test_constructor_refuses_what_it_cannot_save(tmp_path) -> None:
    from embckpt import Checkpointer
    from embckpt.errors import ConfigError

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="not an optimizer.*CombinedOptimizer"):
        Checkpointer(model, tmp_path / "a", optimizer=object())
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="not the model's"):
        Checkpointer(model, tmp_path / "b", optimizer=other)
    with pytest.raises(ConfigError, match="stateful 'data'.*state_dict"):
        Checkpointer(model, tmp_path / "c", statefuls={"data": object()})  # type: ignore[dict-item]
    assert not (tmp_path / "a").exists()
