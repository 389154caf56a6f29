"""The fused optimizer's state that is not per row, and optimizers that write rows no lookup
touched: training goes on after a restore exactly as if it had never stopped.

For every fused optimizer and weight decay mode FBGEMM runs on CPU, 2 gloo ranks train 12 steps
(a full checkpoint at step 3, diffs at 6 and 8); fresh processes that trained a little on their
own restore step 8 and train steps 9-12 again: weights, every optimizer state and FBGEMM's
counters must equal the run that never stopped, bit for bit, at step 8 and at step 12. EMA in
place rewrites every row of its tables, which the diffs must hold. Adam and LAMB, which FBGEMM
refuses on CPU, run the same scenario on a GPU (``gpu`` marker).
"""

from __future__ import annotations

import logging
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import toy_model as tm
from fbgemm_gpu.split_embedding_configs import EmbOptimType as Opt

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from locations import fbgemm_options as options  # noqa: E402
from locations import state_of  # noqa: E402

from embckpt.examples.launcher import run_ranks  # noqa: E402

KINDS = ("tw", "rw", "cw")
HOT = 60  # most rows are never looked up: diffs are partial
SAVES = (3, 6, 8)  # full, diff, diff
STEPS = 12


def _counter(mode: options.CounterWeightDecayMode) -> dict[str, Any]:
    return {
        "weight_decay": 0.01,
        "weight_decay_mode": options.WeightDecayMode.COUNTER,
        "counter_based_regularization": options.CounterBasedRegularizationDefinition(
            counter_weight_decay_mode=mode,
            counter_halflife=2,
            adjustment_iter=4,
            max_counter_update_freq=5,  # max_counter changes at steps 5 and 10
        ),
    }


def _decay(mode: options.WeightDecayMode) -> dict[str, Any]:
    return {"weight_decay": 0.01, "weight_decay_mode": mode}


# name -> (optimizer, extra FBGEMM options): every one FBGEMM runs on CPU.
CPU_CASES: dict[str, tuple[Opt, dict[str, Any]]] = {
    "sgd": (Opt.EXACT_SGD, {}),
    "adagrad_l2": (Opt.EXACT_ADAGRAD, _decay(options.WeightDecayMode.L2)),
    "adagrad_decouple": (Opt.EXACT_ADAGRAD, _decay(options.WeightDecayMode.DECOUPLE)),
    "rowwise_l2": (Opt.EXACT_ROWWISE_ADAGRAD, _decay(options.WeightDecayMode.L2)),
    "rowwise_decouple": (Opt.EXACT_ROWWISE_ADAGRAD, _decay(options.WeightDecayMode.DECOUPLE)),
    "rowwise_counter": (
        Opt.EXACT_ROWWISE_ADAGRAD,
        _counter(options.CounterWeightDecayMode.DECOUPLE),
    ),
    "rowwise_adagradw": (
        Opt.EXACT_ROWWISE_ADAGRAD,
        _counter(options.CounterWeightDecayMode.ADAGRADW),
    ),
    "rowwise_cowclip": (
        Opt.EXACT_ROWWISE_ADAGRAD,
        {
            "weight_decay": 0.01,
            "weight_decay_mode": options.WeightDecayMode.COWCLIP,
            "cowclip_regularization": options.CowClipDefinition(
                counter_weight_decay_mode=options.CounterWeightDecayMode.DECOUPLE,
                counter_halflife=2,
            ),
        },
    ),
    "ema": (
        Opt.EMAINPLACE_ROWWISE_ADAGRAD,
        {
            "emainplace_mode": options.EmainplaceModeDefinition(
                step_ema=3, step_start=0, step_ema_coef=0.5
            )
        },
    ),
}
GPU_CASES: dict[str, tuple[Opt, dict[str, Any]]] = {
    "adam": (Opt.ADAM, {}),
    "adam_decouple": (Opt.ADAM, _decay(options.WeightDecayMode.DECOUPLE)),
    "partial_rowwise_adam": (Opt.PARTIAL_ROWWISE_ADAM, {}),
    "lamb": (Opt.LAMB, {}),
    "partial_rowwise_lamb": (Opt.PARTIAL_ROWWISE_LAMB, {}),
    "rowwise_global_decay": (
        Opt.EXACT_ROWWISE_ADAGRAD,
        {
            "weight_decay": 0.01,
            "weight_decay_mode": options.WeightDecayMode.DECOUPLE_GLOBAL,
            "global_weight_decay": options.GlobalWeightDecayDefinition(start_iter=2),
        },
    ),
    "rowwise_counter": CPU_CASES["rowwise_counter"],
    "ema": CPU_CASES["ema"],
}


def _build(case: tuple[Opt, dict[str, Any]], world_size: int, seed: int, device: str):
    optimizer, fused = case
    return tm.build(world_size, seed, kinds=KINDS, optimizer=optimizer, fused=fused, device=device)


