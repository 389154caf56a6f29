"""Exact on every kernel location: a restore into a job that has already trained, rollbacks
(``restore(step)``, ``discard_newer``), then training on, give bit for bit what a fresh job
restoring the same step gives, and what the writer meant the step to hold
(``benchmarks/locations.py`` runs the scenario; ``benchmarks/gpu.py`` runs every optimizer).

On a GPU (``gpu`` marker) the tables sit in HBM, in UVM and in UVM behind FBGEMM's cache, whose
cached rows a restore must neither leave shadowing the restored ones nor let be written back
over them. On CPU FBGEMM keeps tables in host memory only (``fused``). Kernels embckpt cannot
checkpoint exactly are refused when the Checkpointer is built.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

import locations  # noqa: E402

from embckpt.examples.launcher import run_ranks  # noqa: E402


def _run(
    device: str, optimizers: tuple[str, ...], without_fix: bool = False, more: tuple = ()
) -> list[dict]:
    selected = locations.cases(device, optimizers) + list(more)
    with tempfile.TemporaryDirectory() as root:
        (results,) = run_ranks(locations.run_cases, 1, selected, root, device, without_fix)
    return results


def _assert_exact(results: list[dict]) -> None:
    for result in results:
        assert "error" not in result, result
        assert result["kinds"] == ["full", "diff", "diff"], result["case"]
        failed = {check: found for check, found in result["checks"].items() if found}
        assert not failed, f"{result['case']}: {failed}"


def test_restores_into_a_trained_job_and_rollbacks_are_exact_on_cpu() -> None:
    results = _run("cpu", ("rowwise_adagrad",))
    assert {r["case"] for r in results} == {
        "rowwise_adagrad/fused/raw",
        "rowwise_adagrad/fused/adaptive4",
    }
    _assert_exact(results)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_location_is_exact_on_a_gpu() -> None:
    ema_cached = locations.Case("ema_rowwise_adagrad", "fused_uvm_caching", "raw")
    results = _run("cuda", ("rowwise_adagrad", "adam"), without_fix=True, more=(ema_cached,))
    refused = results.pop()
    # FBGEMM's EMA in place rewrites UVM behind the cache: training on after a restore cannot
    # match training on without one, so the Checkpointer refuses it, naming the table.
    assert refused["error"].startswith("ConfigError: table "), refused
    assert "EMAINPLACE_ROWWISE_ADAGRAD on fused_uvm_caching" in refused["error"]
    assert len(results) == 2 * len(locations.LOCATIONS) * len(locations.CODECS)
    _assert_exact(results)
    for result in results:
        if result["location"] == "fused_uvm_caching":
            # Not vacuous: the trained job's cache held rows, and restoring with the cache
            # left as it was gives other values.
            assert result["cached_rows_before_restore"] > 0, result["case"]
            assert not result["without_fix"]["exact"], result["case"]


# -- kernels refused ------------------------------------------------------------------------
def _refused(rank: int, world_size: int, root: str) -> list[str]:
    import toy_model as tm

    from embckpt import Checkpointer, ConfigError

    messages = []
    model, opt = tm.build(world_size, 0, kinds=("tw", "rw"))
    plan = model.plan.plan[tm.COLLECTION]
    plan["t_rw"].compute_kernel = "key_value"  # as a plan for an SSD-backed table says
    try:
        Checkpointer(model, f"{root}/a", optimizer=opt)
    except ConfigError as exc:
        messages.append(str(exc))
    plan["t_rw"].compute_kernel = "fused"

    class SSDTableBatchedEmbeddingBags(torch.nn.Module):
        """Stands in for a key-value kernel's FBGEMM module."""

        def flush(self) -> None:  # TorchRec's state_dict flushes its kernels
            pass

    from embckpt.sharding import collection_kernels

    _, batched = next(collection_kernels(model))
    batched._emb_module = SSDTableBatchedEmbeddingBags()
    try:
        Checkpointer(model, f"{root}/b", optimizer=opt)
    except ConfigError as exc:
        messages.append(str(exc))
    return messages


def test_kernels_it_cannot_checkpoint_exactly_are_refused_by_table(tmp_path) -> None:
    (messages,) = run_ranks(_refused, 1, str(tmp_path))
    assert len(messages) == 2, messages
    assert f"table {locations.COLLECTION}.t_rw: compute kernel 'key_value'" in messages[0]
    assert "SSDTableBatchedEmbeddingBags" in messages[1]
    assert f"{locations.COLLECTION}.t_" in messages[1]
