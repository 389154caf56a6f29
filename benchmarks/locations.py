"""Exactness on every kernel location: one case is a fused optimizer, a compute kernel location
(``fused``: HBM or host memory, ``fused_uvm``, ``fused_uvm_caching``) and a codec (``raw`` or
a lossy one), run on one rank through the public API.

A case's scenario, every model a DLRM whose table-wise, row-wise and two-column-block tables
sit at the location (plus a data-parallel table):

1. the writer trains steps 1-12, saving at 4, 8 and 12 (full, diff, diff), keeps what each save
   means (``Checkpointer.reconstruction()``) and its live state, and trains on to step 16;
2. *fresh*: a model that never ran a step restores 12 and trains 13-16;
3. *trained*: a model that trained 3 steps on other data (FBGEMM's cache full of rows whose
   values differ from the checkpoint's) restores 12 and trains 13-16: it must equal *fresh* bit
   for bit after the restore and after training on;
4. *rollback*: the writer, its cache full again, restores 8 (``restore(8)``) and retrains 9-12:
   equal to a fresh restore of 8 that trains 9-12;
5. *discard_newer*: the writer trains on, restores 8 with ``discard_newer=True``, retrains 9-12
   saving at 10 and 12; a trained model restores the new 12: equal to what the writer meant;
6. with ``raw``, each restored state also equals the writer's live state at that step.

Every restored table block must equal what the writer meant its step to hold. States are read
after flushing FBGEMM's caches (``kernel_cache.flush``): the values a lookup would see. A case
the Checkpointer refuses (EMA in place on ``fused_uvm_caching``) or FBGEMM or TorchRec cannot
build is reported with its error.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType as Opt

try:  # FBGEMM's optimizer options (weight decay modes, EMA, ensemble, ...)
    from fbgemm_gpu.tbe.config import optimizer_config as fbgemm_options
except ImportError:  # fbgemm-gpu < 1.8 keeps them beside the kernel
    from fbgemm_gpu import split_table_batched_embeddings_ops_training as fbgemm_options

COLLECTION = "sparse_arch.embedding_bag_collection"
ROWS = 2000
DIM = 16
HOT = 600  # ids drawn from the first HOT rows: more than a 0.1 cache holds, far fewer than all
BATCH = 64
NUM_DENSE = 4
KINDS = ("tw", "rw", "cw", "dp")
SAVES = (4, 8, 12)
LOCATIONS = ("fused", "fused_uvm", "fused_uvm_caching")
CACHE_LOAD_FACTOR = 0.1

# name -> (FBGEMM optimizer, extra fused params); ``GPU_ONLY`` ones FBGEMM refuses on CPU.
OPTIMIZERS: dict[str, tuple[Opt, dict[str, Any]]] = {
    "sgd": (Opt.EXACT_SGD, {}),
    "adagrad": (Opt.EXACT_ADAGRAD, {}),
    "rowwise_adagrad": (Opt.EXACT_ROWWISE_ADAGRAD, {}),
    "adam": (Opt.ADAM, {}),
    "partial_rowwise_adam": (Opt.PARTIAL_ROWWISE_ADAM, {}),
    "lamb": (Opt.LAMB, {}),
    "partial_rowwise_lamb": (Opt.PARTIAL_ROWWISE_LAMB, {}),
    "lars_sgd": (Opt.LARS_SGD, {}),
    "ema_rowwise_adagrad": (
        Opt.EMAINPLACE_ROWWISE_ADAGRAD,
        {
            "emainplace_mode": fbgemm_options.EmainplaceModeDefinition(
                step_ema=3, step_start=0, step_ema_coef=0.5
            )
        },
    ),
    "ensemble_rowwise_adagrad": (
        Opt.ENSEMBLE_ROWWISE_ADAGRAD,
        {
            "ensemble_mode": fbgemm_options.EnsembleModeDefinition(
                step_ema=3, step_swap=5, step_ema_coef=0.5
            )
        },
    ),
}
GPU_ONLY = {"adam", "partial_rowwise_adam", "lamb", "partial_rowwise_lamb", "lars_sgd"}
GPU_ONLY |= {"ensemble_rowwise_adagrad"}
# codec -> its CheckpointConfig options: lossless, and the headline lossy codec. Incremental
# with no forced fulls: saves 8 and 12 are diffs.
CODECS: dict[str, dict[str, Any]] = {
    "raw": {"policy": "incremental", "full_every": 0},
    "adaptive4": {"policy": "incremental", "full_every": 0, "codec": "adaptive", "bits": 4},
}


@dataclasses.dataclass(frozen=True)
class Case:
    optimizer: str
    location: str
    codec: str

    @property
    def name(self) -> str:
        return f"{self.optimizer}/{self.location}/{self.codec}"


def cases(device: str, optimizers: tuple[str, ...] | None = None) -> list[Case]:
    """Every case that can run on ``device`` (``cpu``: FBGEMM's CPU kernels, location
    ``fused`` in host memory, no GPU-only optimizer)."""
    names = optimizers or tuple(OPTIMIZERS)
    locations = LOCATIONS if device == "cuda" else ("fused",)
    return [
        Case(opt, loc, codec)
        for opt in names
        if device == "cuda" or opt not in GPU_ONLY
        for loc in locations
        for codec in CODECS
    ]


# -- the model and its data -----------------------------------------------------------------
def build(case: Case, seed: int, device: torch.device) -> tuple[Any, Any]:
    """A one-rank DMP whose sharded tables sit at ``case.location``, and its dense optimizer."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import CacheParams, ShardingPlan
    from torchrec.models.dlrm import DLRM
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    torch.manual_seed(seed)
    tables = [
        EmbeddingBagConfig(
            name=f"t_{k}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f_{k}"]
        )
        for k in KINDS
    ]
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[16, DIM],
        over_arch_layer_sizes=[16, 1],
    )
    optimizer, extra = OPTIMIZERS[case.optimizer]
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": optimizer, "learning_rate": 0.05, **extra}
    )
    kernel = case.location
    generators = {
        "tw": table_wise(rank=0, compute_kernel=kernel),
        "rw": row_wise(compute_kernel=kernel),
        "cw": column_wise(ranks=[0, 0], compute_kernel=kernel),  # two column blocks
        "dp": data_parallel(),
    }
    plan = construct_module_sharding_plan(
        model.sparse_arch.embedding_bag_collection,
        {f"t_{k}": generators[k] for k in KINDS},
        sharder=sharder,
        local_size=1,
        world_size=1,
        device_type=device.type,
    )
    if kernel == "fused_uvm_caching":
        for k in KINDS:
            if k != "dp":
                plan[f"t_{k}"].cache_params = CacheParams(load_factor=CACHE_LOAD_FACTOR)
    dmp = DistributedModelParallel(
        model, device=device, plan=ShardingPlan({COLLECTION: plan}), sharders=[sharder]
    )
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    return dmp, torch.optim.Adagrad(list(dense.values()), lr=0.05)


