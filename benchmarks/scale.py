"""The metadata path at scale, simulated: what one checkpoint's manifest costs at 8 to 4,096
ranks and 26 to 10,000 tables, without row data.

Per world size W and table count T (``--worlds``, ``--tables``), synthetic shard metadata of a
DLRM-like plan: the ``large`` tables (100 of 1,000 or 10,000; 4 of Criteo's 26) row-wise over
every rank, 10M rows each; the others table-wise, round-robin, 20k rows each; 128 columns,
row-wise Adagrad, 65,536-row row groups. Each rank's checkpoint is what the writer makes of
it at the defaults (``save/writer.py``): a block encoded at 4 bits into ``pack_below_bytes``
(4 MB) or more gets rows files of at most ``max_file_rows`` rows, the smaller ones share packed
files of up to 64 MB (as if handed to the writer in one piece); its rank file; rank 0's dense
file. Every checkpoint of the chain of 6 holds the same files (a diff writing as much as a full
is the worst case for metadata).

What runs is the project's own code; what is simulated is said:

* **each rank's part** (``rank_part_s``, once per rank, in parallel on a real job): its rank
  file encoded with its index (``dense.encode_tree``, ``storage.rank_parts.index_metadata``,
  ``part_of``) and written (``CheckpointStore.write_file``) into the step folder;
* **commit** (``commit_s``, rank 0): the ranks' reports gathered (the collective is simulated:
  each rank's report pickled and unpickled, as ``all_gather_object`` does, not sent), the
  manifest built (``save.commit_manifest.build_manifest``, which every rank runs), serialized
  and written atomically (``CheckpointStore.write_atomic``), on local disk;
* **planning a restore** (``plan_s_per_rank``): one rank reads the chain of 6
  (``storage.chain.read_chain`` with ``read.plan.writer_ranks`` picking the parts it needs)
  and plans its reads (``read.plan.plan_reads``, its blocks on the meta device); every rank
  does the same work, so one is timed. ``metadata_bytes_per_rank_restore`` and
  ``objects_per_rank_restore`` count every read it made (manifests, parts' headers). Not
  included: the model checks (``check_model_matches``), which need a model;
* **resharding** W -> 3W/4 (4,096 -> 3,072): the same for a rank of the new world size;
  ``reshard_side_state_bytes_per_rank`` is what the side state reads besides: every writer's
  rank file, whole (their statefuls are compared; not timed here), on rank 0 (on every rank
  for a model with managed-collision tables);
* ``objects_per_checkpoint``: distinct files plus the manifest.

Configurations whose file entries would exceed ``--max-entries`` are skipped (say so in
``skipped``). Writes ``benchmarks/results/scale.json``; ``--before`` keeps a result file's
``results`` under ``before`` (the figures of the format-4 design, one manifest listing every
file).

Run: ``python benchmarks/scale.py [--worlds 8,64,512,4096] [--tables 26,1000,10000]``
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gc
import json
import multiprocessing
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

sys.path.insert(0, str(Path(__file__).parent))

from common import write_result  # noqa: E402

from embckpt import dense  # noqa: E402
from embckpt.blocks import TableShard  # noqa: E402
from embckpt.config import CheckpointConfig  # noqa: E402
from embckpt.policy import Decision, Kind  # noqa: E402
from embckpt.read.plan import plan_reads, writer_ranks  # noqa: E402
from embckpt.save.commit_manifest import CommitFacts, Reported, build_manifest  # noqa: E402
from embckpt.save.writer import PACKED_FILE_BYTES  # noqa: E402
from embckpt.storage.chain import read_chain  # noqa: E402
from embckpt.storage.checksum import checksum  # noqa: E402
from embckpt.storage.fs import CheckpointStore  # noqa: E402
from embckpt.storage.layout import (  # noqa: E402
    DENSE_FILE,
    MANIFEST_NAME,
    packed_rows_file,
    rank_file,
    rows_file,
)
from embckpt.storage.manifest import (  # noqa: E402
    FileEntry,
    FileIndex,
    Manifest,
    PartEntry,
    RowGroupEntry,
    TableEntry,
    WrittenFile,
)
from embckpt.storage.rank_parts import index_metadata, part_of  # noqa: E402

COLS = 128
LARGE_ROWS = 10_000_000
SMALL_ROWS = 20_000  # 1.4 MB at 4 bits: packed (pack_below_bytes, 4 MB)
FILE_ROWS = CheckpointConfig.max_file_rows  # a block's rows files split at this many rows
GROUP_ROWS = CheckpointConfig.row_group_rows
PACK_BELOW = CheckpointConfig.pack_below_bytes
ROW_BYTES = 4 + COLS // 2 + 8  # a 4-bit row, its parameters and id (the sizes only shape bytes)
RANK_STATE = {"rng": torch.zeros(5056, dtype=torch.uint8), "data": {"position": 0}}
"""A rank file's state besides its index: the CPU RNG's state and a data position."""
CHECKSUM = "crc32c:00000000"
CHAIN = 6
PLAN_RUNS = 3


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


def rank_rows(plan: Plan, rank: int) -> list[FileEntry]:
    """The rows entries one rank writes for one checkpoint, by the writer's rules."""
    names = plan.names()
    entries: list[FileEntry] = []
    packed: list[tuple[str, int, int]] = []
    for t, r, lo, rows in plan.blocks():
        if r != rank:
            continue
        if rows * ROW_BYTES < PACK_BELOW:
            packed.append((names[t], lo, rows))
            continue
        for part, p0 in enumerate(range(0, rows, FILE_ROWS)):
            n = min(FILE_ROWS, rows - p0)
            index, end = _index(lo + p0, n, 4)
            path = rows_file(names[t], lo, 0, part, False)
            entry = FileEntry(path, end + 4096, CHECKSUM, "rows", rank, names[t], lo, 0, rows, COLS)
            entries.append(
                dataclasses.replace(entry, rows=n, fqn=f"{names[t]}.weight", index=index)
            )
    files: list[list[tuple[str, int, int]]] = [[]]
    size = 0
    for block in packed:
        if size >= PACKED_FILE_BYTES:
            files.append([])
            size = 0
        files[-1].append(block)
        size += block[2] * ROW_BYTES
    for number, blocks in enumerate(f for f in files if f):
        path = packed_rows_file(rank, number)
        offset, first_group, indexes = 4, 0, []
        for table, lo, rows in blocks:
            index, offset = _index(lo, rows, offset)
            indexes.append((table, lo, rows, dataclasses.replace(index, first_group=first_group)))
            first_group += len(index.row_groups)
        for block, (table, lo, rows, index) in enumerate(indexes):
            index = dataclasses.replace(index, footer_offset=offset)
            entries.append(
                FileEntry(
                    path,
                    offset + 4096,
                    CHECKSUM,
                    "rows",
                    rank,
                    table,
                    lo,
                    0,
                    rows,
                    COLS,
                    rows,
                    f"{table}.weight",
                    index,
                    block,
                )
            )
    return entries


