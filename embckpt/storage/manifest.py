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

import gc
import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from embckpt.errors import CheckpointCorruptError, UntrustedCheckpointError
from embckpt.storage.checksum import ALGORITHM, LEGACY_ALGORITHM
from embckpt.storage.manifest_types import (
    FileEntry,
    FileIndex,
    HistoryEntry,
    PartEntry,
    RowGroupEntry,
    TableEntry,
    WrittenFile,
    file_entry_from_dict,
    plain,
)
from embckpt.storage.paths import path_problem
from embckpt.storage.signing import VerifyKeys, require_digests
from embckpt.storage.table_columns import tables_from_columns, tables_to_columns

__all__ = [
    "FORMAT_VERSION",
    "FileEntry",
    "FileIndex",
    "HistoryEntry",
    "Manifest",
    "PartEntry",
    "RowGroupEntry",
    "TableEntry",
    "WrittenFile",
    "files_bytes",
    "ids_of_bare_names",
]

FORMAT_VERSION = 5
"""2: CRC32C file checksums and float payloads as Parquet float lists; 3: a table is named by its
collection's module path and its name; 4: small blocks packed into shared rows files; 5: each
rank's rows files listed in its rank file's header (``parts``), tables as columns of runs, a
diff's unchanged tables named by the step that lists them (docs/ARCHITECTURE.md). Signed
checkpoints are :data:`SIGNED_VERSION`."""
SIGNED_VERSION = 6
"""Format 5 with an Ed25519 signature and a SHA-256 digest of every file
(``storage/signing.py``): written only with a signing key, so unsigned files stay format 5."""
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)
PARTS_VERSION = 5
"""The first version that may list rows files in rank files (``Manifest.parts``)."""
PART_ROLES = ("rank", "rows")
"""The roles of the files a format-5 part holds: its rank file, and the rows files it lists."""
QUALIFIED_TABLES_VERSION = 3
"""The first version whose table names carry their module path: older ones name tables bare."""


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
    parts: tuple[PartEntry, ...] = ()
    """Format 5: one per writing rank, whose rank file indexes its rows files (empty: every
    file is listed here)."""
    tables_from: int | None = None
    """Format 5: the step whose manifest listed this one's tables when it was written (its
    chain's full), or None; readers take them from the nearest older link that lists them."""
    signature: Mapping[str, Any] | None = None
    """Signed checkpoints: ``{algorithm, key, value}`` (``storage/signing.py``)."""
    loaded: frozenset[int] | None = None
    """The ranks whose parts ``files`` holds the rows files of (None: every rank's): a restore
    reads the parts of the ranks whose blocks overlap its own, and only those."""

    @property
    def complete(self) -> bool:
        """Whether ``files`` lists every file of the checkpoint."""
        return self.loaded is None or self.loaded >= {p.rank for p in self.parts}

    @property
    def total_bytes(self) -> int:
        """Bytes of the checkpoint's files, each file once (blocks of a packed file share it)."""
        if self.parts:
            return files_bytes(f for f in self.files if f.role == "dense") + sum(
                p.files_bytes for p in self.parts
            )
        return files_bytes(self.files)

    @property
    def file_count(self) -> int:
        """Files listed, each once (several blocks may share one packed rows file)."""
        return len({f.path for f in self.files})

    @property
    def rows_written(self) -> int:
        if self.parts:
            return sum(p.rows for p in self.parts)
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

    def to_json(self, sign: Callable[[bytes], Mapping[str, Any]] | None = None) -> str:
        """The manifest's text: one line of JSON (the C encoder: an indented dump runs in
        Python, about 4 ms for 150 files, on the critical path of every save). Format 5 lays
        the tables out as columns, and leaves each part's rows files to its rank file. With
        ``sign`` (``SigningKey.sign``), format 6: signed over every field but ``checksum`` and
        ``signature``."""
        body = plain(replace(self, tables=(), files=(), parts=(), loaded=None, signature=None))
        del body["signature"]
        if self.format_version >= PARTS_VERSION:
            listed = self.tables_from is None
            body["tables"] = tables_to_columns(self.tables) if listed else None
            ranks = {p.rank for p in self.parts}
            own = [f for f in self.files if not (f.rank in ranks and f.role in PART_ROLES)]
            body["files"] = plain(own)
            body["parts"] = [p.as_list() for p in self.parts]
        else:
            del body["parts"], body["tables_from"]
            body["tables"], body["files"] = plain(self.tables), plain(self.files)
        del body["loaded"]
        if sign is not None:
            body["format_version"] = SIGNED_VERSION
            body["signature"] = dict(sign(_canonical(body)))
        body["checksum"] = _checksum(body)
        return json.dumps(body, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, path: str, keys: VerifyKeys | None = None) -> Manifest:
        """Parses and checks a manifest; with ``keys``, its signature and that it gives a
        digest of every file it lists.

        Raises:
            CheckpointCorruptError: not JSON, checksum mismatch, or an unknown format version.
            UntrustedCheckpointError: with ``keys``: unsigned, or not signed by one of them.
        """
        with collector_paused():
            return cls._parse(text, path, keys)

    @classmethod
    def _parse(cls, text: str, path: str, keys: VerifyKeys | None) -> Manifest:
        try:
            body = json.loads(text)
            checksum = body.pop("checksum")
        except (ValueError, KeyError, AttributeError) as exc:
            raise CheckpointCorruptError(path, f"manifest is not valid: {exc}") from exc
        if checksum != _checksum(body):
            raise CheckpointCorruptError(path, "manifest checksum does not match its contents")
        signature = body.pop("signature", None)
        if keys is not None:
            keys.check(_canonical(body), signature, path)
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
            manifest = cls(**{**body, **_parsed_fields(body, path)}, signature=signature)
        except (TypeError, KeyError, ValueError) as exc:
            raise CheckpointCorruptError(path, f"manifest fields are not valid: {exc}") from exc
        ranks = {p.rank for p in manifest.parts}  # their rank files are named by the reader
        listed = (f.path for f in manifest.files if not (f.role == "rank" and f.rank in ranks))
        for name in dict.fromkeys(listed):  # blocks share a path
            problem = path_problem(name)
            if problem is not None:
                raise CheckpointCorruptError(path, f"file entry {name!r}: {problem}")
        twice = manifest.repeated_paths()
        if twice:
            raise CheckpointCorruptError(
                path, f"file entry {twice[0]!r} is listed more than once: one file cannot hold both"
            )
        if keys is not None:
            require_digests(manifest.files, path)
            unindexed = [p.rank for p in manifest.parts if not p.index_digest]
            if unindexed:
                raise UntrustedCheckpointError(
                    path,
                    f"rank {unindexed[0]}'s index has no SHA-256 digest in a signed checkpoint",
                )
        return manifest


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a manifest is parsed: the parse makes
    hundreds of thousands of small objects, none in a cycle, and each pass the collector runs
    meanwhile walks the whole heap (at 4,096 ranks, the passes took longer than the parse)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _parsed_fields(body: Mapping[str, Any], path: str) -> dict[str, Any]:
    """The fields of ``body`` that are not plain JSON values, parsed."""
    parts = tuple(PartEntry(*p) for p in body.get("parts", ()))
    files = tuple(file_entry_from_dict(f) for f in body["files"])
    files += tuple(p.rank_entry for p in parts)
    listed = body["tables"]
    if listed is None or isinstance(listed, Mapping):  # format 5: columns, or none
        tables = () if listed is None else tables_from_columns(listed, path)
        if listed is None and body.get("tables_from") is None:
            raise ValueError("no tables, and no step that lists them")
    else:
        tables = tuple(
            TableEntry(
                **{
                    **t,
                    "row_states": tuple(t["row_states"]),
                    "elem_states": tuple(t["elem_states"]),
                    "shards": tuple(tuple(s) for s in t["shards"]),
                }
            )
            for t in body["tables"]
        )
    return {
        "tables": tables,
        "files": files,
        "parts": parts,
        "history": tuple(HistoryEntry(**h) for h in body["history"]),
        "loaded": frozenset() if parts else None,
    }


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


def _canonical(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _checksum(body: Mapping[str, Any]) -> str:
    return hashlib.sha256(_canonical(body)).hexdigest()


def ids_of_bare_names(names: Iterable[str], ids: Iterable[str]) -> dict[str, str]:
    """Each bare table name matched to the one identity (``<module path>.<name>``) that ends
    with it; names that match none, or several, are left out."""
    by_name: dict[str, list[str]] = {}
    for table in ids:
        by_name.setdefault(table.rsplit(".", 1)[-1], []).append(table)
    return {n: by_name[n][0] for n in names if len(by_name.get(n, ())) == 1}
