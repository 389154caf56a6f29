"""A block of a table as this rank holds it: what every part of a save or a restore works on.

Apart from ``sharding.py``, which finds the blocks in a model (and needs TorchRec and FBGEMM
to do so), so that the writer process (``save/writer_worker.py``) imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass
class TableShard:
    """One block of one table held by this rank.

    Attributes:
        table: the table's identity (:func:`table_id`: module path and name).
        fqn: the weight's key in ``model.state_dict()``.
        row_offset, col_offset: where the block starts in the global table.
        table_rows, table_cols: the global table's shape.
        weight: live view [rows, cols] of the block's weights.
        row_states: live views [rows] of row-wise optimizer states, by state name.
        elem_states: live views [rows, cols] of element-wise optimizer states.
        writer: whether this rank writes the block (False for non-zero replicas).
        name: the table's name in its collection's config (live blocks only).
    """

    table: str
    fqn: str
    sharding_type: str
    row_offset: int
    col_offset: int
    table_rows: int
    table_cols: int
    weight: torch.Tensor
    row_states: dict[str, torch.Tensor] = field(default_factory=dict)
    elem_states: dict[str, torch.Tensor] = field(default_factory=dict)
    writer: bool = True
    name: str = ""

    @property
    def num_rows(self) -> int:
        return int(self.weight.shape[0])

    @property
    def num_cols(self) -> int:
        return int(self.weight.shape[1])

    @property
    def key(self) -> str:
        """Unique name of the block: table, row and column offsets."""
        return f"{self.table}/r{self.row_offset}_c{self.col_offset}"

    def on_meta(self) -> TableShard:
        """This block with its tensors on the meta device: shapes and types without memory,
        as the writer process gets it."""

        def meta(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, device="meta")

        return replace(
            self,
            weight=meta(self.weight),
            row_states={n: meta(t) for n, t in self.row_states.items()},
            elem_states={n: meta(t) for n, t in self.elem_states.items()},
        )
