"""Snapshots: which rows a checkpoint writes, and their copy into staging buffers.

A checkpoint's rows are cut into *units*: up to ``max_file_rows`` rows of one block, one Parquet
file each. Units are grouped into *pieces* that fit the staging budget; a piece is copied into
the staging arena (the snapshot proper), then encoded and written (the persist). Copies read the
live weights and optimizer state, so they must finish before the next weight update.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from embckpt import failpoints
from embckpt.blocks import TableShard
from embckpt.save.staging import StagingArena, split_budget

_ALIGN_SLACK = 64  # bytes the arena may pad each staged tensor with
_ROW_COLUMNS_BYTES = 16  # a row's id (int64) and its table and column dictionary indices (int32)


@dataclass(frozen=True)
class Unit:
    """Rows ``local_rows`` of one block, written as file ``part`` of that block."""

    shard: TableShard
    part: int
    local_rows: torch.Tensor  # int64, on the model's device
    contiguous: bool  # local_rows is a range: copy by slicing

    @property
    def num_rows(self) -> int:
        return int(self.local_rows.numel())

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The live tensors this unit copies rows of: weights, then optimizer states."""
        return shard_tensors(self.shard)

    def staged_bytes(self) -> int:
        return sum(
            StagingArena.nbytes((self.num_rows, *t.shape[1:]), t.dtype) for _, t in self.tensors()
        )


def shard_tensors(shard: TableShard) -> Iterator[tuple[str, torch.Tensor]]:
    """A block's live tensors by staged name: ``weight``, ``row:<state>``, ``elem:<state>``."""
    yield "weight", shard.weight
    for name, tensor in shard.row_states.items():
        yield f"row:{name}", tensor
    for name, tensor in shard.elem_states.items():
        yield f"elem:{name}", tensor


@dataclass
class StagedUnit:
    """A unit's rows copied out of the model: safe to encode while training goes on."""

    unit: Unit
    local_rows: torch.Tensor  # int64, CPU
    weights: torch.Tensor
    row_states: dict[str, torch.Tensor] = field(default_factory=dict)
    elem_states: dict[str, torch.Tensor] = field(default_factory=dict)
    fused: torch.Tensor | None = None  # weights already quantized on the device (uint8 rows)

    @classmethod
    def of(
        cls, unit: Unit, local_rows: torch.Tensor, copies: dict[str, torch.Tensor]
    ) -> StagedUnit:
        """A unit's copies by staged name (:func:`shard_tensors`; ``fused`` for weights the
        device quantized)."""
        return cls(
            unit=unit,
            local_rows=local_rows,
            weights=copies.get("weight", torch.empty(0)),
            row_states={k[4:]: v for k, v in copies.items() if k.startswith("row:")},
            elem_states={k[5:]: v for k, v in copies.items() if k.startswith("elem:")},
            fused=copies.get("fused"),
        )


