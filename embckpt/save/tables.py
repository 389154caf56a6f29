"""The manifest's description of the tables, from this job's sharding."""

from __future__ import annotations

from collections.abc import Mapping

from embckpt.dtypes import dtype_name
from embckpt.sharding import ShardedModel
from embckpt.storage.manifest import TableEntry


def table_entries(
    sharded: ShardedModel, state_names: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]]
) -> tuple[TableEntry, ...]:
    """Every table as this job shards it.

    Args:
        sharded: this rank's view of the model's tables.
        state_names: ``ShardedModel.state_names`` merged over all ranks (a rank only sees the
            optimizer state of the blocks it holds).
    """
    entries = []
    for name, (rows, cols) in sorted(sharded.table_shapes.items()):
        row_states, elem_states = state_names.get(name, ((), ()))
        entries.append(
            TableEntry(
                name=name,
                rows=rows,
                cols=cols,
                dtype=dtype_name(sharded.table_dtypes[name]),
                sharding_type=sharded.sharding_types[name],
                row_states=row_states,
                elem_states=elem_states,
                shards=tuple(sharded.placements[name]),
            )
        )
    return tuple(entries)