def rank_part(rows: list[FileEntry], rank: int) -> tuple[bytes, PartEntry]:
    """A rank's rank file (its state and the index of ``rows``) and the manifest's record."""
    data = dense.encode_tree(RANK_STATE, metadata=index_metadata(rows))
    written = WrittenFile(rank_file(rank), len(data), checksum(data))
    return data, part_of(rank, data, written, rows)


def commit(
    store: CheckpointStore,
    plan: Plan,
    reports: list[tuple[Reported, dict[str, float]]],
    own_rows: list[FileEntry],
    step: int,
    head: Manifest | None,
) -> tuple[Manifest, dict[str, Any]]:
    """Rank 0's commit of one checkpoint (``reports``: every rank's); returns the manifest and
    its costs."""
    started = time.perf_counter()
    sent = [pickle.dumps(report) for report in reports]  # what each rank sends
    gathered = [pickle.loads(data) for data in sent]
    gathered_s = time.perf_counter() - started
    facts = CommitFacts(
        step=step,
        decision=Decision(Kind.FULL if head is None else Kind.DIFF),
        policy="incremental",
        world_size=plan.world,
        rank=0,
        codec={"id": "adaptive", "version": 1, "bits": 4},
        tables=plan.table_entries(),
        head=head,
        full_fp32_bytes=0,
        dirty_fraction=0.01,
        touched_fraction=0.01,
        started=started,
        restores=0,
    )
    manifest = build_manifest(facts, gathered, own_rows)
    text = manifest.to_json().encode()
    store.write_atomic(store.step_path(step, MANIFEST_NAME), text)
    return manifest, {
        "commit_s": time.perf_counter() - started,
        "gather_s": gathered_s,
        "gathered_bytes": sum(len(d) for d in sent),
        "manifest_bytes": len(text),
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


class CountingStore(CheckpointStore):
    """A store that counts what a reader fetches: objects and bytes."""

    objects = 0
    bytes = 0

    def read_file(self, step: int, relative: str) -> pa.Buffer:
        data = super().read_file(step, relative)
        self.objects += 1
        self.bytes += data.size
        return data

    def read_head(self, step: int, relative: str, length: int) -> bytes:
        data = super().read_head(step, relative, length)
        self.objects += 1
        self.bytes += len(data)
        return data


def plan_restore(root: str, step: int, plan: Plan, rank: int) -> dict[str, Any]:
    """One rank's restore plan of the chain ending at ``step``, read and timed ``PLAN_RUNS``
    times after one untimed read (imports, page cache); the median is reported, and the
    slowest."""
    store = CountingStore(root, fsync=False)
    shards = rank_shards(plan, rank)
    read_chain(store, step, lambda m: writer_ranks(m, shards))
    seconds = []
    for _ in range(PLAN_RUNS):
        store.objects = store.bytes = 0
        started = time.perf_counter()
        chain = read_chain(store, step, lambda m: writer_ranks(m, shards))
        reads = plan_reads(chain, shards)
        seconds.append(time.perf_counter() - started)
    parts = sorted({f.rank for m in chain for f in m.files if f.role == "rows"})
    return {
        "plan_s": statistics.median(seconds),
        "plan_s_max": max(seconds),
        "bytes": store.bytes,
        "objects": store.objects,
        "reads": len(reads),
        "writer_ranks": parts[:8],
    }


def measure(world: int, tables: int) -> dict[str, Any]:
    plan = Plan(world, tables)
    rows = [rank_rows(plan, r) for r in range(plan.world)]  # the same each step
    started = time.perf_counter()
    parts = [rank_part(rows[r], r) for r in range(plan.world)]
    part_s = (time.perf_counter() - started) / world
    # Every simulated rank's entries stay out of the collector's passes: a real rank 0 does
    # not hold the others' files, and the commit timed below would pay for walking them.
    gc.freeze()
    dense_entry = FileEntry(DENSE_FILE, 4_000_000, CHECKSUM, "dense", 0)
    reports = [
        (Reported(part, [dense_entry] if r == 0 else []), {"write": 1.0})
        for r, (_, part) in enumerate(parts)
    ]
    with tempfile.TemporaryDirectory() as root:
        store = CheckpointStore(root, fsync=False)
        head: Manifest | None = None
        commits = []
        for step in range(1, CHAIN + 1):
            for r, (data, _) in enumerate(parts):
                store.write_file(step, rank_file(r), data)
            head, costs = commit(store, plan, reports, rows[0], step, head)
            commits.append(costs)
        full, last = commits[0], commits[-1]
        new_world = max(1, world * 3 // 4)
        # Each in a fresh interpreter, as a rank plans: not amid every simulated rank's objects
        # (whose garbage-collector passes would be timed otherwise).
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
            planned = pool.submit(plan_restore, root, CHAIN, plan, world // 2).result()
            resharded = pool.submit(
                plan_restore, root, CHAIN, Plan(new_world, tables), new_world // 2
            ).result()
    gc.unfreeze()
    objects = len({e.path for r in rows for e in r}) + world + 2  # rank files, dense, manifest
    row = {
        "world_size": world,
        "tables": tables,
        "manifest_bytes": full["manifest_bytes"],
        "diff_manifest_bytes": last["manifest_bytes"],
        "file_entries": sum(len(r) for r in rows) + world + 1,
        "rank_part_s": part_s,
        "rank_part_bytes": max(p.bytes for _, p in parts),
        "commit_s": max(c["commit_s"] for c in commits),
        "full_commit_s": full["commit_s"],
        "diff_commit_s": last["commit_s"],
        "gather_s": last["gather_s"],
        "gathered_bytes": last["gathered_bytes"],
        "metadata_bytes_per_rank_restore": planned["bytes"],
        "objects_per_rank_restore": planned["objects"],
        "plan_s_per_rank": planned["plan_s"],
        "plan_s_per_rank_max": planned["plan_s_max"],
        "objects_per_checkpoint": objects,
        "objects_per_rank": objects / world,
        "reshard_to": new_world,
        "reshard_plan_s_per_rank": resharded["plan_s"],
        "reshard_metadata_bytes_per_rank": resharded["bytes"],
        "reshard_objects_per_rank": resharded["objects"],
        "reshard_writer_ranks": resharded["writer_ranks"],
        # Onto another world size, rank 0 also reads every writer's rank file whole for the
        # statefuls (read/side_state.py; every rank does on a model with managed-collision
        # tables): not planning, but metadata-sized reads.
        "reshard_side_state_bytes_per_rank": sum(p.bytes for _, p in parts),
    }
    print(
        f"W={world:5} T={tables:6}: manifest {row['manifest_bytes'] / 1e6:6.2f} MB (diff "
        f"{row['diff_manifest_bytes'] / 1e6:5.2f}), "
        f"commit {row['commit_s']:5.2f} s, plan {row['plan_s_per_rank']:5.2f} s/rank reading "
        f"{planned['bytes'] / 1e6:6.2f} MB in {planned['objects']} objects, reshard "
        f"{row['reshard_plan_s_per_rank']:5.2f} s reading {resharded['bytes'] / 1e6:6.2f} MB, "
        f"{objects} objects ({row['objects_per_rank']:.2f}/rank)",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="8,64,512,4096")
    parser.add_argument("--tables", default="26,1000,10000")
    parser.add_argument("--max-entries", type=int, default=500_000, help="skip larger plans")
    parser.add_argument("--name", default="scale", help="result file name")
    parser.add_argument("--before", help="a result file whose results to keep as 'before'")
    args = parser.parse_args()
    before = json.loads(Path(args.before).read_text()) if args.before else None
    results, skipped = [], []
    for world in [int(w) for w in args.worlds.split(",")]:
        for tables in [int(t) for t in args.tables.split(",")]:
            entries = len(Plan(world, tables).blocks()) + world
            if entries > args.max_entries:
                skipped.append({"world_size": world, "tables": tables, "file_entries": entries})
                continue
            results.append(measure(world, tables))
    body: dict[str, Any] = {
        "args": vars(args),
        "design": "format 5: a manifest of parts, each rank's rows files indexed in its rank file",
        "results": results,
        "skipped": skipped,
    }
    if before is not None:
        body["before"] = {"design": before.get("design"), "results": before["results"]}
    print(f"wrote {write_result(args.name, body)}")


if __name__ == "__main__":
    main()
