"""Format 5's rank parts: each rank lists its own rows files in its rank file's header.

A manifest listing every file of every rank grows with ranks x blocks (290 MB at 4,096 ranks
and 10,000 tables), and every rank read all of it to plan a restore. In format 5 the manifest
holds, per rank, only a :class:`~embckpt.storage.manifest_types.PartEntry`: the rank file's
size and checksum, and the length and checksum of its safetensors header, whose metadata key
``embckpt.index`` lists the rank's rows files (the entries a manifest used to hold). A reader
fetches that header, one ranged read checked against the manifest, for the ranks whose blocks
overlap its own; the manifest stays the one commit point: it names every part's checksum.
The index rides in the rank file, which every rank writes anyway, so a rank writes two
objects per checkpoint (its rank file and its rows), not three.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from embckpt.errors import CheckpointCorruptError
from embckpt.storage.checksum import checksum, verify
from embckpt.storage.manifest_types import (
    FileEntry,
    PartEntry,
    WrittenFile,
    file_entry_from_dict,
    plain,
)
from embckpt.storage.paths import path_problem
from embckpt.storage.signing import check_digest, digest, require_digests

INDEX_KEY = "embckpt.index"


def index_metadata(entries: Sequence[FileEntry]) -> dict[str, str]:
    """The rank file's safetensors metadata that lists ``entries`` (the rank's rows files)."""
    return {INDEX_KEY: json.dumps({"files": plain(list(entries))}, separators=(",", ":"))}


def part_of(
    rank: int, data: bytes, written: WrittenFile, entries: Sequence[FileEntry]
) -> PartEntry:
    """The manifest's record of rank ``rank``'s part: its rank file ``data`` (written with
    :func:`index_metadata`), as its write recorded it (with a digest: a signed checkpoint, whose
    header gets one too), and its rows ``entries``."""
    span = header_span(data)
    return PartEntry(
        rank=rank,
        bytes=len(data),
        checksum=written.checksum,
        index_bytes=span,
        index_checksum=checksum(data[:span]),
        files_bytes=len(data) + sum({e.path: e.bytes for e in entries}.values()),
        rows=sum(e.rows for e in entries),
        digest=written.digest,
        index_digest=digest(data[:span]) if written.digest else "",
    )


def header_span(data: bytes) -> int:
    """Bytes of a safetensors file's header: its 8-byte length and the JSON it counts."""
    return 8 + int.from_bytes(data[:8], "little")


def parse_index(header: bytes, part: PartEntry, path: str) -> list[FileEntry]:
    """The rows files a rank file's ``header`` (checked already) lists.

    Raises:
        CheckpointCorruptError: the header holds no index, or an entry is not one of this
            rank's rows files, or names a file outside the step folder; names ``path``.
    """
    try:
        metadata: Mapping[str, Any] = json.loads(header[8:])["__metadata__"]
        files = json.loads(metadata[INDEX_KEY])["files"]
        entries = [file_entry_from_dict(f) for f in files]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorruptError(path, f"rank file index is not valid: {exc}") from exc
    if part.index_digest:  # signed: every rows file it lists has its digests
        require_digests(entries, path)
    for entry in entries:
        problem = path_problem(entry.path)
        if entry.role != "rows" or entry.rank != part.rank:
            problem = f"not a rows file of rank {part.rank} (role {entry.role}, rank {entry.rank})"
        if problem is not None:
            raise CheckpointCorruptError(path, f"index entry {entry.path!r}: {problem}")
    return entries


def check_header(data: bytes, part: PartEntry, path: str) -> None:
    """Checks a rank file's first ``part.index_bytes`` bytes against the manifest.

    Raises:
        CheckpointCorruptError: short, or its checksum differs; names ``path``.
    """
    if len(data) != part.index_bytes:
        raise CheckpointCorruptError(
            path, f"header is {len(data)} bytes, the manifest says {part.index_bytes}"
        )
    what = f"header (bytes 0+{part.index_bytes})"
    verify(data, part.index_checksum, path, what)
    if part.index_digest:
        check_digest(data, part.index_digest, path, what)