def _step(model, opt, step: int, rank: int, device: str) -> None:
    dense, kjt, labels = tm.batch(step, rank, KINDS, hot=HOT)
    opt.zero_grad()
    logits = model(dense.to(device), kjt.to(torch.device(device))).squeeze(-1)
    torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to(device)).backward()
    opt.step()


def _state(model, opt) -> dict[str, np.ndarray]:
    """Every row, optimizer state and dense tensor of this rank, and FBGEMM's counters with
    the host copy its steps use (numpy: it goes back to the parent process)."""
    return {k: v.numpy() for k, v in state_of(model, opt).items()}


def _train(rank: int, world_size: int, root: str, cases: dict, device: str) -> dict[str, Any]:
    """The run that never stopped: its state at the restored step and at the end."""
    from embckpt import CheckpointConfig, Checkpointer

    config = CheckpointConfig(policy="incremental", full_every=0)
    out: dict[str, Any] = {}
    for name, case in cases.items():
        model, opt = _build(case, world_size, 0, device)
        with Checkpointer(model, f"{root}/{name}", optimizer=opt, config=config) as ckpt:
            for step in range(1, STEPS + 1):
                _step(model, opt, step, rank, device)
                if step in SAVES:
                    ckpt.save(step).wait()
                if step == SAVES[-1]:
                    out[name] = {"saved": _state(model, opt)}
            out[name]["kinds"] = [h.kind for h in ckpt.head.history] if ckpt.head else []
        out[name]["end"] = _state(model, opt)
    return out


def _resume(
    rank: int, world_size: int, root: str, cases: dict, device: str, reference: list
) -> dict[str, Any]:
    """Fresh processes that trained on their own (FBGEMM's host counter is not 0 any more)
    restore the last step and train the same steps again."""
    from embckpt import Checkpointer

    out: dict[str, Any] = {}
    for name, case in cases.items():
        expected = reference[rank][name]
        model, opt = _build(case, world_size, 7, device)
        _step(model, opt, 101, rank, device)  # one step: off the EMA's phase (3) too
        with Checkpointer(model, f"{root}/{name}", optimizer=opt) as ckpt:
            restored = ckpt.restore()
        after_restore = _state(model, opt)
        for step in range(SAVES[-1] + 1, STEPS + 1):
            _step(model, opt, step, rank, device)
        out[name] = {
            "restored": restored,
            "after_restore": _differences(expected["saved"], after_restore),
            "after_steps": _differences(expected["end"], _state(model, opt)),
        }
    return out


