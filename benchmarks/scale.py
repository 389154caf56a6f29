"""The metadata path at scale, simulated: what one checkpoint's manifest costs at 8 to 4,096
ranks and 26 to 10,000 tables, without row data.

Per world size W and table count T (``--worlds``, ``--tables``), synthetic shard metadata of a
DLRM-like plan: the ``large`` tables (100 of 1,000 or 10,000; 4 of Criteo's 26) row-wise over
every rank, 10M rows each; the others table-wise, round-robin, 20k rows each; 128 columns,
row-wise Adagrad, 65,536-row row groups. Each rank's checkpoint is what the writer makes of
it at the defaults: rows files of at most 2**20 rows per large-table block (their row groups
indexed), one packed file for its table-wise blocks (each a block of it: under 4 MB), its
rank file; rank 0's dense file.

What runs is the project's own code; what is simulated is said:

* **commit** (``commit_s``): the ranks' file entries gathered (the collective is simulated: each
  rank's entries pickled and unpickled, as ``all_gather_object`` does, not sent), the
  ``Manifest`` built and serialized (``to_json``) and written atomically
  (``CheckpointStore.write_atomic``) on local disk, as rank 0 does;
* **planning a restore** (``plan_s_per_rank``): one rank reads a chain of 6 manifests
  (``storage.chain.read_chain``, from local disk) and plans its reads
  (``read.plan.plan_reads`` with its blocks on the meta device); every rank does the same
  work, so one is timed; ``metadata_bytes_per_rank_restore`` and ``objects_per_rank_restore``
  are what it fetched (the chain's manifests, whole);
* **resharding** W -> 3W/4 (4,096 -> 3,072): the same plan for a rank of the new world size;
* ``objects_per_checkpoint``: distinct files plus the manifest.

Configurations whose manifest would exceed ``--max-entries`` file entries are skipped (say so
in ``skipped``). Writes ``benchmarks/results/scale.json``.

Run: ``python benchmarks/scale.py [--worlds 8,64,512,4096] [--tables 26,1000,10000]``
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from common import write_result  # noqa: E402

from embckpt.blocks import TableShard  # noqa: E402
from embckpt.read.plan import plan_reads  # noqa: E402
from embckpt.storage.chain import read_chain  # noqa: E402
from embckpt.storage.fs import CheckpointStore  # noqa: E402
from embckpt.storage.layout import MANIFEST_NAME  # noqa: E402
from embckpt.storage.manifest import (  # noqa: E402
    FileEntry,
    FileIndex,
    HistoryEntry,
    Manifest,
    RowGroupEntry,
    TableEntry,
)

COLS = 128
LARGE_ROWS = 10_000_000
SMALL_ROWS = 20_000  # 1.4 MB at 4 bits: packed (pack_below_bytes, 4 MB)
FILE_ROWS = 1 << 20  # max_file_rows: a block's rows files split at this many rows
GROUP_ROWS = 65_536
ROW_BYTES = 4 + COLS // 2 + 8  # a 4-bit row, its parameters and id (the sizes only shape bytes)
CHECKSUM = "crc32c:00000000"
CHAIN = 6


def large_count(tables: int) -> int:
    return 4 if tables <= 26 else 100


@dataclasses.dataclass(frozen=True)
class Plan:
    """Who holds which block: (table, rank, row_offset, rows)."""

    world: int
    tables: int

    def names(self) -> list[str]:
        return [f"sparse_arch.embedding_bag_collection.t{i:05d}" for i in range(self.tables)]

    def blocks(self) -> list[tuple[int, int, int, int]]:
        out = []
        large = large_count(self.tables)
        for t in range(self.tables):
            if t < large:
                per = -(-LARGE_ROWS // self.world)
                for r in range(self.world):
                    lo = r * per
                    if lo < LARGE_ROWS:
                        out.append((t, r, lo, min(per, LARGE_ROWS - lo)))
            else:
                out.append((t, t % self.world, 0, SMALL_ROWS))
        return out

    def table_entries(self) -> tuple[TableEntry, ...]:
        by_table: dict[int, list[tuple[int, int, int, int, int]]] = {}
        for t, r, lo, rows in self.blocks():
            by_table.setdefault(t, []).append((r, lo, 0, rows, COLS))
        names = self.names()
        large = large_count(self.tables)
        return tuple(
            TableEntry(
                name=names[t],
                rows=LARGE_ROWS if t < large else SMALL_ROWS,
                cols=COLS,
                dtype="float32",
                sharding_type="row_wise" if t < large else "table_wise",
                row_states=("momentum1",),
                shards=tuple(shards),
            )
            for t, shards in sorted(by_table.items())
        )


def _index(first_row: int, rows: int, offset: int) -> tuple[FileIndex, int]:
    groups = []
    for g0 in range(0, rows, GROUP_ROWS):
        n = min(GROUP_ROWS, rows - g0)
        groups.append(
            RowGroupEntry(
                first_row + g0, first_row + g0 + n - 1, n, offset, n * ROW_BYTES, CHECKSUM
            )
        )
        offset += n * ROW_BYTES
    return FileIndex(CHECKSUM, offset, CHECKSUM, tuple(groups)), offset


def rank_entries(plan: Plan, rank: int) -> list[FileEntry]:
    """The file entries one rank reports for one full checkpoint."""
    names = plan.names()
    large = large_count(plan.tables)
    entries: list[FileEntry] = []
    packed: list[tuple[int, int, int]] = []
    for t, r, lo, rows in plan.blocks():
        if r != rank:
            continue
        if t >= large:
            packed.append((t, lo, rows))
            continue
        for part, p0 in enumerate(range(0, rows, FILE_ROWS)):
            n = min(FILE_ROWS, rows - p0)
            index, end = _index(lo + p0, n, 4)
            path = f"tables/{names[t]}/r{lo}_c0.p{part}.parquet"
            weight = f"{names[t]}.weight"
            entry = FileEntry(path, end + 4096, CHECKSUM, "rows", rank, names[t], lo, 0, rows, COLS)
            entries.append(dataclasses.replace(entry, rows=n, fqn=weight, index=index))
    offset, first_group = 4, 0
    path = f"packed/rank_{rank:05d}.0.parquet"
    indexes = []
    for t, lo, rows in packed:
        index, offset = _index(lo, rows, offset)
        indexes.append((t, lo, rows, dataclasses.replace(index, first_group=first_group)))
        first_group += len(index.row_groups)
    for block, (t, lo, rows, index) in enumerate(indexes):
        index = dataclasses.replace(index, footer_offset=offset)
        entries.append(
            FileEntry(
                path,
                offset + 4096,
                CHECKSUM,
                "rows",
                rank,
                names[t],
                lo,
                0,
                rows,
                COLS,
                rows,
                f"{names[t]}.weight",
                index,
                block,
            )
        )
    entries.append(FileEntry(f"dense/rank_{rank:05d}.safetensors", 16_000, CHECKSUM, "rank", rank))
    if rank == 0:
        entries.append(FileEntry("dense/model.safetensors", 4_000_000, CHECKSUM, "dense", 0))
    return entries


def commit(
    store: CheckpointStore,
    plan: Plan,
    per_rank: list[list[FileEntry]],
    step: int,
    parent: int | None,
) -> dict[str, Any]:
    """Rank 0's commit of one checkpoint (the ranks' entries ``per_rank``); returns its costs."""
    started = time.perf_counter()
    sent = [pickle.dumps(entries) for entries in per_rank]  # what each rank sends
    gathered = [e for data in sent for e in pickle.loads(data)]
    gathered_s = time.perf_counter() - started
    manifest = Manifest(
        step=step,
        kind="full" if parent is None else "diff",
        policy="incremental",
        base_step=step if parent is None else 1,
        parent_step=parent,
        world_size=plan.world,
        codec={"id": "adaptive", "version": 1, "bits": 4},
        tables=plan.table_entries(),
        files=tuple(sorted(gathered, key=lambda f: f.path)),
        history=(HistoryEntry(step, "full" if parent is None else "diff", 1, 0.01),),
    )
    text = manifest.to_json().encode()
    store.write_atomic(store.step_path(step, MANIFEST_NAME), text)
    return {
        "commit_s": time.perf_counter() - started,
        "gather_s": gathered_s,
        "gathered_bytes": sum(len(d) for d in sent),
        "manifest_bytes": len(text),
        "file_entries": len(gathered),
        "objects_per_checkpoint": len({f.path for f in gathered}) + 1,
    }


def rank_shards(plan: Plan, rank: int) -> list[TableShard]:
    names = plan.names()
    return [
        TableShard(
            table=names[t],
            fqn=f"{names[t]}.weight",
            sharding_type="row_wise",
            row_offset=lo,
            col_offset=0,
            table_rows=LARGE_ROWS if t < large_count(plan.tables) else SMALL_ROWS,
            table_cols=COLS,
            weight=torch.empty((rows, COLS), device="meta"),
        )
        for t, r, lo, rows in plan.blocks()
        if r == rank
    ]


def plan_restore(store: CheckpointStore, step: int, plan: Plan, rank: int) -> dict[str, Any]:
    started = time.perf_counter()
    chain = read_chain(store, step)
    reads = plan_reads(chain, rank_shards(plan, rank))
    seconds = time.perf_counter() - started
    fetched = sum(os.path.getsize(store.step_path(m.step, MANIFEST_NAME)) for m in chain)
    return {"plan_s": seconds, "bytes": fetched, "objects": len(chain), "reads": len(reads)}


def measure(world: int, tables: int) -> dict[str, Any]:
    plan = Plan(world, tables)
    with tempfile.TemporaryDirectory() as root:
        store = CheckpointStore(root, fsync=False)
        per_rank = [rank_entries(plan, r) for r in range(plan.world)]  # the same each step
        commits = [
            commit(store, plan, per_rank, step, None if step == 1 else step - 1)
            for step in range(1, CHAIN + 1)
        ]
        last = commits[-1]
        planned = plan_restore(store, CHAIN, plan, rank=world // 2)
        resharded = plan_restore(store, CHAIN, Plan(max(1, world * 3 // 4), tables), rank=0)
    row = {
        "world_size": world,
        "tables": tables,
        "manifest_bytes": last["manifest_bytes"],
        "file_entries": last["file_entries"],
        "commit_s": last["commit_s"],
        "gather_s": last["gather_s"],
        "gathered_bytes": last["gathered_bytes"],
        "metadata_bytes_per_rank_restore": planned["bytes"],
        "objects_per_rank_restore": planned["objects"],
        "plan_s_per_rank": planned["plan_s"],
        "objects_per_checkpoint": last["objects_per_checkpoint"],
        "reshard_to": max(1, world * 3 // 4),
        "reshard_plan_s_per_rank": resharded["plan_s"],
        "reshard_metadata_bytes_per_rank": resharded["bytes"],
    }
    print(
        f"W={world:5} T={tables:6}: manifest {row['manifest_bytes'] / 1e6:8.1f} MB, "
        f"{row['file_entries']} entries, commit {row['commit_s']:6.2f} s, plan "
        f"{row['plan_s_per_rank']:6.2f} s/rank reading {planned['bytes'] / 1e6:8.1f} MB, "
        f"{row['objects_per_checkpoint']} objects",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="8,64,512,4096")
    parser.add_argument("--tables", default="26,1000,10000")
    parser.add_argument("--max-entries", type=int, default=500_000, help="skip larger manifests")
    parser.add_argument("--name", default="scale", help="result file name")
    args = parser.parse_args()
    results, skipped = [], []
    for world in [int(w) for w in args.worlds.split(",")]:
        for tables in [int(t) for t in args.tables.split(",")]:
            entries = len(Plan(world, tables).blocks()) + world
            if entries > args.max_entries:
                skipped.append({"world_size": world, "tables": tables, "file_entries": entries})
                continue
            results.append(measure(world, tables))
    path = write_result(
        args.name,
        {
            "args": vars(args),
            "design": "one manifest per checkpoint, every file entry in it",
            "results": results,
            "skipped": skipped,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