def train(model: Any, opt: Any, step: int, device: torch.device) -> None:
    """Training step ``step`` on data drawn from ``step`` alone."""
    from torchrec import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(step * 7919)
    lengths = torch.randint(1, 5, (len(KINDS) * BATCH,), generator=gen)
    values = torch.randint(0, HOT, (int(lengths.sum()),), generator=gen)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f_{k}" for k in KINDS], values=values, lengths=lengths
    ).to(device)
    dense = torch.rand(BATCH, NUM_DENSE, generator=gen).to(device)
    labels = (torch.rand(BATCH, generator=gen) < 0.3).float().to(device)
    opt.zero_grad()
    logits = model(dense, kjt).squeeze(-1)
    torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()
    opt.step()


# -- reading and comparing states -----------------------------------------------------------
def state_of(model: Any, opt: Any) -> dict[str, torch.Tensor]:
    """CPU copies of every table block, optimizer state, FBGEMM counter (with its host copy),
    dense tensor and dense optimizer state, as a lookup would see them (caches flushed)."""
    from embckpt import kernel_cache
    from embckpt.sharding import discover

    sharded = discover(model)
    kernel_cache.flush(sharded.caching)
    out: dict[str, torch.Tensor] = {}
    for shard in sharded.shards:
        out[f"w:{shard.key}"] = shard.weight.detach().cpu().clone()
        for name, t in {**shard.row_states, **shard.elem_states}.items():
            out[f"s:{shard.key}:{name}"] = t.detach().cpu().clone()
    for kernel in sharded.kernels:
        for name, value in kernel.counters().items():
            out[f"c:{kernel.blocks}:{name}"] = value.detach().cpu().clone()
        out[f"c:{kernel.blocks}:iter_cpu"] = kernel.module.iter_cpu.detach().cpu().clone()
    for key, value in model.state_dict().items():
        if not hasattr(value, "local_shards"):
            out[f"d:{key}"] = value.detach().cpu().clone()
    for pid, state in opt.state_dict()["state"].items():
        for name, value in state.items():
            out[f"o:{pid}:{name}"] = torch.as_tensor(value).detach().cpu().clone()
    return out


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose tensors differ, with the largest difference (empty: bit for bit equal)."""
    out = []
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            out.append(f"{key}: on one side only")
        elif a[key].shape != b[key].shape or not torch.equal(a[key], b[key]):
            gap = (a[key].double() - b[key].double()).abs().max().item()
            out.append(f"{key}: differs by up to {gap:.3g}")
    return out


def meant(reconstruction: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The writer's reconstruction in :func:`state_of`'s keys (tables only)."""
    out = {}
    for block, values in reconstruction.items():
        for name, value in values.items():
            key = f"w:{block}" if name == "weight" else f"s:{block}:{name.split(':', 1)[1]}"
            out[key] = value.detach().cpu().clone()
    return out