def plan_units(
    shards_rows: list[tuple[TableShard, torch.Tensor, bool]],
    max_rows: int,
    budget_bytes: int,
    unit_bytes: int | None = None,
) -> list[Unit]:
    """Cuts each block's selected rows into units of at most ``max_rows`` rows, each small
    enough to stage within ``budget_bytes`` and, with ``unit_bytes``, to stage and encode
    within it (a row's staged bytes and its row id and dictionary indices, at least one row:
    ``staging.split_budget``)."""
    units = []
    for shard, rows, contiguous in shards_rows:
        probe = Unit(shard, 0, rows[:1], contiguous)
        tensors = len(list(probe.tensors()))
        per_row = sum(t[0].numel() * t.element_size() for _, t in probe.tensors())
        fitting = (budget_bytes - tensors * _ALIGN_SLACK) // max(per_row, 1)
        if fitting < 1:
            raise ValueError(
                f"staging budget of {budget_bytes} bytes cannot hold one row of {shard.table}"
            )
        if unit_bytes is not None:
            fitting = min(fitting, max(unit_bytes // (per_row + _ROW_COLUMNS_BYTES), 1))
        chunk = int(min(max_rows, fitting))
        for part, lo in enumerate(range(0, int(rows.numel()), chunk)):
            units.append(Unit(shard, part, rows[lo : lo + chunk], contiguous))
    return units


def plan_save(
    selected: list[tuple[TableShard, torch.Tensor | None]],
    budget_bytes: int,
    threads: int,
    max_rows: int,
) -> list[list[Unit]]:
    """The pieces of a save staged piece by piece: each block's rows to write (None: all),
    cut into units and grouped under the staging budget (``staging.split_budget``)."""
    arena, unit = split_budget(budget_bytes, threads)
    shards_rows = [
        (s, torch.arange(s.num_rows, device=s.weight.device) if r is None else r, r is None)
        for s, r in selected
    ]
    return plan_pieces(plan_units(shards_rows, max_rows, arena, unit), arena)


def plan_pieces(units: list[Unit], budget_bytes: int) -> list[list[Unit]]:
    """Groups units, in order, into pieces whose staged bytes fit the budget."""
    pieces: list[list[Unit]] = []
    current: list[Unit] = []
    used = 0
    for unit in units:
        size = unit.staged_bytes()
        if current and used + size > budget_bytes:
            pieces.append(current)
            current, used = [], 0
        current.append(unit)
        used += size
    if current or not pieces:
        pieces.append(current)
    return pieces


@torch.no_grad()
def stage(piece: list[Unit], arena: StagingArena, stream: Any | None = None) -> list[StagedUnit]:
    """Copies a piece's rows into the arena; ``stream`` is a side stream for GPU models, used
    when the arena is pinned host memory so copies do not block the training stream."""
    arena.reserve(sum(unit.staged_bytes() for unit in piece))
    if stream is not None and arena.device.type == "cpu":
        stream.wait_stream(torch.cuda.current_stream())
    else:
        stream = None
    staged = []
    for unit in piece:
        copies: dict[str, torch.Tensor] = {}
        for name, live in unit.tensors():
            out = arena.take((unit.num_rows, *live.shape[1:]), live.dtype)
            _copy_rows(live, unit, out, stream)
            copies[name] = out
        staged.append(StagedUnit.of(unit, unit.local_rows.cpu(), copies))
    return staged


class Stager:
    """Copies pieces into the staging arena, on a side stream for GPU models (shared by the
    saver and its persist: a plain object, so neither holds the other)."""

    def __init__(self, arena: StagingArena, stream: Any | None = None) -> None:
        self.arena = arena
        self.stream = stream

    def prepare(self, pieces: list[list[Unit]]) -> None:
        """Grows the arena once, to the save's largest piece, before any piece is staged: grown
        piece by piece, a larger piece would allocate its buffer while the previous piece's
        views (and so its buffer) are still alive, the two side by side above the budget."""
        self.arena.reserve(max(sum(unit.staged_bytes() for unit in piece) for piece in pieces))

    def __call__(self, piece: list[Unit]) -> list[StagedUnit]:
        failpoints.hit("save.stage")
        staged = stage(piece, self.arena, self.stream)
        if self.stream is not None:
            self.stream.synchronize()
        return staged


def _copy_rows(live: torch.Tensor, unit: Unit, out: torch.Tensor, stream: Any | None) -> None:
    source: torch.Tensor
    if unit.contiguous and unit.num_rows:
        lo = int(unit.local_rows[0])
        source = live[lo : lo + unit.num_rows]
    elif out.device == live.device:
        torch.index_select(live, 0, unit.local_rows, out=out)
        return
    else:
        source = live.index_select(0, unit.local_rows)
    if stream is not None:
        with torch.cuda.stream(stream):
            out.copy_(source, non_blocking=True)
    else:
        out.copy_(source)


def sample_unit(shard: TableShard) -> StagedUnit:
    """A few rows of a block's layout, valued like trained embeddings and their states: what
    the writer encodes to load its kernels before the first save."""
    rows = min(8, shard.num_rows)
    gen = torch.Generator().manual_seed(0)
    cols = shard.num_cols
    weights = (torch.randn(rows, cols, generator=gen) * 0.05).to(shard.weight.dtype)
    row_states = {
        n: torch.rand((rows, *t.shape[1:]), generator=gen).to(t.dtype)
        for n, t in shard.row_states.items()
    }
    elem_states = {
        n: torch.rand(rows, cols, generator=gen).to(t.dtype) for n, t in shard.elem_states.items()
    }
    local_rows = torch.arange(rows, dtype=torch.int64)
    unit = Unit(shard, 0, local_rows, True)
    return StagedUnit(unit, local_rows, weights, row_states, elem_states)
