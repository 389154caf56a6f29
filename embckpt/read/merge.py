"""Checkpoint merging (LC-Checkpoint): fold a chain into one self-contained checkpoint.

``merge(store, step)`` rewrites checkpoint ``step`` as a full checkpoint that restores bit for
bit what its chain (full base, then diffs) restores, so it no longer needs its base or parents.

Every rows file carries its own codec metadata (Huffman tables, k-means codebooks, parameter
dtypes), so encoded bytes are only ever decoded under the metadata of the file they came from:

1. per table block (same table, offsets and shape in every checkpoint of the chain; a chain
   written by different sharding plans is refused), every row's *winner* is the newest chain
   file holding it (files in chain order, as a restore applies them: the newest write wins);
2. rows whose winner has a codec that replaces rows (not ``additive``): a restore leaves
   exactly that file's decoded row, so the merged file of that source keeps the winner's
   encoded bytes (an Arrow ``take`` of each column) under the winner's own metadata (codec,
   codec_meta, state codec, elem_meta) and Parquet compression. Nothing is decoded or
   quantized again;
3. rows whose winner has an ``additive`` codec (``exponent`` and ``delta`` diffs, which a
   restore *adds* to the rows restored so far): the block is rebuilt by the reader itself
   (``plan_reads``, ``stage``, ``apply_staged`` into a zeroed block of the table's dtype, the
   code path of a restore), and those rows are stored with the lossless ``raw`` codec in that
   dtype. Optimizer states are never added to (element-wise states of an additive state codec
   are refused), so a row's row-wise and element-wise states are always the winner's, copied
   as encoded (a row-wise state under a lossy state codec, ``log8``, included: quantized once,
   when it was saved);
4. one merged file per (block, source file that still wins rows), each with a fresh row-group
   index, so partial reads still work; dense and per-rank files are kept as they are.

Crash safety, under the directory lock: new files go under a folder of the step that no file
of the old manifest uses (``merged/``), then the new manifest replaces the old one in one
atomic rename, then every file the new manifest does not list is deleted (the old files and
debris of earlier killed merges). A kill at any point leaves either the old or the new
checkpoint committed, each complete; debris is never listed, so ``verify`` stays clean. Later
diffs whose parent is ``step`` stay correct: the merged step restores the same state.
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import torch

from embckpt import failpoints
from embckpt.blocks import TableShard
from embckpt.codecs import codec_from_config, make_codec
from embckpt.codecs.base import EncodedRows
from embckpt.dtypes import dtype_from_name
from embckpt.errors import EmbckptError
from embckpt.read.apply import read_into
from embckpt.storage.chain import read_chain
from embckpt.storage.checksum import ALGORITHM
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import MANIFEST_NAME, merged_prefix, merged_rows_file
from embckpt.storage.lock import DirectoryLock
from embckpt.storage.manifest import (
    FORMAT_VERSION,
    QUALIFIED_TABLES_VERSION,
    FileEntry,
    HistoryEntry,
    Manifest,
    TableEntry,
    files_bytes,
)
from embckpt.storage.rowfile import ELEM_STATE_PREFIX, STATE_PREFIX
from embckpt.storage.rowfile_read import RowBatch
from embckpt.storage.rowfile_write import encode_file, index_file

_BlockKey = tuple[str, int, int, int, int]
# Rebuilt by encode_file from the encoded columns.
_FILE_META = ("codec_meta", "elem_meta", "state_meta")


@dataclasses.dataclass
class _Source:
    """One rows file of the chain, read whole and checked, with what its codecs are."""

    step: int
    entry: FileEntry
    batch: RowBatch
    compression: dict[str, str]  # Parquet compression of each column, as written
    additive: bool  # the row codec adds to earlier rows


def _key(entry: FileEntry) -> _BlockKey:
    return (entry.table, entry.row_offset, entry.col_offset, entry.shard_rows, entry.shard_cols)


def _latest_rows(rows: np.ndarray) -> np.ndarray:
    """Indices of the last occurrence of each row id, in ascending row id order."""
    _, first_from_end = np.unique(rows[::-1], return_index=True)
    return len(rows) - 1 - first_from_end


def merge(store: CheckpointStore, step: int, row_group_rows: int = 65536) -> Manifest:
    """Rewrites checkpoint ``step`` as one self-contained full checkpoint (see module doc).

    Holds the directory lock throughout: a merge rewrites a committed manifest and deletes
    files, which must not race a job saving or cleaning up in the same directory.

    Raises:
        DirectoryLockedError: another live job holds the directory.
        EmbckptError: the chain's blocks do not line up (written by different sharding plans),
            rows of an additive codec have no earlier full version to add to, or element-wise
            optimizer states were written with an additive codec.
        CheckpointCorruptError / ChainIncompleteError: a file or link of the chain is bad.
        EmbckptError: anything else failed (a write, say); the step is as it was.
    """
    lock = DirectoryLock(store.fs, store.root, store.is_local)
    lock.acquire()
    try:
        return _merge_locked(store, step, row_group_rows)
    except EmbckptError:
        raise
    except Exception as exc:  # storage or a bug: the committed step is unchanged either way
        raise EmbckptError(f"merging step {step} of {store.uri} failed: {exc}") from exc
    finally:
        lock.release()


def _merge_locked(store: CheckpointStore, step: int, row_group_rows: int) -> Manifest:
    chain = read_chain(store, step)
    head = chain[-1]
    if len(chain) == 1:
        _delete_unlisted(store, head)  # debris of a merge killed after its commit
        return head
    blocks = _blocks(chain, step)
    tables = {t.name: t for m in chain for t in m.tables}  # the newest entry of each table
    prefix = _fresh_prefix(head)
    files: list[FileEntry] = []
    for key, entries in sorted(blocks.items()):
        if key[0] not in tables:
            raise EmbckptError(f"step {step}: table {key[0]!r} is in no manifest's table list")
        files.extend(
            _merge_block(store, chain, key, entries, tables[key[0]], prefix, row_group_rows)
        )
    files.extend(entry for entry in head.files if entry.role != "rows")  # kept in place
    total = files_bytes(files)
    merged = dataclasses.replace(
        head,
        kind="full",
        base_step=step,
        parent_step=None,
        files=tuple(sorted(files, key=lambda f: f.path)),
        # Every file listed here: the rank files' indexes list the chain's files, not these.
        parts=(),
        tables_from=None,
        loaded=None,
        history=(HistoryEntry(step, "full", total, 1.0),),
        # The files it writes are this version's, whatever the head was written with; its
        # table names stay the chain's (bare before format 3).
        format_version=FORMAT_VERSION if head.qualified_tables else QUALIFIED_TABLES_VERSION - 1,
        checksum_algorithm=ALGORITHM,
        stats={
            **head.stats,
            "merged_from": [m.step for m in chain],
            "rows_written": sum(f.rows for f in files if f.role == "rows"),
        },
    )
    failpoints.hit("merge.write")
    store.write_atomic(store.step_path(step, MANIFEST_NAME), merged.to_json().encode())
    _delete_unlisted(store, merged)
    return merged


def _blocks(chain: Sequence[Manifest], step: int) -> dict[_BlockKey, list[tuple[int, FileEntry]]]:
    """Every rows file of the chain by table block, in chain order, as (step, entry).

    Raises:
        EmbckptError: a diff has a block the base does not (another sharding plan).
    """
    by_block: dict[_BlockKey, list[tuple[int, FileEntry]]] = defaultdict(list)
    for manifest in chain:
        for entry in manifest.files:
            if entry.role == "rows":
                by_block[_key(entry)].append((manifest.step, entry))
    base_blocks = {_key(e) for e in chain[0].files if e.role == "rows"}
    stray = set(by_block) - base_blocks
    if stray:
        raise EmbckptError(
            f"step {step}: blocks {sorted(stray)[:3]} are not in base {chain[0].step}; the chain "
            "was written by different sharding plans and cannot be merged block by block"
        )
    return by_block


def _fresh_prefix(head: Manifest) -> str:
    """A folder of the step that no file of the old manifest lives in: new files never
    overwrite a file the committed manifest still needs."""
    taken = 0
    while any(f.path.startswith(merged_prefix(taken)) for f in head.files):
        taken += 1
    return merged_prefix(taken)


def _read_source(store: CheckpointStore, step: int, entry: FileEntry) -> _Source:
    """Reads and checks one rows file of the chain (a packed file's block: its own row
    groups, each checked); rebuilds its codecs from its metadata.

    Raises:
        EmbckptError: element-wise states of an additive codec: even the base's are added to
            whatever state the restored model held, which no full checkpoint can reproduce.
    """
    path = store.step_path(step, entry.path)
    checked = store.open_rows(step, entry, None)  # the whole file, or a packed block's groups
    try:
        batch = checked.read_all()
        compression = checked.compression()
    finally:
        checked.close()
    if batch.elem_states and codec_from_config(batch.header["state_codec"]).additive:
        raise EmbckptError(
            f"{path}: element-wise optimizer states use an additive codec "
            f"({batch.header['state_codec']}); such a chain cannot be merged exactly"
        )
    return _Source(
        step=step,
        entry=entry,
        batch=batch,
        compression=compression,
        additive=codec_from_config(batch.header["codec"]).additive,
    )


def _merge_block(
    store: CheckpointStore,
    chain: Sequence[Manifest],
    key: _BlockKey,
    entries: Sequence[tuple[int, FileEntry]],
    table: TableEntry,
    prefix: str,
    row_group_rows: int,
) -> list[FileEntry]:
    """Writes the merged files of one table block: one per source file that still wins rows."""
    sources = [_read_source(store, s, e) for s, e in entries]
    rows = np.concatenate([s.batch.rows for s in sources])
    owner = np.repeat(np.arange(len(sources)), [len(s.batch.rows) for s in sources])
    local = np.concatenate([np.arange(len(s.batch.rows)) for s in sources])
    latest = _latest_rows(rows)
    win_owner, win_local = owner[latest], local[latest]
    winning = [i for i in range(len(sources)) if np.any(win_owner == i)]
    rebuilt = None
    if any(sources[i].additive for i in winning):
        _check_has_base(sources, rows, owner, win_owner, rows[latest], key)
        rebuilt = _reconstruct(store, chain, key, table)
    files = []
    for i in winning:
        source = sources[i]
        picked = win_local[win_owner == i]  # ascending: a file's rows are sorted by row id
        weights = None
        if rebuilt is not None and source.additive:
            weights = rebuilt[torch.from_numpy(source.batch.rows[picked] - key[1])]
        data = _encode_winners(source, picked, weights, row_group_rows)
        table_name, row_off, col_off, _, _ = key
        relative = merged_rows_file(prefix, table_name, row_off, col_off, source.step, i)
        index = index_file(data)
        written = store.write_file(chain[-1].step, relative, data, index.file_checksum)
        files.append(
            dataclasses.replace(
                source.entry,
                path=written.path,
                bytes=written.bytes,
                checksum=written.checksum,
                rows=len(picked),
                index=index,
                block=None,  # merged files hold one block each
            )
        )
    return files


def _check_has_base(
    sources: Sequence[_Source],
    rows: np.ndarray,
    owner: np.ndarray,
    win_owner: np.ndarray,
    win_rows: np.ndarray,
    key: _BlockKey,
) -> None:
    """A delta row needs a plain version earlier in the chain: a restore adds the deltas to
    it; without one the sum depends on the model restored into, which no full file can hold.

    Raises:
        EmbckptError: names the block and a row without a plain version.
    """
    plain = np.array([not s.additive for s in sources])
    delta_won = np.array([s.additive for s in sources])[win_owner]
    orphans = win_rows[delta_won & ~np.isin(win_rows, rows[plain[owner]])]
    if len(orphans):
        raise EmbckptError(
            f"block {key}: row {int(orphans[0])} (and {len(orphans) - 1} more) appear only in "
            "files of an additive codec; the chain has no full version of them to merge into"
        )


def _reconstruct(
    store: CheckpointStore, chain: Sequence[Manifest], key: _BlockKey, table: TableEntry
) -> torch.Tensor:
    """The block's weights as a restore of the chain leaves them, rebuilt by the restore's own
    reader (plan, stage, apply: additive rows added in the same order and dtype), so merged rows are
    the very values a restore of the chain produces."""
    name, row_off, col_off, rows, cols = key
    shard = TableShard(
        table=name,
        fqn="",
        sharding_type="merge",
        row_offset=row_off,
        col_offset=col_off,
        table_rows=table.rows,
        table_cols=table.cols,
        weight=torch.zeros(rows, cols, dtype=dtype_from_name(table.dtype)),
    )
    read_into(store, chain, [shard])
    return shard.weight


def _encode_winners(
    source: _Source, picked: np.ndarray, weights: torch.Tensor | None, row_group_rows: int
) -> pa.Buffer:
    """One Parquet file of the rows ``picked`` (local indices) of ``source``: its encoded bytes
    (weights, optimizer states) under its own metadata and compression, except the rebuilt
    ``weights`` (given for additive codecs), stored ``raw`` in the table's dtype."""
    batch = source.batch
    take = pa.array(picked, type=pa.int64())
    meta = {k: v for k, v in batch.header.items() if k not in _FILE_META}
    if weights is not None:
        raw = make_codec("raw")
        encoded = raw.encode(weights)
        meta["codec"] = raw.get_config()
    else:
        columns = {name: col.take(take) for name, col in batch.encoded.columns.items()}
        kept = {c: source.compression[c] for c in columns}
        encoded = EncodedRows(columns=columns, metadata=batch.encoded.metadata, compression=kept)
    elem_states = {name: _take(state, take) for name, state in batch.elem_states.items()}
    state_compression = {
        c: v
        for c, v in source.compression.items()
        if c.startswith((ELEM_STATE_PREFIX, STATE_PREFIX))
    }
    encoded = dataclasses.replace(encoded, compression={**encoded.compression, **state_compression})
    row_states = {
        name: values[picked] if isinstance(values, np.ndarray) else _take(values, take)
        for name, values in batch.row_states.items()
    }
    return encode_file(batch.rows[picked], encoded, row_states, elem_states, meta, row_group_rows)


