"""The writer's reconstruction: what a restore of the latest committed checkpoint gives (debug).

embckpt promises that for every committed step N, ``restore(N)`` gives exactly the values the
writer meant N to hold: for lossless codecs the live state at N; for lossy ones the decoded
codes (for additive codecs, added to the reference they were taken against). Tests check that
promise against this record, which the writer keeps only when asked
(``Checkpointer.track_reconstruction()``): it costs an fp32 copy of every block the rank writes
and a decode of every row written.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from embckpt.blocks import TableShard


@dataclass(frozen=True)
class CapturedRows:
    """Rows one file of a save restores to: ``values`` maps ``weight``, ``row:<state>`` and
    ``elem:<state>`` to fp32 tensors with a leading dimension of ``len(local_rows)``."""

    key: str
    num_rows: int  # of the whole block
    local_rows: torch.Tensor  # int64, CPU
    values: dict[str, torch.Tensor]


class CaptureEdit:
    """The rows a save's files restore to, kept aside until the save commits."""

    def __init__(self) -> None:
        self.rows: list[CapturedRows] = []
        self._lock = threading.Lock()  # units are written by several threads

    def add(self, captured: CapturedRows) -> None:
        with self._lock:
            self.rows.append(captured)


class WriterReconstruction:
    """Per writer block, what a restore of the latest committed checkpoint gives.

    Unknown until a full checkpoint commits or a restore loads the model (then the live state
    is what the restored step holds)."""

    def __init__(self) -> None:
        self._blocks: dict[str, dict[str, torch.Tensor]] | None = None

    def reset_from_live(self, shards: Iterable[TableShard]) -> None:
        """After a restore: the live rows are the restored step's."""
        blocks: dict[str, dict[str, torch.Tensor]] = {}
        for shard in shards:
            values = {"weight": shard.weight.detach().float().cpu().clone()}
            for name, t in shard.row_states.items():
                values[f"row:{name}"] = t.detach().float().cpu().clone()
            for name, t in shard.elem_states.items():
                values[f"elem:{name}"] = t.detach().float().cpu().clone()
            blocks[shard.key] = values
        self._blocks = blocks

    def forget(self) -> None:
        self._blocks = None

    def apply(self, edit: CaptureEdit, full: bool) -> None:
        """A save committed: its rows now restore as it wrote them. A full replaces every
        block (it writes every row); a diff after an unknown state leaves it unknown."""
        if full:
            self._blocks = {}
        if self._blocks is None:
            return
        for captured in edit.rows:
            block = self._blocks.setdefault(captured.key, {})
            for name, values in captured.values.items():
                if name not in block:
                    block[name] = torch.zeros((captured.num_rows, *values.shape[1:]))
                block[name][captured.local_rows] = values

    def blocks(self) -> dict[str, dict[str, torch.Tensor]]:
        """A copy: block key -> ``weight`` / ``row:<state>`` / ``elem:<state>`` -> fp32."""
        if self._blocks is None:
            raise RuntimeError(
                "the writer's reconstruction is unknown: call track_reconstruction() before a "
                "full checkpoint or a restore"
            )
        return {k: {n: t.clone() for n, t in v.items()} for k, v in self._blocks.items()}
