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


# -- FBGEMM's cache contract, on CPU ---------------------------------------------------------
class _CachedRow:
    """FBGEMM's caching contract on one row of a CPU table: the row's newest value sits in the
    cache and reaches the table only at ``flush`` (or an eviction, which writes the same way);
    ``reset_cache_states`` drops it unwritten. What a prefetch left for the next forward is
    there too."""

    def __init__(self, weight: torch.Tensor, row: int, value: torch.Tensor) -> None:
        self.weight, self.row, self.cached = weight, row, value
        self.lxu_cache_weights = torch.ones(1)  # non-empty: a caching kernel
        self.timesteps_prefetched = [3]
        self.lxu_cache_locations_list = [torch.zeros(4, dtype=torch.int32)]
        self.lxu_cache_locking_counter = torch.ones(2, 32, dtype=torch.int32)

    @torch.no_grad()
    def flush(self) -> None:
        if self.cached is not None:
            self.weight[self.row] = self.cached

    def reset_cache_states(self) -> None:
        self.cached = None


def _cache_contract(rank: int, world_size: int, root: str) -> dict[str, bool]:
    import toy_model as tm

    from embckpt import CheckpointConfig, Checkpointer

    model, opt = tm.build(world_size, 0, kinds=("tw",))
    tm.train_step(model, opt, 1, rank)
    with Checkpointer(model, root, optimizer=opt, config=CheckpointConfig(policy="full")) as ckpt:
        weight = ckpt.sharded.shards[0].weight
        newest = weight[3].detach() + 1.0  # the cache holds a newer row 3 than the table
        cache = _CachedRow(weight, 3, newest.clone())
        ckpt.sharded.caching.append(cache)
        ckpt.save(1).wait()
        with torch.no_grad():
            weight[3] = 0.0  # training moves on: the table and the cache change
        cache.cached = torch.full_like(newest, -5.0)
        ckpt.restore(1)
        restored = torch.equal(weight[3], newest)
        cache.flush()  # a later flush or eviction
        kept = torch.equal(weight[3], newest)
    return {
        "saved_the_cached_value": restored,
        "no_stale_row_written_back": kept,
        "prefetch_forgotten": not cache.timesteps_prefetched
        and not cache.lxu_cache_locations_list
        and not bool(cache.lxu_cache_locking_counter.any()),
    }


def test_a_caching_kernel_is_flushed_before_a_save_and_emptied_before_a_restore(
    tmp_path,
) -> None:
    """On CPU, where FBGEMM has no cache, a stand-in keeps its contract: the save reads the
    cached value (flushed first), and after the restore no stale cached row shadows or
    overwrites the restored one."""
    (found,) = run_ranks(_cache_contract, 1, str(tmp_path))
    assert found == {
        "saved_the_cached_value": True,
        "no_stale_row_written_back": True,
        "prefetch_forgotten": True,
    }