def _take(state: EncodedRows, take: pa.Array) -> EncodedRows:
    """The rows ``take`` of an encoded optimizer state, still encoded, under its metadata."""
    columns = {col: values.take(take) for col, values in state.columns.items()}
    return EncodedRows(columns=columns, metadata=state.metadata)


def _delete_unlisted(store: CheckpointStore, manifest: Manifest) -> None:
    """Deletes every file of the step folder that ``manifest`` (committed) does not list:
    the chain files it replaced and debris of merges killed earlier; then emptied folders.

    Never deletes what a listed file needs: a path spelled unlike the folder is not guessed
    at, and on local disks nothing whose real path is, or holds, a listed file's real path
    (a listed name may be a symbolic link to an unlisted one inside the folder).
    """
    base = store.step_path(manifest.step).rstrip("/") + "/"
    keep = {f.path for f in manifest.files} | {MANIFEST_NAME}
    try:
        infos = store.fs.get_file_info(pafs.FileSelector(base, recursive=True))
    except FileNotFoundError:
        return
    real_keep = {os.path.realpath(base + path) for path in keep} if store.is_local else set()

    def needed(relative: str, folder: bool) -> bool:
        if not store.is_local:
            return False
        real = os.path.realpath(base + relative)
        return any(k.startswith(real + "/") for k in real_keep) if folder else real in real_keep

    found = [(i.path[len(base) :], i.type) for i in infos if i.path.startswith(base)]
    left = set(keep)
    for relative, kind in found:
        if kind != pafs.FileType.File or relative in keep:
            continue
        if needed(relative, folder=False):
            left.add(relative)
            continue
        try:
            store.fs.delete_file(base + relative)
        except (FileNotFoundError, OSError):
            left.add(relative)  # kept (or already gone): its folder stays
    dirs = [relative for relative, kind in found if kind == pafs.FileType.Directory]
    for relative in sorted(dirs, key=len, reverse=True):  # deepest first
        if any(path.startswith(relative + "/") for path in left) or needed(relative, folder=True):
            continue
        try:
            store.fs.delete_dir(base + relative)
        except (FileNotFoundError, OSError):
            pass