def _differences(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[str]:
    """Keys that differ, with the largest difference."""
    out = []
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            out.append(f"{key}: on one side only")
        elif not np.array_equal(a[key], b[key]):
            gap = np.abs(a[key].astype(np.float64) - b[key].astype(np.float64)).max()
            out.append(f"{key}: differs by up to {gap:.3g}")
    return out


def _run(cases: dict, device: str, root: str) -> tuple[list, list, str]:
    world_size = 2 if device == "cpu" else min(torch.cuda.device_count(), 2)
    reference = run_ranks(_train, world_size, root, cases, device)
    return reference, run_ranks(_resume, world_size, root, cases, device, reference), root


@pytest.fixture(scope="module")
def cpu_runs() -> Iterator[tuple[list, list, str]]:
    """Each rank's reference and resumed results, and the checkpoints' directory."""
    with tempfile.TemporaryDirectory() as root:
        yield _run(CPU_CASES, "cpu", root)


@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_training_continues_exactly_after_a_restore(cpu_runs: tuple, case: str) -> None:
    reference, resumed, _ = cpu_runs
    for rank, result in enumerate(resumed):
        assert reference[rank][case]["kinds"] == ["full", "diff", "diff"]
        got = result[case]
        assert got["restored"] == SAVES[-1], f"rank {rank}"
        assert got["after_restore"] == [], f"rank {rank}, {case}: restored state differs"
        assert got["after_steps"] == [], f"rank {rank}, {case}: continuation differs"


def test_counters_are_saved(cpu_runs: tuple) -> None:
    """The scenario is not vacuous: FBGEMM counted the steps (on CPU, max_counter stays 1:
    FBGEMM updates it from the device copy of row_counter only)."""
    reference, _, _ = cpu_runs
    for rank, result in enumerate(reference):
        saved = result["rowwise_counter"]["saved"]
        iters = [v for k, v in saved.items() if k.endswith(":iter")]
        assert iters and all(v.tolist() == [SAVES[-1]] for v in iters), f"rank {rank}"


def _reshard(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Step 8 of the 2-rank counter run onto 1 rank under another plan: the counters too."""
    from embckpt import Checkpointer
    from embckpt.sharding import discover

    model, opt = tm.build(
        world_size,
        7,
        kinds=KINDS,
        fused=CPU_CASES["rowwise_counter"][1],
        sharding={"tw": "rw", "rw": "cw", "cw": "tw"},
    )
    with Checkpointer(model, f"{root}/rowwise_counter", optimizer=opt) as ckpt:
        ckpt.restore()
    return {
        str(k.blocks): {n: v.item() for n, v in k.counters().items()}
        | {"iter_cpu": k.module.iter_cpu.item()}
        for k in discover(model, rank).kernels
    }


def test_counters_restore_onto_another_world_size_and_plan(cpu_runs: tuple) -> None:
    reference, _, root = cpu_runs
    (kernels,) = run_ranks(_reshard, 1, root)
    max_counters = [
        v.item()
        for r in reference
        for k, v in r["rowwise_counter"]["saved"].items()
        if k.endswith(":max_counter")
    ]
    assert kernels
    for blocks, counters in kernels.items():
        assert counters["iter"] == counters["iter_cpu"] == SAVES[-1], blocks
        assert counters["max_counter"] in max_counters, blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_optimizers_continue_exactly_after_a_restore(tmp_path) -> None:
    """Adam, LAMB and their partial row-wise forms read FBGEMM's step counter for bias
    correction, global weight decay for its schedule; FBGEMM runs them only on GPUs."""
    reference, resumed, _ = _run(GPU_CASES, "cuda", str(tmp_path))
    saved = reference[0]["rowwise_counter"]["saved"]
    assert any(v.item() > 1 for k, v in saved.items() if k.endswith(":max_counter"))
    for rank, result in enumerate(resumed):
        for case, got in result.items():
            assert reference[rank][case]["kinds"] == ["full", "diff", "diff"], case
            assert got["after_restore"] == [], f"rank {rank}, {case}: restored state differs"
            assert got["after_steps"] == [], f"rank {rank}, {case}: continuation differs"


# -- restoring the counters, unit by unit ---------------------------------------------------------
def _sharded(scalars: dict[str, torch.Tensor]):
    """A ShardedModel whose blocks hold these ``<table>/r<row>_c0/iter`` scalars."""
    from embckpt.sharding import ShardedModel, TableShard

    shards = []
    for key in scalars:
        table, block, _ = key.split("/")
        row = int(block[1 : block.index("_")])
        shards.append(
            TableShard(table, f"ebc.{table}.weight", "rw", row, 0, 4, 2, torch.zeros(2, 2))
        )
    return ShardedModel(
        shards=shards,
        table_shapes={},
        table_dtypes={},
        sharding_types={},
        placements={},
        table_keys=set(),
        scalar_states=scalars,
    )


def _items(values: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: v.item() for k, v in values.items()}


def test_saved_counters_are_found_for_each_block(caplog) -> None:
    from embckpt.read.side_state import fused_scalar_values

    shared = torch.zeros(1, dtype=torch.int64)  # one kernel's counter, held by a and b
    live = _sharded(
        {"a/r0_c0/iter": shared, "b/r0_c0/iter": shared, "c/r0_c0/iter": torch.zeros(1)}
    )
    same_plan = {"a/r0_c0/iter": torch.tensor([8]), "b/r0_c0/iter": torch.tensor([8])}
    assert _items(fused_scalar_values(live, same_plan)) == {"a/r0_c0/iter": 8, "b/r0_c0/iter": 8}
    # Another plan: a's block is new, so it takes its table's saved blocks; the kernel that it
    # shares with b gets the largest value, with a warning.
    other = {"a/r2_c0/iter": torch.tensor([9]), "a/r0_c4/iter": torch.tensor([7])}
    with caplog.at_level(logging.WARNING):
        values = fused_scalar_values(live, {**other, "b/r0_c0/iter": torch.tensor([8])})
    assert _items(values) == {"a/r0_c0/iter": 9, "b/r0_c0/iter": 9}
    assert "different values [7, 8, 9]" in caplog.text
    # Older writers keyed rank 0's tables by their weight's name; nothing saved: left out.
    legacy = {"ebc.c.weight/iter": torch.tensor([5.0])}
    assert _items(fused_scalar_values(live, legacy)) == {"c/r0_c0/iter": 5.0}
    assert fused_scalar_values(live, {}) == {}


def test_a_background_copy_holds_back_a_kernel_that_rewrites_every_row() -> None:
    """EMA in place rewrites rows in the kernel's forward: under ``pipeline="full"`` that
    forward waits for the copy of the checkpoint's rows, like the backward does."""
    from embckpt.save.guards import UpdateGuard

    kernel = torch.nn.Linear(2, 2)
    guard = UpdateGuard(torch.nn.Linear(2, 2), None, [kernel])
    guard.hold()
    forward = threading.Thread(target=kernel, args=(torch.ones(1, 2),))
    forward.start()
    forward.join(0.2)
    assert forward.is_alive(), "the forward ran during the copy"
    guard.release()
    forward.join(5)
    assert not forward.is_alive()
    guard.close()
