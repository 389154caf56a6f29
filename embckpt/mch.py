"""Managed-collision (MCH, also called ZCH) modules: the id-remapping state TorchRec keeps next to
a table, saved whole at every checkpoint and restored exactly.

TorchRec's ``ShardedManagedCollisionCollection`` shards each ``MCHManagedCollisionModule``
row-wise like its table: the module on rank r owns the table rows ``[offset, offset + rows)`` and
remaps the raw ids routed to it to global rows in that range. Its persistent buffers
(``_mch_sorted_raw_ids``, ``_mch_remapped_ids_mapping``, the eviction policy's metadata such as
``_mch_counts``) are ShardedTensors with one local shard: one value per table row. The module
also keeps eviction state outside its state dict: its iteration counters and the ids seen since
the last eviction (its *history*), which the next eviction ranks.

All of it is small, changes at every step and belongs to one rank: each rank writes its own,
whole, into its rank file at every checkpoint, full or diff (:func:`capture`), so a restore is
exact whatever the chain. On another world size the buffers are rebuilt from their global row
offsets, and only where each new rank's rows are a union of writer ranks' rows (TorchRec's own
rule, ``validate_state``: 2 ranks onto 1, 4 onto 2), because a rank only remaps the ids routed to
it; the history is not restored there (it belongs to ranks that no longer exist). Only
MCHManagedCollisionModule is known: any other managed-collision module is refused.

An eviction rewrites the evicted rows of the table (TorchRec re-initialises them) without a
lookup: :func:`watch_evictions` reports those rows so that the next checkpoint writes them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.mc_modules import ShardedManagedCollisionCollection
from torchrec.distributed.model_parallel import get_unwrapped_module
from torchrec.modules.mc_modules import MCHManagedCollisionModule

from embckpt.errors import ConfigError, ModelMismatchError

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
        table: the table it remaps ids for (its name in the collection's config).
        owner: the path of the module holding the collection and the table (the MC-EBC/EC):
            the table's weight key starts with it.
        module: the live module.
        collection: the ``ShardedManagedCollisionCollection`` holding it (reports evictions).
        row_offset, rows, global_rows: its slice of the table's rows, and the table's rows.
        buffers: live views of its sharded buffers ([rows] each), by buffer name.
    """

    name: str
    table: str
    owner: str
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
            owner = path.rsplit(".", 1)[0] if "." in path else ""
            found.append(_table(name, table, owner, module, collection, state))
    return found


def _table(
    name: str,
    table: str,
    owner: str,
    module: nn.Module,
    collection: nn.Module,
    state: Mapping[str, Any],
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
        owner=owner,
        module=module,
        collection=collection,
        row_offset=row_offset,
        rows=rows,
        global_rows=global_rows,
        buffers={key: getattr(module, key) for key in sorted(sharded)},
    )


# -- save -----------------------------------------------------------------------------------------
def capture(tables: list[MchTable]) -> dict[str, Any]:
    """This rank's managed-collision state, as its rank file holds it (live views: copy them
    before training goes on)."""
    return {
        t.name: {
            "table": t.table,
            "row_offset": t.row_offset,
            "rows": t.rows,
            "global_rows": t.global_rows,
            "buffers": dict(t.buffers),
            "eviction": eviction_state(t.module),
        }
        for t in tables
    }


def eviction_state(module: Any) -> dict[str, Any]:
    """A module's counters and its history since the last eviction (the filled part): live
    views, as :func:`load` takes them."""
    filled = module._current_history_buffer_offset
    started = module._input_history_buffer_size >= 0
    empty = torch.empty(0, dtype=torch.int64)
    return {
        "current_iter": module._current_iter,
        "last_eviction_iter": module._last_eviction_iter,
        "history_size": module._input_history_buffer_size,
        "history": module._history_accumulator[:filled] if started else empty,
        "history_metadata": {
            name: values[:filled] if started else empty
            for name, values in module._history_metadata.items()
        },
    }


# -- restore --------------------------------------------------------------------------------------
@dataclass
class MchLoad:
    """What a restore loads into one module: its buffers, and its eviction state (None: start
    afresh, as a module just built does)."""

    table: MchTable
    buffers: dict[str, torch.Tensor]
    eviction: dict[str, Any] | None


def own_entries_match(tables: list[MchTable], saved: Mapping[str, Any]) -> bool:
    """Whether this rank's own saved entries hold exactly its rows (same world size and plan):
    then they are all a restore needs."""
    return all(
        t.name in saved
        and (saved[t.name]["row_offset"], saved[t.name]["rows"]) == (t.row_offset, t.rows)
        for t in tables
    )


def plan_loads(
    tables: list[MchTable], saved: list[Mapping[str, Any]], own: Mapping[str, Any] | None, path: str
) -> tuple[list[MchLoad], list[str]]:
    """Matches the checkpoint's managed-collision state to the live modules, before anything is
    loaded; returns the loads and what is not restored.

    Args:
        tables: the live modules of this rank.
        saved: each writer rank's entries (all of them, or only this rank's when ``own``).
        own: this rank's own entries when they hold exactly its rows, else None.
        path: the checkpoint, for messages.

    Raises:
        ModelMismatchError: modules differ, or a rank's rows cannot be built from the writer's.
    """
    live_names = {t.name for t in tables}
    for name in sorted({name for entries in saved for name in entries.keys() ^ live_names}):
        where = (
            f"in the model but not in checkpoint {path}"
            if name in live_names
            else f"in checkpoint {path} but not in the model"
        )
        raise ModelMismatchError(f"managed-collision module {name}: {where}")
    if own is not None:
        loads = [
            MchLoad(t, _checked(t, own[t.name], path), own[t.name]["eviction"]) for t in tables
        ]
        return loads, []
    loads = [MchLoad(t, _assembled(t, [e[t.name] for e in saved], path), None) for t in tables]
    skipped = [
        f"{t.describe()}: eviction history (written by {len(saved)} ranks; starts afresh)"
        for t in tables
    ]
    return loads, skipped


