"""The records a manifest is made of: files, their row groups, tables (a table's blocks may be
kept as runs, ``ShardRuns``), history, rank parts.

``storage/manifest.py`` assembles them into a :class:`~embckpt.storage.manifest.Manifest`;
``storage/table_columns.py`` and ``storage/rank_parts.py`` lay them out in format 5.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass
from functools import cached_property
from typing import Any, overload

import numpy as np

from embckpt.storage.layout import rank_file


@dataclass(frozen=True)
class WrittenFile:
    """What the writer of a file knows about it: the manifest's record of it."""

    path: str  # relative to the step folder
    bytes: int
    checksum: str  # see storage/checksum.py: CRC32C, or SHA-256 in format-1 manifests
    digest: str = ""  # signed checkpoints: SHA-256 (storage/signing.py); "" otherwise


@dataclass(frozen=True)
class RowGroupEntry:
    """One Parquet row group of a rows file: its global row ids and its bytes.

    The row group's column chunks are contiguous in the file, bytes
    [offset, offset + length); ``checksum`` covers exactly those bytes, so a reader that fetches
    only some row groups still checks every byte it decodes.
    """

    first_row: int
    last_row: int  # inclusive, as in the Parquet statistics
    rows: int
    offset: int
    length: int
    checksum: str
    digest: str = ""  # signed checkpoints: the SHA-256 of the same bytes


