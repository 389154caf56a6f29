"""The manifest: the one file that makes a checkpoint exist, and describes all of it.

Rank 0 writes it last, after every rank reported its files. It is versioned JSON that carries its
own SHA-256 (over the canonical JSON of everything else; the manifest is small, so its
checksum stays SHA-256), so an edited or truncated manifest is caught before anything it lists
is trusted. File checksums are either CRC32C (``checksum_algorithm``, see
``storage/checksum.py``) or, in format-1 manifests without ``checksum_algorithm``, SHA-256
values under the keys ``sha256``, ``file_sha256`` and ``footer_sha256``, which
:meth:`Manifest.from_json` reads into the same fields.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any

from embckpt.errors import CheckpointCorruptError
from embckpt.storage.checksum import ALGORITHM, LEGACY_ALGORITHM
from embckpt.storage.paths import path_problem

FORMAT_VERSION = 4
"""2: CRC32C file checksums and float payloads as Parquet float lists; 3: a table is named by its
collection's module path and its name; 4: small blocks packed into shared rows files
(docs/ARCHITECTURE.md)."""
READABLE_VERSIONS = (1, 2, 3, 4)
QUALIFIED_TABLES_VERSION = 3
"""The first version whose table names carry their module path: older ones name tables bare."""


@dataclass(frozen=True)
class WrittenFile:
    """What the writer of a file knows about it: the manifest's record of it."""

    path: str  # relative to the step folder
    bytes: int
    checksum: str  # see storage/checksum.py: CRC32C, or SHA-256 in format-1 manifests


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
        return WrittenFile(self.path, self.bytes, self.checksum)

    def overlaps(self, row_lo: int, row_hi: int, col_lo: int, col_hi: int) -> bool:
        """True if this rows file can hold rows in [row_lo, row_hi) x [col_lo, col_hi)."""
        return (
            self.row_offset < row_hi
            and row_lo < self.row_offset + self.shard_rows
            and self.col_offset < col_hi
            and col_lo < self.col_offset + self.shard_cols
        )


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
    shards: tuple[tuple[int, int, int, int, int], ...] = ()  # (rank, row_off, col_off, rows, cols)


@dataclass(frozen=True)
class HistoryEntry:
    """A past checkpoint of the same chain, for policies that learn from history."""

    step: int
    kind: str
    bytes: int
    dirty_fraction: float