def _checked(table: MchTable, entry: Mapping[str, Any], path: str) -> dict[str, torch.Tensor]:
    buffers = dict(entry["buffers"])
    if sorted(buffers) != sorted(table.buffers) or entry["global_rows"] != table.global_rows:
        raise ModelMismatchError(
            f"{table.describe()}: checkpoint {path} has buffers {sorted(buffers)} over "
            f"{entry['global_rows']} rows, the model {sorted(table.buffers)} over "
            f"{table.global_rows}"
        )
    for name, value in buffers.items():
        if value.shape != table.buffers[name].shape or value.dtype != table.buffers[name].dtype:
            raise ModelMismatchError(
                f"{table.describe()}: buffer {name} of checkpoint {path} is "
                f"{value.dtype}{list(value.shape)}, the model's "
                f"{table.buffers[name].dtype}{list(table.buffers[name].shape)}"
            )
    return buffers


def _assembled(
    table: MchTable, entries: list[Mapping[str, Any]], path: str
) -> dict[str, torch.Tensor]:
    """This rank's rows of every buffer, from the writer ranks' slices (global row offsets)."""
    entries = sorted(entries, key=lambda e: e["row_offset"])
    bounds = [e["row_offset"] for e in entries] + [entries[-1]["row_offset"] + entries[-1]["rows"]]
    lo, hi = table.row_offset, table.row_offset + table.rows
    if lo not in bounds or hi not in bounds:
        raise ModelMismatchError(
            f"{table.describe()}: rows [{lo}, {hi}) cannot be built from the {len(entries)} "
            f"writer ranks' rows {list(zip(bounds[:-1], bounds[1:], strict=True))} of checkpoint "
            f"{path}: a rank remaps only the ids routed to it, so managed-collision state is "
            "restored only onto ranks whose rows are a union of writer ranks' (as TorchRec's "
            "own load), e.g. fewer ranks"
        )
    inside = entries[bounds.index(lo) : bounds.index(hi)]
    return _checked(
        table,
        {
            "buffers": {
                name: torch.cat([e["buffers"][name] for e in inside]) for name in table.buffers
            },
            "global_rows": entries[0]["global_rows"],
        },
        path,
    )


@torch.no_grad()
def load(item: MchLoad) -> None:
    """Writes buffers and eviction state into the live module, then re-sorts its buffers as
    TorchRec's own load does (``validate_state``): slices of several writers are sorted each."""
    for name, value in item.buffers.items():
        item.table.buffers[name].copy_(value)
    module: Any = item.table.module
    module.validate_state()
    state = item.eviction
    if state is None:
        # A module just built: counters are read from _current_iter_tensor at the next step.
        module._current_iter = -1
        module._last_eviction_iter = -1
        module._current_history_buffer_offset = 0
        return
    module._current_iter = int(state["current_iter"])
    module._last_eviction_iter = int(state["last_eviction_iter"])
    size = int(state["history_size"])
    if size != module._input_history_buffer_size:
        _new_history(module, size, state["history_metadata"])
    filled = int(state["history"].numel())
    if filled:
        module._history_accumulator[:filled] = state["history"]
        for name, values in state["history_metadata"].items():
            module._history_metadata[name][:filled] = values
    module._current_history_buffer_offset = filled


def _new_history(module: Any, size: int, metadata: Mapping[str, torch.Tensor]) -> None:
    """The history buffers TorchRec sizes at a module's first step, at the writer's size."""
    module._input_history_buffer_size = size
    if size < 0:
        return  # the writer had not trained yet: sized at the next step
    device = module.device
    module._history_accumulator = torch.empty(size, dtype=torch.int64, device=device)
    for name, values in metadata.items():
        buffer = torch.zeros(size, dtype=values.dtype, device=device)
        module.register_buffer(f"_history_{name}", buffer, persistent=False)
        module._history_metadata[name] = buffer


# -- evictions ------------------------------------------------------------------------------------
def watch_evictions(
    tables: list[MchTable], mark: Callable[[MchTable, torch.Tensor], None]
) -> Callable[[], None]:
    """Calls ``mark(table, local_rows)`` with the rows each eviction re-initialises (TorchRec
    resets them without a lookup); returns what stops watching.

    TorchRec's sharded module asks its collection's ``evict()`` for those rows at every step
    (local to the rank's slice), so that method is wrapped on each collection instance.
    """
    by_key = {(id(t.collection), t.table): t for t in tables}
    collections: dict[int, Any] = {id(t.collection): t.collection for t in tables}
    wrapped = {key: vars(c).get("evict") for key, c in collections.items()}  # another watcher's
    for collection in collections.values():
        collection.evict = _reporting(collection, collection.evict, by_key, mark)

    def unwatch() -> None:
        for key, collection in collections.items():
            vars(collection).pop("evict", None)
            if wrapped[key] is not None:
                collection.evict = wrapped[key]

    return unwatch


def _reporting(
    collection: Any,
    evict: Callable[[], dict[str, torch.Tensor | None]],
    by_key: Mapping[tuple[int, str], MchTable],
    mark: Callable[[MchTable, torch.Tensor], None],
) -> Callable[[], dict[str, torch.Tensor | None]]:
    def reporting_evict() -> dict[str, torch.Tensor | None]:
        evictions = evict()
        for table, rows in evictions.items():
            if rows is not None and rows.numel():
                mark(by_key[(id(collection), table)], rows)
        return evictions

    return reporting_evict
