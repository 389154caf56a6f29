"""Whole files and rows files checked against the manifest, wherever their bytes come from: the
store's folder (``fs.CheckpointStore``) or a tier's copy (``tiers/read_store.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import pyarrow as pa

from embckpt.errors import CheckpointCorruptError
from embckpt.storage import checksum as checksums
from embckpt.storage.manifest import FileEntry, WrittenFile
from embckpt.storage.phases import PhaseClock, timed
from embckpt.storage.signing import check_digest

if TYPE_CHECKING:
    from embckpt.storage.rowfile_read import CheckedFile


def check_whole(
    data: pa.Buffer, expected: WrittenFile, path: str, clock: PhaseClock | None = None
) -> pa.Buffer:
    """``data``, a whole file, checked against the manifest's size and checksum (``clock``
    gets the ``verify`` time).

    Raises:
        CheckpointCorruptError: truncated, extended or altered; names ``path``.
    """
    with timed(clock, "verify"):
        checksums.verify_size(data.size, expected.bytes, path)
        checksums.verify(data, expected.checksum, path)
        if expected.digest:  # a signed checkpoint
            check_digest(data, expected.digest, path)
    return data


def open_rows_from(
    entry: FileEntry,
    groups: Sequence[int] | None,
    path: str,
    whole: Callable[[], pa.Buffer],
    source: Callable[[], pa.NativeFile],
    clock: PhaseClock | None = None,
) -> CheckedFile:
    """The footer and row groups ``groups`` of rows file ``entry``, from wherever its bytes
    are: ``whole()`` gives the whole file checked, ``source()`` a random-access file for
    fetching ranges (a store's file, or a copy held in memory: ``tiers/read_store.py``).
    What :meth:`CheckpointStore.open_rows` describes.
    """
    # Imported here: decoding needs the codecs (torch), which verify, inspect and the report
    # never load.
    from embckpt.storage.rowfile_read import open_ranges, whole_file

    index = entry.partial_index
    if entry.block is not None:
        if index is None:
            raise CheckpointCorruptError(
                path, f"block {entry.block} of a packed file has no index of the file"
            )
        groups = range(len(index.row_groups)) if groups is None else groups
    elif groups is None or index is None:
        return whole_file(whole(), path)
    opened = source()
    try:
        checksums.verify_size(opened.size(), entry.bytes, path)
    except BaseException:
        opened.close()
        raise
    return open_ranges(opened, path, entry.bytes, index, groups, clock, entry.block)