@dataclass(frozen=True)
class Manifest:
    """Everything about one committed checkpoint.

    ``parent_step`` is the checkpoint whose state a diff applies on top of (None for a full);
    following parents always ends at ``base_step``, the full checkpoint at the chain's root.
    ``history`` lists the checkpoints since that full one, this one included.
    ``checksum_algorithm`` is the algorithm of the checksums its writer computed (every value
    also names its own: a merge keeps the head's dense files, whatever they were written with).
    """

    step: int
    kind: str
    policy: str
    base_step: int
    parent_step: int | None
    world_size: int
    codec: Mapping[str, Any]
    tables: tuple[TableEntry, ...]
    files: tuple[FileEntry, ...]
    history: tuple[HistoryEntry, ...] = ()
    stats: Mapping[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    checksum_algorithm: str = ALGORITHM

    @property
    def total_bytes(self) -> int:
        """Bytes of the files listed, each file once (blocks of a packed file share it)."""
        return files_bytes(self.files)

    @property
    def file_count(self) -> int:
        """Files listed, each once (several blocks may share one packed rows file)."""
        return len({f.path for f in self.files})

    @property
    def rows_written(self) -> int:
        return sum(f.rows for f in self.files if f.role == "rows")

    def with_stats(self, **stats: Any) -> Manifest:
        return replace(self, stats={**self.stats, **stats})

    def repeated_paths(self) -> list[str]:
        """File paths listed more than once where one file cannot hold both entries, sorted:
        two entries of one file, of which the later write overwrote the other.

        Only blocks of one packed rows file share a path: every entry of the path is a rows
        entry with a block number, the numbers differ, the entries agree on the file (size,
        checksum, footer) and their row groups do not overlap. Anything else is repeated.
        """
        by_path: dict[str, list[FileEntry]] = {}
        for f in self.files:
            by_path.setdefault(f.path, []).append(f)
        return sorted(p for p, entries in by_path.items() if not _one_packed_file(entries))

    @property
    def qualified_tables(self) -> bool:
        """Whether table names carry their module path (format 3 on); older ones are bare."""
        return self.format_version >= QUALIFIED_TABLES_VERSION

    def with_table_ids(self, ids: Mapping[str, str]) -> Manifest:
        """This manifest with its bare table names replaced by ``ids`` (bare name -> table
        identity), so that an older checkpoint reads like one naming its tables in full."""
        tables = tuple(replace(t, name=ids.get(t.name, t.name)) for t in self.tables)
        files = tuple(
            replace(f, table=ids.get(f.table, f.table)) if f.role == "rows" else f
            for f in self.files
        )
        return replace(self, tables=tables, files=files)

    def to_json(self) -> str:
        """The manifest's text: one line of JSON (the C encoder: an indented dump runs in
        Python, about 4 ms for 150 files, on the critical path of every save)."""
        body = _plain(self)
        body["checksum"] = _checksum(body)
        return json.dumps(body, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, path: str) -> Manifest:
        """Parses and checks a manifest.

        Raises:
            CheckpointCorruptError: not JSON, checksum mismatch, or an unknown format version.
        """
        try:
            body = json.loads(text)
            checksum = body.pop("checksum")
        except (ValueError, KeyError, AttributeError) as exc:
            raise CheckpointCorruptError(path, f"manifest is not valid: {exc}") from exc
        if checksum != _checksum(body):
            raise CheckpointCorruptError(path, "manifest checksum does not match its contents")
        version = body.get("format_version")
        if version not in READABLE_VERSIONS:
            raise CheckpointCorruptError(
                path,
                f"manifest format version {version} is not supported (this reader: "
                f"{', '.join(map(str, READABLE_VERSIONS))})",
            )
        algorithm = body.setdefault("checksum_algorithm", LEGACY_ALGORITHM)
        if algorithm not in (ALGORITHM, LEGACY_ALGORITHM):
            raise CheckpointCorruptError(
                path, f"checksum algorithm {algorithm!r} is not supported (crc32c, sha256)"
            )
        try:
            manifest = cls(
                **{
                    **body,
                    "tables": tuple(
                        TableEntry(
                            **{
                                **t,
                                "row_states": tuple(t["row_states"]),
                                "elem_states": tuple(t["elem_states"]),
                                "shards": tuple(tuple(s) for s in t["shards"]),
                            }
                        )
                        for t in body["tables"]
                    ),
                    "files": tuple(_file_entry(f) for f in body["files"]),
                    "history": tuple(HistoryEntry(**h) for h in body["history"]),
                }
            )
        except (TypeError, KeyError) as exc:
            raise CheckpointCorruptError(path, f"manifest fields are not valid: {exc}") from exc
        for name in dict.fromkeys(f.path for f in manifest.files):  # blocks share a path
            problem = path_problem(name)
            if problem is not None:
                raise CheckpointCorruptError(path, f"file entry {name!r}: {problem}")
        twice = manifest.repeated_paths()
        if twice:
            raise CheckpointCorruptError(
                path, f"file entry {twice[0]!r} is listed more than once: one file cannot hold both"
            )
        return manifest


def files_bytes(files: Iterable[FileEntry]) -> int:
    """The bytes of ``files``, each path counted once."""
    return sum({f.path: f.bytes for f in files}.values())


def _one_packed_file(entries: list[FileEntry]) -> bool:
    """Whether entries of one path are blocks one packed file can hold together (see
    :meth:`Manifest.repeated_paths`); a path listed once always is."""
    if len(entries) == 1:
        return True
    if any(e.role != "rows" or e.block is None or e.index is None for e in entries):
        return False
    if len({e.block for e in entries}) != len(entries):
        return False
    first = entries[0]
    file_of = {
        (e.bytes, e.checksum, e.index.file_checksum, e.index.footer_offset, e.index.footer_checksum)
        for e in entries
        if e.index is not None
    }
    if len(file_of) != 1 or first.index is None or first.index.file_checksum != first.checksum:
        return False
    spans = sorted(
        (e.index.first_group, e.index.first_group + len(e.index.row_groups))
        for e in entries
        if e.index is not None
    )
    return all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))


def _file_entry(body: Mapping[str, Any]) -> FileEntry:
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


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _plain(value: Any) -> Any:
    """``dataclasses.asdict`` without its deep copies of every leaf (several times faster)."""
    kind = type(value)
    if kind in (str, int, float, bool) or value is None:
        return value
    if is_dataclass(value):
        names = _FIELD_NAMES.get(kind)
        if names is None:
            names = _FIELD_NAMES[kind] = tuple(f.name for f in fields(value))
        return {name: _plain(getattr(value, name)) for name in names}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _checksum(body: Mapping[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def ids_of_bare_names(names: Iterable[str], ids: Iterable[str]) -> dict[str, str]:
    """Each bare table name matched to the one identity (``<module path>.<name>``) that ends
    with it; names that match none, or several, are left out."""
    by_name: dict[str, list[str]] = {}
    for table in ids:
        by_name.setdefault(table.rsplit(".", 1)[-1], []).append(table)
    return {n: by_name[n][0] for n in names if len(by_name.get(n, ())) == 1}
