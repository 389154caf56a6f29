"""The tables a follower serves: one copy of each, brought from step to step in place.

A restore applies a chain link by link, base first, each link's rows replacing (or, for an
additive codec, adding to) what the older links left (``read/chain_pass.py`` keeps exactly
that order of float operations). So applying only a new checkpoint's files onto the tables of
its parent gives, bit for bit, what a restore of the new checkpoint gives: the follower reads
each checkpoint once.

A diff whose parent is not the served step (a one-shot diff: its parent is the chain's full)
needs the tables as they were at that parent. Tables go back to their full exactly: for every
row a diff has changed since the full, the full's value is kept (:class:`_FullRows`), and
:meth:`ServedTables.rewind` writes them back. Those rows are the memory a follower holds beyond
one copy of the tables: the rows its diffs replaced.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from embckpt.blocks import TableShard
from embckpt.dtypes import dtype_from_name
from embckpt.read.apply import apply_staged
from embckpt.read.plan import plan_reads
from embckpt.read.stage import ReadCost, StagedFile, release, stage
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.manifest import Manifest


@dataclass
class StagedLink:
    """One checkpoint's rows files, fetched and checked, ready to apply."""

    manifest: Manifest
    files: list[StagedFile]
    cost: ReadCost

    def close(self) -> None:
        release(self.files)


@dataclass
class _FullRows:
    """The full's values of the rows diffs changed since it."""

    ids: torch.Tensor  # int64, unique, on the table's device
    values: torch.Tensor  # [len(ids), cols]


class ServedTables:
    """Whole tables, one tensor each, on ``device``, holding the state of :attr:`links`.

    Args:
        device: where the tables live (``cpu`` or a CUDA device).
        threads: reader threads for fetching and decoding.
    """

    def __init__(self, device: torch.device, threads: int) -> None:
        self.device = device
        self.threads = threads
        self.shards: dict[str, TableShard] = {}
        self.links: list[int] = []
        """The chain of the served step, full first; empty before the first full."""
        self._full_rows: dict[str, _FullRows] = {}

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: shard.weight for name, shard in self.shards.items()}

    def held_rows(self) -> int:
        """Rows held beyond the tables: the full's values of the rows diffs replaced."""
        return sum(len(f.ids) for f in self._full_rows.values())

    def shards_for(self, full: Manifest) -> dict[str, TableShard]:
        """The blocks a full's tables are applied into: the served tensors where a table keeps
        its shape and type, new ones where it is new or changed (a rebase onto a model whose
        tables changed; the old tensors stay the served step's until the swap)."""
        shards = {}
        for table in full.tables:
            dtype = dtype_from_name(table.dtype)
            old = self.shards.get(table.name)
            if old is not None and tuple(old.weight.shape) == (table.rows, table.cols):
                if old.weight.dtype == dtype:
                    shards[table.name] = old
                    continue
            weight = torch.zeros(table.rows, table.cols, dtype=dtype, device=self.device)
            shards[table.name] = TableShard(
                table=table.name,
                fqn=table.name,
                sharding_type="unsharded",
                row_offset=0,
                col_offset=0,
                table_rows=table.rows,
                table_cols=table.cols,
                weight=weight,
            )
        return shards

    def stage(
        self, store: CheckpointStore, manifest: Manifest, shards: Mapping[str, TableShard]
    ) -> StagedLink:
        """Fetches and checks one checkpoint's rows files for ``shards`` (nothing applied)."""
        reads = plan_reads([manifest], list(shards.values()))
        by_position, cost = stage(store, 1, reads, threads=self.threads, progress=False)
        return StagedLink(manifest, by_position[0], cost)

    def rebase(self, shards: dict[str, TableShard], full: StagedLink) -> None:
        """Serves ``shards`` holding ``full``: its rows written over every cell."""
        self._full_rows = {}
        self.shards = shards
        self.links = []
        apply_staged([full.files], self.threads)
        self.links = [full.manifest.step]

    def rewind(self) -> None:
        """The tables back to the chain's full: the kept rows written back."""
        with torch.no_grad():
            for name, full in self._full_rows.items():
                self.shards[name].weight[full.ids] = full.values
        self._full_rows = {}
        self.links = self.links[:1]

    def update(self, diffs: Sequence[StagedLink], rewind: bool) -> None:
        """Goes back to the full first if ``rewind``, then applies ``diffs``, each one's parent
        the link before it. All or nothing: the rows it may change are copied first, and
        written back if anything fails."""
        touched = self._touched([file for diff in diffs for file in diff.files], rewind)
        before = {name: self.shards[name].weight[ids].clone() for name, ids in touched.items()}
        kept, links = dict(self._full_rows), list(self.links)
        try:
            if rewind:
                self.rewind()
            for diff in diffs:
                self._apply(diff)
        except BaseException:
            with torch.no_grad():
                for name, ids in touched.items():
                    self.shards[name].weight[ids] = before[name]
            self._full_rows, self.links = kept, links
            raise

    def _apply(self, diff: StagedLink) -> None:
        for name, ids in self._touched(diff.files, rewind=False).items():
            kept = self._full_rows.get(name)
            if kept is not None:
                ids = ids[~torch.isin(ids, kept.ids)]
            self._keep_full_rows(name, ids, self.shards[name].weight[ids].clone())
        apply_staged([diff.files], self.threads)
        self.links.append(diff.manifest.step)

    def _touched(self, files: Sequence[StagedFile], rewind: bool) -> dict[str, torch.Tensor]:
        """The rows each table's ``files`` give (with ``rewind``, and the kept full rows),
        ascending and unique."""
        by_table: dict[str, list[np.ndarray]] = {}
        for file in files:
            by_table.setdefault(file.read.entry.table, []).append(file.rows)
        for name, full in self._full_rows.items() if rewind else ():
            by_table.setdefault(name, []).append(full.ids.cpu().numpy())
        return {
            name: torch.from_numpy(np.unique(np.concatenate(rows))).to(self.device)
            for name, rows in by_table.items()
            if name in self.shards
        }

    def _keep_full_rows(self, name: str, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Keeps the full's values of rows no earlier diff replaced (``ids``, ``values``)."""
        kept = self._full_rows.get(name)
        if kept is not None:
            ids, values = torch.cat([kept.ids, ids]), torch.cat([kept.values, values])
        self._full_rows[name] = _FullRows(ids, values)