@dataclass(frozen=True)
class FileIndex:
    """What a partial reader of a rows file needs: the footer's and row groups' checksums.

    The footer (Parquet metadata, its length and the closing magic) is bytes
    [footer_offset, file size); the row groups cover bytes [4, footer_offset) in order.
    ``file_checksum`` is the checksum of the whole file the index describes: a reader uses the
    index only for that file (an entry rewritten without a new index is read whole).
    """

    file_checksum: str
    footer_offset: int
    footer_checksum: str
    row_groups: tuple[RowGroupEntry, ...] = ()
    first_group: int = 0
    """The Parquet number of the first row group listed: a block of a packed file lists its
    own row groups only, Parquet's ``first_group`` to ``first_group + len(row_groups) - 1``."""
    footer_digest: str = ""  # signed checkpoints: the footer's SHA-256

    @classmethod
    def from_dict(cls, body: Mapping[str, Any]) -> FileIndex:
        return cls(
            file_checksum=_legacy(body, "file_checksum", "file_sha256"),
            footer_offset=body["footer_offset"],
            footer_checksum=_legacy(body, "footer_checksum", "footer_sha256"),
            row_groups=tuple(
                RowGroupEntry(**_renamed(g, "sha256", "checksum")) for g in body["row_groups"]
            ),
            first_group=body.get("first_group", 0),
            footer_digest=body.get("footer_digest", ""),
        )


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint.

    ``role`` is ``rows`` (a table shard's rows), ``dense`` (dense modules and optimizer, rank 0)
    or ``rank`` (one rank's RNG and data position). For ``rows`` files the shard fields say
    which block of the table the file's rows belong to: global rows
    [row_offset, row_offset + shard_rows) and columns [col_offset, col_offset + shard_cols).

    Optional fields (a format-1 manifest may lack them): ``fqn``, the table weight's key in the
    writer's ``model.state_dict()``; ``index``, the per-row-group checksums that let a reader
    fetch and verify only the row groups it needs (without it, a reader fetches and checks the
    whole file). ``checksum`` is spelled ``sha256`` in format-1 manifests that hold SHA-256.
    """

    path: str
    bytes: int
    checksum: str
    role: str
    rank: int
    table: str = ""
    row_offset: int = 0
    col_offset: int = 0
    shard_rows: int = 0
    shard_cols: int = 0
    rows: int = 0  # rows stored in this file
    fqn: str = ""
    index: FileIndex | None = None
    block: int | None = None
    """In a packed rows file (format 4), the block's number in the file's header ``blocks``;
    ``bytes`` and ``checksum`` are then the whole file's, ``index`` lists the block's own row
    groups. None: the file holds this block alone."""
    digest: str = ""
    """Signed checkpoints (format 6): the whole file's SHA-256 (``storage/signing.py``)."""

    @property
    def packed(self) -> bool:
        return self.block is not None

    @property
    def own_bytes(self) -> float:
        """The bytes of this block: the whole file, or for a block of a packed file its row
        groups plus their share (by length) of the file's footer and leading magic."""
        index = self.index
        if self.block is None or index is None or index.footer_offset <= 4:
            return float(self.bytes)
        own = sum(g.length for g in index.row_groups)
        return own + (self.bytes - index.footer_offset + 4) * own / (index.footer_offset - 4)

    @property
    def partial_index(self) -> FileIndex | None:
        """The index for partial reads of this very file, if it has one."""
        index = self.index
        return index if index is not None and index.file_checksum == self.checksum else None

    @property
    def written(self) -> WrittenFile:
        return WrittenFile(self.path, self.bytes, self.checksum, self.digest)

    def overlaps(self, row_lo: int, row_hi: int, col_lo: int, col_hi: int) -> bool:
        """True if this rows file can hold rows in [row_lo, row_hi) x [col_lo, col_hi)."""
        return (
            self.row_offset < row_hi
            and row_lo < self.row_offset + self.shard_rows
            and self.col_offset < col_hi
            and col_lo < self.col_offset + self.shard_cols
        )


Shard = tuple[int, int, int, int, int]  # (rank, row_offset, col_offset, rows, cols)


class ShardRuns(Sequence[Shard]):
    """A table's blocks kept as their runs, expanded into tuples only when listed: a reader
    of a 4,096-rank manifest needs the blocks of the few tables it holds, as arrays."""

    def __init__(self, runs: Sequence[Sequence[Any]]) -> None:
        self.runs = [list(r) for r in runs]
        self._shards: tuple[Shard, ...] | None = None

    def _expanded(self) -> tuple[Shard, ...]:
        if self._shards is None:
            self._shards = from_runs(self.runs)
        return self._shards

    def __len__(self) -> int:
        return sum(int(r[5]) for r in self.runs)

    @overload
    def __getitem__(self, index: int) -> Shard: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Shard]: ...

    def __getitem__(self, index: int | slice) -> Shard | Sequence[Shard]:
        return self._expanded()[index]

    def __iter__(self) -> Iterator[Shard]:
        return iter(self._expanded())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ShardRuns):
            return self.runs == other.runs
        if isinstance(other, Sequence):
            return self._expanded() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._expanded())

    def __repr__(self) -> str:
        return f"ShardRuns({self.runs!r})"

    def array(self) -> np.ndarray:
        """The blocks as an int64 array (blocks x 5), built from the runs without tuples."""
        if not self.runs:
            return np.zeros((0, 5), dtype=np.int64)
        runs = np.asarray([r[:6] for r in self.runs], dtype=np.int64)
        along_cols = np.asarray([r[6] == "c" for r in self.runs])
        counts = runs[:, 5]
        run = np.repeat(np.arange(len(runs)), counts)
        i = np.arange(len(run)) - np.repeat(np.cumsum(counts) - counts, counts)
        out = runs[run, :5].copy()
        out[:, 0] += i
        step_rows = np.where(along_cols, 0, runs[:, 3])[run]
        step_cols = np.where(along_cols, runs[:, 4], 0)[run]
        out[:, 1] += i * step_rows
        out[:, 2] += i * step_cols
        return out


def from_runs(runs: Sequence[Sequence[Any]]) -> tuple[Shard, ...]:
    """The blocks ``runs`` stand for, in order (inverse of :func:`to_runs`)."""
    shards: list[Shard] = []
    for rank, row, col, rows, cols, count, axis in runs:
        if axis == "r":
            shards.extend((rank + i, row + i * rows, col, rows, cols) for i in range(count))
        else:
            shards.extend((rank + i, row, col + i * cols, rows, cols) for i in range(count))
    return tuple(shards)


