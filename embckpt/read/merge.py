"""Checkpoint merging (LC-Checkpoint): fold a chain into one self-contained checkpoint.

``merge(store, step)`` rewrites checkpoint ``step`` as a full checkpoint holding exactly the
state a restore of its chain produces, so it no longer needs its base or parents. For each table
block, the newest version of every row wins (the rows' encoded bytes are kept as they are, so a
quantized chain is not quantized twice); rows written with a delta codec are decoded and summed
instead, and that block is stored lossless. The new files go under ``merged/`` in the step's
folder, then the new manifest replaces the old one in one atomic rename, then the old files
are deleted: a crash at any point leaves either the old or the new checkpoint committed.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from embckpt.codecs import codec_from_config, make_codec
from embckpt.codecs.base import EncodedRows
from embckpt.errors import EmbckptError
from embckpt.storage.fs import MANIFEST_NAME, CheckpointStore
from embckpt.storage.manifest import FileEntry, HistoryEntry, Manifest
from embckpt.storage.shardfile import RowBlock, decode_file, encode_file

_BlockKey = tuple[str, int, int, int, int]


def _key(entry: FileEntry) -> _BlockKey:
    return (entry.table, entry.row_offset, entry.col_offset, entry.shard_rows, entry.shard_cols)


def _latest_rows(rows: np.ndarray) -> np.ndarray:
    """Indices of the last occurrence of each row id, in ascending row id order."""
    _, first_from_end = np.unique(rows[::-1], return_index=True)
    return len(rows) - 1 - first_from_end


def _concat(arrays: list[pa.Array | pa.ChunkedArray]) -> pa.Array:
    chunks = [a.combine_chunks() if isinstance(a, pa.ChunkedArray) else a for a in arrays]
    return pa.concat_arrays(chunks)


def _merge_block(pieces: list[tuple[RowBlock, dict[str, str]]], cols: int) -> tuple:
    """Returns rows, encoded rows, row states, element-wise states, metadata of the fold."""
    rows = np.concatenate([block.rows for block, _ in pieces])
    keep = _latest_rows(rows)
    take = pa.array(keep)
    newest = pieces[-1][0]
    row_states = {
        name: np.concatenate([b.row_states[name] for b, _ in pieces])[keep]
        for name in newest.row_states
    }
    elem_states = {
        name: EncodedRows(
            columns={
                col: _concat([b.elem_states[name].columns[col] for b, _ in pieces]).take(take)
                for col in state.columns
            },
            metadata=state.metadata,
        )
        for name, state in newest.elem_states.items()
    }
    codecs = [codec_from_config(b.metadata["codec"]) for b, _ in pieces]
    same = all(b.metadata["codec"] == newest.metadata["codec"] for b, _ in pieces)
    meta = dict(newest.metadata)
    if same and not codecs[-1].delta:
        encoded = EncodedRows(
            columns={
                col: _concat([b.encoded.columns[col] for b, _ in pieces]).take(take)
                for col in newest.encoded.columns
            },
            metadata=newest.encoded.metadata,
            compression=pieces[-1][1],
        )
        return rows[keep], encoded, row_states, elem_states, meta
    # Mixed or delta codecs: rebuild the values in chain order and store them lossless.
    ids = rows[keep]
    values = torch.zeros(len(ids), cols)
    for (block, _), codec in zip(pieces, codecs, strict=True):
        decoded = codec.decode(block.encoded, cols).float()
        where = torch.from_numpy(np.searchsorted(ids, block.rows))
        if codec.delta:
            values.index_add_(0, where, decoded)
        else:
            values[where] = decoded
    raw = make_codec("raw")
    meta["codec"] = raw.get_config()
    return ids, raw.encode(values), row_states, elem_states, meta


def _compression(data: pa.Buffer) -> dict[str, str]:
    """The Parquet compression each column of a file was written with."""
    meta = pq.ParquetFile(pa.BufferReader(data)).metadata
    if meta.num_row_groups == 0:
        return {}
    group = meta.row_group(0)
    found = {}
    for i in range(group.num_columns):
        codec = group.column(i).compression.lower()
        found[group.column(i).path_in_schema] = "none" if codec == "uncompressed" else codec
    return found


def merge(store: CheckpointStore, step: int, row_group_rows: int = 65536) -> Manifest:
    """Rewrites checkpoint ``step`` as one self-contained full checkpoint.

    Raises:
        EmbckptError: the chain's blocks do not line up (written by different sharding plans).
        CheckpointCorruptError / ChainIncompleteError: a file or link of the chain is bad.
    """
    from embckpt.storage.chain import read_chain

    chain = read_chain(store, step)
    head = chain[-1]
    if len(chain) == 1:
        return head
    by_block: dict[_BlockKey, list[tuple[Manifest, FileEntry]]] = defaultdict(list)
    for manifest in chain:
        for entry in manifest.files:
            if entry.role == "rows":
                by_block[_key(entry)].append((manifest, entry))
    base_blocks = {_key(e) for e in chain[0].files if e.role == "rows"}
    stray = set(by_block) - base_blocks
    if stray:
        raise EmbckptError(
            f"step {step}: blocks {sorted(stray)[:3]} are not in base {chain[0].step}; the chain "
            "was written by different sharding plans and cannot be merged block by block"
        )
    files: list[FileEntry] = []
    for key, entries in sorted(by_block.items()):
        pieces = []
        for manifest, entry in entries:
            data = store.read_checked(manifest.step, entry.written)
            path = store.step_path(manifest.step, entry.path)
            lo, hi = entry.row_offset, entry.row_offset + entry.shard_rows
            pieces.append((decode_file(data, path, lo, hi), _compression(data)))
        rows, encoded, row_states, elem_states, meta = _merge_block(pieces, key[4])
        meta = {k: v for k, v in meta.items() if k not in ("codec_meta", "elem_meta")}
        data = encode_file(rows, encoded, row_states, elem_states, meta, row_group_rows)
        table, row_off, col_off, _, _ = key
        relative = f"merged/tables/{table}/r{row_off}_c{col_off}.p0.parquet"
        written = store.write_file(step, relative, data)
        files.append(
            dataclasses.replace(
                entries[-1][1],
                path=written.path,
                bytes=written.bytes,
                sha256=written.sha256,
                rows=len(rows),
            )
        )
    for entry in head.files:
        if entry.role != "rows":
            data = store.read_checked(step, entry.written)
            written = store.write_file(step, f"merged/{entry.path}", data)
            files.append(dataclasses.replace(entry, path=written.path))
    total = sum(f.bytes for f in files)
    merged = dataclasses.replace(
        head,
        kind="full",
        base_step=step,
        parent_step=None,
        files=tuple(sorted(files, key=lambda f: f.path)),
        history=(HistoryEntry(step, "full", total, 1.0),),
        stats={
            **head.stats,
            "merged_from": [m.step for m in chain],
            "rows_written": sum(f.rows for f in files if f.role == "rows"),
        },
    )
    store.write_atomic(store.step_path(step, MANIFEST_NAME), merged.to_json().encode())
    for entry in head.files:
        try:
            store.fs.delete_file(store.step_path(step, entry.path))
        except (FileNotFoundError, OSError):
            pass  # already gone: nothing references it any more
    return merged