def tables_differ(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """Differences of ``state``'s table entries from ``expected`` (fp32 reconstruction)."""
    return differences({k: state[k].float() for k in expected if k in state}, expected)


def cached_rows(model: Any) -> int:
    """Rows FBGEMM's caches of ``model`` hold now."""
    from embckpt.sharding import discover

    return sum(int((k.lxu_cache_state != -1).sum()) for k in discover(model).caching)


# -- the scenario ---------------------------------------------------------------------------
def _other_data(model: Any, opt: Any, device: torch.device) -> None:
    """Three steps on data no other model sees: the cache fills with rows of other values."""
    for step in (101, 102, 103):
        train(model, opt, step, device)


def _restored(
    case: Case, root: str, device: torch.device, step: int, trained: bool, then: range
) -> tuple[dict, dict, int]:
    """A new model (trained on other data first, or fresh) restores ``step`` of ``root`` and
    trains steps ``then``: its state after the restore, after training, and the rows its
    caches held before the restore."""
    from embckpt import Checkpointer

    model, opt = build(case, 7, device)
    if trained:
        _other_data(model, opt, device)
    cached = cached_rows(model)
    with Checkpointer(model, root, optimizer=opt) as other:
        other.restore(step)
    after = state_of(model, opt)
    for s in then:
        train(model, opt, s, device)
    return after, state_of(model, opt), cached


def run_case(
    case: Case, root: str, device: torch.device, without_fix: bool = False
) -> dict[str, Any]:
    """Runs :data:`case`'s scenario (module docstring) in checkpoint directory ``root``.

    Returns the differences found by check (empty lists: exact) and what was exercised:
    checkpoint kinds, rows cached before the trained restore. ``without_fix`` also restores
    into a trained model with FBGEMM's cache left as it was (the behaviour before
    ``kernel_cache``), to show the scenario detects it.
    """
    from embckpt import CheckpointConfig, Checkpointer

    started = time.perf_counter()
    config = CheckpointConfig(**CODECS[case.codec])
    lossless = case.codec == "raw"
    out: dict[str, Any] = {"case": case.name, **dataclasses.asdict(case)}
    checks: dict[str, list[str]] = {}
    meant_at: dict[int, dict[str, torch.Tensor]] = {}
    live: dict[int, dict[str, torch.Tensor]] = {}

    def restored(step: int, trained: bool, then: range) -> tuple[dict, dict, int]:
        return _restored(case, root, device, step, trained, then)

    writer, wopt = build(case, 0, device)
    ckpt = Checkpointer(writer, root, optimizer=wopt, config=config)
    try:
        ckpt.track_reconstruction()
        for step in range(1, 17):
            train(writer, wopt, step, device)
            if step in SAVES:
                ckpt.save(step).wait()
                meant_at[step] = meant(ckpt.reconstruction())
                live[step] = state_of(writer, wopt)
        live[16] = state_of(writer, wopt)
        out["kinds"] = [h.kind for h in ckpt.head.history] if ckpt.head else []

        fresh12, fresh16, _ = restored(12, False, range(13, 17))
        trained12, trained16, out["cached_rows_before_restore"] = restored(12, True, range(13, 17))
        fresh8, fresh8_12, _ = restored(8, False, range(9, 13))
        if without_fix:
            out["without_fix"] = _without_fix(
                lambda: restored(12, True, range(13, 17)), fresh12, fresh16
            )
        checks["fresh_restore_is_meant"] = tables_differ(fresh12, meant_at[12])
        checks["trained_restore"] = differences(trained12, fresh12)
        checks["trained_continued"] = differences(trained16, fresh16)
        if lossless:
            checks["restore_is_live"] = differences(fresh12, live[12])
            checks["continued_is_uninterrupted"] = differences(fresh16, live[16])
            checks["restore_8_is_live"] = differences(fresh8, live[8])

        ckpt.restore(8)  # rollback: the writer's cache holds rows of step 16
        checks["rollback_restore"] = differences(state_of(writer, wopt), fresh8)
        for step in range(9, 13):
            train(writer, wopt, step, device)
        checks["rollback_continued"] = differences(state_of(writer, wopt), fresh8_12)

        for step in range(13, 15):
            train(writer, wopt, step, device)
        ckpt.restore(8, discard_newer=True)
        checks["discard_newer_restore"] = differences(state_of(writer, wopt), fresh8)
        for step in range(9, 13):
            train(writer, wopt, step, device)
            if step in (10, 12):
                ckpt.save(step).wait()
        resaved = meant(ckpt.reconstruction())
        live_resaved = state_of(writer, wopt)
    finally:
        ckpt.close()

    again, _, _ = restored(12, True, range(0))
    checks["discard_newer_resave_is_meant"] = tables_differ(again, resaved)
    if lossless:
        checks["discard_newer_resave_is_live"] = differences(again, live_resaved)
    out["checks"] = checks
    out["exact"] = all(not found for found in checks.values())
    out["seconds"] = round(time.perf_counter() - started, 2)
    return out


def _without_fix(
    run: Callable[[], tuple[dict, dict, int]], fresh: dict, continued: dict
) -> dict[str, Any]:
    """The trained restore with FBGEMM's cache left as it was before the restore."""
    from embckpt import kernel_cache

    kept = kernel_cache.drop_cached_rows
    kernel_cache.drop_cached_rows = lambda kernels: None  # type: ignore[assignment]
    try:
        after, after_steps, _ = run()
    finally:
        kernel_cache.drop_cached_rows = kept  # type: ignore[assignment]
    restore_diff, continued_diff = differences(after, fresh), differences(after_steps, continued)
    return {
        "exact": not restore_diff and not continued_diff,
        "after_restore": restore_diff[:8],
        "after_continuing": continued_diff[:8],
    }


def run_cases(
    rank: int,
    world_size: int,
    selected: list[Case],
    root: str,
    device: str,
    without_fix: bool = False,
) -> list[dict[str, Any]]:
    """Every selected case on this rank (``run_ranks`` target, one rank); a case FBGEMM or
    TorchRec refuses to build is reported with its error, not raised."""
    import os

    from embckpt.examples.launcher import rank_device

    dev = rank_device(rank) if device == "cuda" else torch.device("cpu")
    results = []
    for index, case in enumerate(selected):
        try:
            results.append(
                run_case(
                    case,
                    os.path.join(root, f"case{index}"),
                    dev,
                    without_fix and case.location == "fused_uvm_caching",
                )
            )
        except Exception as exc:  # reported per case: one refusal must not hide the rest
            results.append(
                {
                    "case": case.name,
                    **dataclasses.asdict(case),
                    "error": f"{type(exc).__name__}: {exc}"[:2000],
                }
            )
    return results