@dataclass(frozen=True)
class TableEntry:
    """A table as the writing job sharded it."""

    name: str
    rows: int
    cols: int
    dtype: str
    sharding_type: str
    row_states: tuple[str, ...] = ()
    elem_states: tuple[str, ...] = ()
    shards: Sequence[tuple[int, int, int, int, int]] = ()  # (rank, row_off, col_off, rows, cols)

    @cached_property
    def shard_array(self) -> np.ndarray:
        """``shards`` as an int64 array (blocks x 5), built once: planners test thousands of
        blocks at once."""
        if isinstance(self.shards, ShardRuns):  # a format-5 manifest's (table_columns.py)
            return self.shards.array()
        return np.asarray(self.shards, dtype=np.int64).reshape(-1, 5)


@dataclass(frozen=True)
class HistoryEntry:
    """A past checkpoint of the same chain, for policies that learn from history."""

    step: int
    kind: str
    bytes: int
    dirty_fraction: float


@dataclass(frozen=True)
class PartEntry:
    """One rank's part of a format-5 checkpoint: its rank file, whose safetensors header
    (``index_bytes`` from the start, checksum ``index_checksum``) lists the rank's rows files,
    so a reader fetches the index of the ranks it needs and no other.

    ``files_bytes`` and ``rows`` are the rank's whole share (its rank file and rows files, the
    rows they hold), for figures that cover every rank without reading every index.
    """

    rank: int
    bytes: int
    checksum: str
    index_bytes: int
    index_checksum: str
    files_bytes: int
    rows: int
    digest: str = ""  # signed checkpoints: the rank file's SHA-256, and its header's
    index_digest: str = ""

    @property
    def written(self) -> WrittenFile:
        """The rank file, as the writer recorded it."""
        return WrittenFile(rank_file(self.rank), self.bytes, self.checksum, self.digest)

    @property
    def rank_entry(self) -> FileEntry:
        """The rank file's entry among a manifest's files."""
        return FileEntry(
            rank_file(self.rank), self.bytes, self.checksum, "rank", self.rank, digest=self.digest
        )

    def as_list(self) -> list[Any]:
        listed = [
            self.rank,
            self.bytes,
            self.checksum,
            self.index_bytes,
            self.index_checksum,
            self.files_bytes,
            self.rows,
        ]
        return listed + [self.digest, self.index_digest] if self.digest else listed


def file_entry_from_dict(body: Mapping[str, Any]) -> FileEntry:
    index = body.get("index")
    return FileEntry(
        **{
            **_renamed(body, "sha256", "checksum"),
            "index": None if index is None else FileIndex.from_dict(index),
        }
    )


def _legacy(body: Mapping[str, Any], key: str, old_key: str) -> Any:
    """``body[key]``, or ``body[old_key]`` (the SHA-256 spelling of format-1 manifests)."""
    return body[key] if key in body else body[old_key]


def _renamed(body: Mapping[str, Any], old_key: str, key: str) -> Mapping[str, Any]:
    """``body`` with ``old_key`` (a format-1 SHA-256 field) spelled ``key`` (``body`` itself,
    not a copy, when it has no ``old_key``: callers only read it)."""
    if old_key not in body:
        return body
    renamed = {k: v for k, v in body.items() if k != old_key}
    renamed[key] = body[old_key]
    return renamed


_FIELD_NAMES: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {}
_UNSIGNED_ABSENT = frozenset({"digest", "footer_digest"})
"""Fields only signed checkpoints hold: left out where empty, so that an unsigned checkpoint's
files are byte for byte what they were before signing existed."""


def plain(value: Any) -> Any:
    """``dataclasses.asdict`` without its deep copies of every leaf (several times faster)."""
    kind = type(value)
    if kind in (str, int, float, bool) or value is None:
        return value
    if is_dataclass(value):
        known = _FIELD_NAMES.get(kind)
        if known is None:
            names = tuple(f.name for f in fields(value))
            known = _FIELD_NAMES[kind] = (names, tuple(_UNSIGNED_ABSENT.intersection(names)))
        names, optional = known
        out = {name: plain(getattr(value, name)) for name in names}
        for name in optional:
            if not out[name]:
                del out[name]
        return out
    if isinstance(value, Sequence) and not isinstance(value, str):  # tuples, a table's runs
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    return value
