"""Managed-collision (MCH, also called ZCH) modules: the id-remapping state TorchRec keeps next to
a table, saved whole at every checkpoint and restored exactly.

TorchRec's ``ShardedManagedCollisionCollection`` shards each ``MCHManagedCollisionModule``
row-wise like its table: the module on rank r owns the table rows ``[offset, offset + rows)`` and
remaps the raw ids routed to it to global rows in that range. Its persistent buffers
(``_mch_sorted_raw_ids``, ``_mch_remapped_ids_mapping``, the eviction policy's metadata such as
``_mch_counts``) are ShardedTensors with one local shard: one value per table row. The module
also keeps eviction state outside its state dict: its iteration counters and the ids seen since
the last eviction (its *history*), which the next eviction ranks.

Only MCHManagedCollisionModule is known: any other managed-collision module is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.mc_modules import ShardedManagedCollisionCollection
from torchrec.distributed.model_parallel import get_unwrapped_module
from torchrec.modules.mc_modules import MCHManagedCollisionModule

from embckpt.errors import ConfigError

# The eviction state an MCHManagedCollisionModule keeps in plain attributes (TorchRec 1.x).
_EVICTION_ATTRS = (
    "_current_iter",
    "_last_eviction_iter",
    "_input_history_buffer_size",
    "_current_history_buffer_offset",
    "_history_metadata",
)


@dataclass
class MchTable:
    """One table's managed-collision module on this rank.

    Attributes:
        name: the module's path in ``model.state_dict()`` (its buffers' key prefix).
        table: the table it remaps ids for.
        module: the live module.
        collection: the ``ShardedManagedCollisionCollection`` holding it (reports evictions).
        row_offset, rows, global_rows: its slice of the table's rows, and the table's rows.
        buffers: live views of its sharded buffers ([rows] each), by buffer name.
    """

    name: str
    table: str
    module: nn.Module
    collection: nn.Module
    row_offset: int
    rows: int
    global_rows: int
    buffers: dict[str, torch.Tensor]

    def describe(self) -> str:
        return f"managed-collision module {self.name} ({type(self.module).__name__})"


def find_tables(model: nn.Module, state: Mapping[str, Any]) -> list[MchTable]:
    """Every sharded managed-collision module of ``model``, with this rank's buffers.

    Raises:
        ConfigError: a managed-collision module embckpt cannot checkpoint (another type than
            ``MCHManagedCollisionModule``, or one without the eviction state it restores).
    """
    found = []
    for path, collection in get_unwrapped_module(model).named_modules():
        if not isinstance(collection, ShardedManagedCollisionCollection):
            continue
        for table, module in collection._managed_collision_modules.items():
            name = ".".join(p for p in (path, "_managed_collision_modules", table) if p)
            found.append(_table(name, table, module, collection, state))
    return found


def _table(
    name: str, table: str, module: nn.Module, collection: nn.Module, state: Mapping[str, Any]
) -> MchTable:
    missing = [a for a in _EVICTION_ATTRS if not hasattr(module, a)]
    if not isinstance(module, MCHManagedCollisionModule) or missing:
        raise ConfigError(
            f"managed-collision module {name} ({type(module).__name__}): embckpt checkpoints "
            f"MCHManagedCollisionModule only{f' (missing {missing})' if missing else ''}; its "
            "remapping state could not be restored"
        )
    sharded = {
        key[len(name) + 1 :]: value
        for key, value in state.items()
        if key.startswith(f"{name}.") and isinstance(value, ShardedTensor)
    }
    layouts = set()
    for value in sharded.values():
        (local,) = value.local_shards()
        meta = local.metadata
        layouts.add(
            (int(meta.shard_offsets[0]), int(meta.shard_sizes[0]), int(value.metadata().size[0]))
        )
    if len(layouts) != 1:
        raise ConfigError(
            f"managed-collision module {name} ({type(module).__name__}): its sharded buffers "
            f"{sorted(sharded)} do not share one row range ({sorted(layouts)})"
        )
    ((row_offset, rows, global_rows),) = layouts
    return MchTable(
        name=name,
        table=table,
        module=module,
        collection=collection,
        row_offset=row_offset,
        rows=rows,
        global_rows=global_rows,
        buffers={key: getattr(module, key) for key in sorted(sharded)},
    )
