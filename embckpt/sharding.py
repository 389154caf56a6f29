"""Reads a ``DistributedModelParallel`` model's embedding tables as this rank sees them.

For every table, each rank gets the blocks it holds (its *local shards*): global row and column
offsets, a live view of the weights, and live views of the fused optimizer's state split into
row-wise states (one value per row, e.g. row-wise Adagrad's momentum) and element-wise states
(shaped like the weights, e.g. Adagrad or Adam moments). Writing into these views writes into
the model: that is how a restore loads rows without rebuilding any module.

Works for table-, row-, column-, table-row-wise and data-parallel tables. Data-parallel tables are
replicated: every rank holds the whole table, only rank 0 writes it, and its optimizer state
belongs to the dense optimizer, not to the fused one. Managed-collision modules' sharded buffers
are found too (:mod:`embckpt.mch`); any other sharded state is refused (:func:`check_placeable`).

The fused optimizer also keeps state that is not per row: FBGEMM counts its steps per
table-batched kernel (:class:`FusedKernel`), and a few of its optimizers rewrite every row of
their tables at their steps, not only the rows looked up.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    DenseTableBatchedEmbeddingBagsCodegen,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.model_parallel import get_unwrapped_module

from embckpt.blocks import TableShard
from embckpt.errors import ConfigError, ModelMismatchError
from embckpt.kernel_cache import is_caching
from embckpt.mch import MchTable, find_tables

_EXACT_MODULES = (SplitTableBatchedEmbeddingBagsCodegen, DenseTableBatchedEmbeddingBagsCodegen)
_TABLE_KEY = re.compile(r"^(?:(.*)\.)?(?:embedding_bags|embeddings)\.([^.]+)\.weight$")


def table_id(module_path: str, name: str) -> str:
    """A table's identity in a checkpoint: its collection's module path and its name
    (``sparse_arch.embedding_bag_collection.t0``), so that two collections may both have a
    table ``t0``. A table outside any named module keeps its bare name."""
    return f"{module_path}.{name}" if module_path else name


# FBGEMM's optimizer state that is one value per kernel: ``iter`` (Adam's and LAMB's bias
# correction, counter-based regularization, the EMA and global weight decay schedules) and
# ``max_counter`` (counter-based regularization's normaliser).
FUSED_COUNTERS = ("iter", "max_counter")
# FBGEMM optimizers whose steps rewrite every row of their tables, not only the rows looked up.
_EVERY_ROW = {
    "EMAINPLACE_ROWWISE_ADAGRAD": "an EMA of every row every emainplace_mode.step_ema steps",
    "ENSEMBLE_ROWWISE_ADAGRAD": "an EMA and swap of every row (ensemble_mode)",
}


@dataclass
class FusedKernel:
    """One FBGEMM table-batched kernel of the fused optimizer, and the blocks it holds.

    Attributes:
        module: the kernel (TorchRec's ``emb_module``).
        blocks: ``TableShard.key`` of each block it holds; its counters are theirs.
        every_row: why its steps rewrite every row of its blocks (None: only rows looked up).
    """

    module: nn.Module
    blocks: tuple[str, ...]
    every_row: str | None = None

    def counters(self) -> dict[str, torch.Tensor]:
        """Live views of the kernel's counters (:data:`FUSED_COUNTERS` it has)."""
        found = {name: getattr(self.module, name, None) for name in FUSED_COUNTERS}
        return {k: v for k, v in found.items() if isinstance(v, torch.Tensor) and v.numel() == 1}

    def reload_iter(self) -> None:
        """After ``iter`` was written: FBGEMM steps from a host copy, ``iter_cpu``, which it
        re-reads from ``iter`` only while that copy is 0 (``set_optimizer_step`` leaves it
        stale in a process that has trained)."""
        counter = self.counters().get("iter")
        mirror = getattr(self.module, "iter_cpu", None)
        if counter is not None and isinstance(mirror, torch.Tensor):
            mirror.fill_(int(counter.item()))


@dataclass
class ShardedModel:
    """All of this rank's table blocks, its managed-collision modules, plus what the dense side
    of a checkpoint must skip."""

    shards: list[TableShard]
    table_shapes: dict[str, tuple[int, int]]
    table_dtypes: dict[str, torch.dtype]
    sharding_types: dict[str, str]
    placements: dict[str, list[tuple[int, int, int, int, int]]]
    table_keys: set[str]
    scalar_states: dict[str, torch.Tensor] = field(default_factory=dict)
    kernels: list[FusedKernel] = field(default_factory=list)
    mch: list[MchTable] = field(default_factory=list)
    # FBGEMM kernels holding rows in an HBM cache in front of UVM (``kernel_cache``).
    caching: list[nn.Module] = field(default_factory=list)

    def writer_shards(self) -> Iterator[TableShard]:
        return (s for s in self.shards if s.writer)

    def every_row_blocks(self) -> dict[str, str]:
        """Block key -> why the fused optimizer rewrites every row of it at its steps."""
        return {b: k.every_row for k in self.kernels if k.every_row for b in k.blocks}

    def local_fp32_bytes(self) -> float:
        """Bytes an uncompressed fp32 copy of this rank's written blocks and their optimizer
        state takes (summed over ranks: a full fp32 checkpoint's size)."""
        total = 0.0
        for shard in self.writer_shards():
            per_row = shard.num_cols * (1 + len(shard.elem_states)) + len(shard.row_states)
            total += 4.0 * shard.num_rows * per_row
        return total

    def state_names(self) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
        """Table -> (row-wise, element-wise) optimizer state names, of the blocks held here."""
        return {
            s.table: (tuple(sorted(s.row_states)), tuple(sorted(s.elem_states)))
            for s in self.shards
        }


def discover(model: nn.Module, rank: int = 0) -> ShardedModel:
    """Finds every embedding table of ``model`` and this rank's blocks of it.

    Args:
        model: a ``DistributedModelParallel`` (or any module whose state dict holds
            ShardedTensors for embedding tables).
        rank: this process's rank.

    Raises:
        ModelMismatchError: an optimizer state has a shape that is neither row-wise nor
            element-wise.
    """
    state = model.state_dict()
    fused_state = _fused_optimizer_state(model)
    shards: list[TableShard] = []
    shapes: dict[str, tuple[int, int]] = {}
    dtypes: dict[str, torch.dtype] = {}
    types: dict[str, str] = {}
    placements: dict[str, list[tuple[int, int, int, int, int]]] = {}
    scalars: dict[str, torch.Tensor] = {}
    sharding_types = _sharding_types(model)
    for fqn, value in state.items():
        match = _TABLE_KEY.search(fqn)
        if match is None:
            continue
        name = match.group(2)
        table = table_id(match.group(1) or "", name)
        if hasattr(value, "local_shards"):
            meta = value.metadata()
            shapes[table] = (int(meta.size[0]), int(meta.size[1]))
            dtypes[table] = meta.tensor_properties.dtype
            types[table] = sharding_types.get(table, "sharded")
            placements[table] = [
                (
                    int(sm.placement.rank()) if sm.placement is not None else -1,
                    int(sm.shard_offsets[0]),
                    int(sm.shard_offsets[1]),
                    int(sm.shard_sizes[0]),
                    int(sm.shard_sizes[1]),
                )
                for sm in meta.shards_metadata
            ]
            opt = fused_state.get(fqn, {})
            for index, local in enumerate(value.local_shards()):
                shard = TableShard(
                    table=table,
                    fqn=fqn,
                    sharding_type=types[table],
                    name=name,
                    row_offset=int(local.metadata.shard_offsets[0]),
                    col_offset=int(local.metadata.shard_offsets[1]),
                    table_rows=shapes[table][0],
                    table_cols=shapes[table][1],
                    weight=local.tensor,
                )
                _attach_optimizer_state(shard, opt, index, scalars)
                shards.append(shard)
        else:
            rows, cols = value.shape
            shapes[table] = (int(rows), int(cols))
            dtypes[table] = value.dtype
            types[table] = "data_parallel"
            placements[table] = [(0, 0, 0, int(rows), int(cols))]
            shards.append(
                TableShard(
                    table=table,
                    fqn=fqn,
                    sharding_type="data_parallel",
                    name=name,
                    row_offset=0,
                    col_offset=0,
                    table_rows=int(rows),
                    table_cols=int(cols),
                    weight=value,
                    writer=rank == 0,
                )
            )
    kernels = _fused_kernels(model, shards)
    for kernel in kernels:
        for name, tensor in kernel.counters().items():
            scalars.update({f"{block}/{name}": tensor for block in kernel.blocks})
    return ShardedModel(
        shards=shards,
        table_shapes=shapes,
        table_dtypes=dtypes,
        sharding_types=types,
        placements=placements,
        table_keys={fqn for fqn in state if _TABLE_KEY.search(fqn)},
        scalar_states=scalars,
        kernels=kernels,
        mch=find_tables(model, state),
        caching=[k.module for k in kernels if is_caching(k.module)],
    )


def check_placeable(model: nn.Module) -> None:
    """Refuses, when a Checkpointer is built rather than at its first save, a model holding
    sharded state (ShardedTensor or DTensor) that is neither an embedding table nor a
    managed-collision module's buffer: embckpt would not know where to put it on restore.

    Raises:
        ConfigError: naming the module, its type and the state.
    """
    state = model.state_dict()
    placed = {key for key in state if _TABLE_KEY.search(key)}
    for table in find_tables(model, state):
        placed.update(f"{table.name}.{buffer}" for buffer in table.buffers)
    for key, value in state.items():
        if isinstance(value, (ShardedTensor, DTensor)) and key not in placed:
            path, module = _owner(model, key)
            raise ConfigError(
                f"module {path or '(root)'} ({type(module).__name__}) holds sharded state "
                f"{key!r} ({type(value).__name__}) that embckpt cannot checkpoint: it saves "
                "embedding tables (EmbeddingBagCollection, EmbeddingCollection, and their "
                "managed-collision variants) and replicated dense state"
            )


# The compute kernels whose rows embckpt reads and writes exactly: FBGEMM's table-batched
# training kernel through its ``split_embedding_weights`` views (in HBM, UVM, UVM behind an HBM
# cache, host memory) and TorchRec's dense kernel. Key-value backends (SSD, DRAM virtual tables,
# KV-ZCH) keep rows outside any such view; the quantized kernels are for inference.
EXACT_COMPUTE_KERNELS = ("dense", "fused", "fused_uvm", "fused_uvm_caching")


def check_kernels(model: nn.Module) -> None:
    """Refuses, when a Checkpointer is built, a table on a kernel whose rows embckpt cannot
    read and write exactly (:data:`EXACT_COMPUTE_KERNELS`), by the plan DMP applied and by the
    FBGEMM module each kernel runs.

    Raises:
        ConfigError: naming the table and its kernel.
    """
    plan = getattr(model, "plan", None)
    for path, module_plan in getattr(plan, "plan", {}).items():
        for name, sharding in getattr(module_plan, "items", lambda: [])():
            kernel = getattr(sharding, "compute_kernel", None)
            if kernel is not None and kernel not in EXACT_COMPUTE_KERNELS:
                raise ConfigError(
                    f"table {table_id(path, name)}: compute kernel {kernel!r} cannot be "
                    f"checkpointed exactly by embckpt (supported: "
                    f"{', '.join(EXACT_COMPUTE_KERNELS)})"
                )
    for path, batched in collection_kernels(model):
        module = batched.emb_module
        tables = ", ".join(table_id(path, t.name) for t in batched._config.embedding_tables)
        if not isinstance(module, _EXACT_MODULES):
            raise ConfigError(
                f"table {tables}: its kernel runs {type(module).__name__}, whose rows embckpt "
                "cannot read and write exactly (supported: FBGEMM's "
                "SplitTableBatchedEmbeddingBagsCodegen and DenseTableBatchedEmbeddingBagsCodegen,"
                f" the compute kernels {', '.join(EXACT_COMPUTE_KERNELS)})"
            )
        optimizer = getattr(getattr(module, "optimizer", None), "name", "")
        if optimizer in _EVERY_ROW and is_caching(module):
            # FBGEMM rewrites every row through the UVM views, behind the cache: what training
            # computes then depends on which rows are cached, which no checkpoint holds.
            raise ConfigError(
                f"table {tables}: optimizer {optimizer} on fused_uvm_caching cannot be resumed "
                "exactly: FBGEMM applies its every-row update to the table in UVM, ignoring the "
                "rows cached in HBM, so training after a restore (which starts with an empty "
                "cache) differs from training on; use fused_uvm or fused for this table"
            )


def _owner(model: nn.Module, key: str) -> tuple[str, nn.Module]:
    """The deepest module whose path prefixes state key ``key``."""
    modules = dict(get_unwrapped_module(model).named_modules())
    path = key
    while path and path not in modules:
        path = path.rpartition(".")[0]
    return path, modules[path]


def _fused_optimizer_state(model: nn.Module) -> dict[str, dict[str, object]]:
    fused = getattr(model, "fused_optimizer", None)
    if fused is None:
        return {}
    return dict(fused.state_dict().get("state", {}))


def _fused_kernels(model: nn.Module, shards: list[TableShard]) -> list[FusedKernel]:
    """Every FBGEMM training kernel (one with a step counter) and the blocks it holds."""
    by_block = {(s.table, s.row_offset, s.col_offset): s.key for s in shards}
    kernels = []
    for path, batched in collection_kernels(model):
        module = batched.emb_module
        if not isinstance(getattr(module, "iter", None), torch.Tensor):
            continue  # a data-parallel table's dense kernel: no fused optimizer
        blocks = []
        for table in batched._config.embedding_tables:
            meta = table.local_metadata
            offsets = (0, 0) if meta is None else (meta.shard_offsets[0], meta.shard_offsets[1])
            blocks.append(by_block[(table_id(path, table.name), int(offsets[0]), int(offsets[1]))])
        optimizer = getattr(getattr(module, "optimizer", None), "name", "")
        every_row = _EVERY_ROW.get(optimizer)
        reason = None if every_row is None else f"optimizer={optimizer}: {every_row}"
        kernels.append(FusedKernel(module, tuple(blocks), reason))
    return kernels


def batched_embedding_modules(model: nn.Module) -> Iterable[Any]:
    """Every TorchRec batched embedding kernel (fused or dense) under the model's sharded
    collections."""
    return (batched for _, batched in collection_kernels(model))


def collection_kernels(model: nn.Module) -> Iterable[tuple[str, Any]]:
    """Each batched embedding kernel with its sharded collection's module path (as
    ``model.state_dict()`` spells it: the tables' identities start with it). Sharded
    collections hide their lookups from ``named_modules``, so this walks their ``_lookups``
    explicitly. Paths are taken inside DMP's and DDP's wrappers, as ``state_dict`` does."""
    for path, module in get_unwrapped_module(model).named_modules():
        for lookup in getattr(module, "_lookups", ()):
            inner = lookup.module if isinstance(lookup, DistributedDataParallel) else lookup
            for batched in getattr(inner, "_emb_modules", ()):
                if hasattr(batched, "emb_module") and hasattr(batched, "_config"):
                    yield path, batched


def _sharding_types(model: nn.Module) -> dict[str, str]:
    """Table identity -> sharding type, from the plan DMP applied (keyed by module path)."""
    plan = getattr(model, "plan", None)
    found: dict[str, str] = {}
    if plan is None:
        return found
    for path, module_plan in plan.plan.items():
        for name, sharding in getattr(module_plan, "items", lambda: [])():
            found[table_id(path, name)] = sharding.sharding_type
    return found


def _attach_optimizer_state(
    shard: TableShard,
    opt: dict[str, object],
    index: int,
    scalars: dict[str, torch.Tensor],
) -> None:
    """Splits a table's fused optimizer state into row-wise, element-wise and scalar parts."""
    prefix = f"{shard.name}."
    for key, value in opt.items():
        name = key[len(prefix) :] if key.startswith(prefix) else key
        if hasattr(value, "local_shards"):
            local = value.local_shards()
            if index >= len(local):
                continue
            tensor = local[index].tensor
        elif isinstance(value, torch.Tensor):
            tensor = value
        else:
            continue
        if tensor.dim() == 2 and tuple(tensor.shape) == tuple(shard.weight.shape):
            shard.elem_states[name] = tensor
        elif tensor.dim() == 1 and tensor.numel() == shard.num_rows:
            shard.row_states[name] = tensor
        elif tensor.numel() <= 1:
            # One value per block (FBGEMM's ``iter``, shared by its kernel's blocks).
            scalars[f"{shard.key}/{name}"] = tensor
        else:
            raise ModelMismatchError(
                f"table {shard.table}: optimizer state {name!r} of shape {tuple(tensor.shape)} "
                f"is neither row-wise ({shard.num_rows}) nor element-wise "
                f"{tuple(shard.weight.shape)}"
            )
