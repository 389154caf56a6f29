"""Files written as a stream: the bytes go to their destination as they are produced, never
held whole in memory, and are checksummed on the way.

A :class:`StreamedFile` knows how to write itself into a :class:`ChecksumSink`;
``CheckpointStore.write_file`` opens the destination (a temporary file renamed once complete on
local disks), hands the producer a sink over it, and runs the producer again from the start
when a transient error makes it retry. The sink keeps the CRC32C of each *segment* the producer
cuts (a rows file cuts its magic, each row group and its footer, so its index needs no second
pass over the bytes) and combines them into the whole file's CRC32C. For a signed checkpoint
it also keeps each segment's SHA-256 and the whole file's (``storage/signing.py``), on the
same thread (``hashlib`` releases the GIL while it hashes).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import google_crc32c

from embckpt.storage import checksum as checksums
from embckpt.storage.phases import PhaseClock, timed
from embckpt.storage.signing import DIGEST_PREFIX


class ChecksumSink:
    """A write-only, file-like stream (what ``pyarrow.parquet.ParquetWriter`` accepts) that
    forwards every write to ``out`` and keeps the CRC32C of what went through.

    Args:
        out: writes all of the bytes it is given (a file's or a buffer's ``write``).
        clock: a save's clock: the forwarding counts as ``write``, the CRC as ``hash``.
        digests: also SHA-256 digests (a signed checkpoint), counted as ``hash``.
    """

    def __init__(
        self, out: Callable[[Any], Any], clock: PhaseClock | None = None, digests: bool = False
    ) -> None:
        self._out = out
        self._clock = clock
        self._position = 0
        self._segment_start = 0
        self._segment_crc = 0
        self._file_crc = 0
        self._digests = digests
        self._segment_sha = hashlib.sha256() if digests else None
        self._file_sha = hashlib.sha256() if digests else None
        self.closed = False

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        with timed(self._clock, "hash"):
            self._segment_crc = google_crc32c.extend(self._segment_crc, data)
            if self._segment_sha is not None and self._file_sha is not None:
                self._segment_sha.update(data)
                self._file_sha.update(data)
        with timed(self._clock, "write"):
            self._out(data)
        self._position += size
        return size

    def cut(self) -> tuple[int, int, int, str]:
        """Ends the current segment: its offset, length, CRC32C and SHA-256 digest ("" unless
        ``digests``); the next byte starts another."""
        offset, length = self._segment_start, self._position - self._segment_start
        crc = self._segment_crc
        self._file_crc = checksums.combine(self._file_crc, crc, length)
        self._segment_start, self._segment_crc = self._position, 0
        sha = ""
        if self._segment_sha is not None:
            sha = DIGEST_PREFIX + self._segment_sha.hexdigest()
            self._segment_sha = hashlib.sha256()
        return offset, length, crc, sha

    @property
    def digest(self) -> str:
        """The whole stream's SHA-256 digest ("" unless ``digests``)."""
        return "" if self._file_sha is None else DIGEST_PREFIX + self._file_sha.hexdigest()

    @property
    def checksum(self) -> str:
        """The whole stream's checksum (the bytes after the last :meth:`cut` included)."""
        tail = self._position - self._segment_start
        return checksums.tag(checksums.combine(self._file_crc, self._segment_crc, tail))

    def tell(self) -> int:
        return self._position

    def flush(self) -> None:
        """Nothing is buffered here (the store flushes and fsyncs the destination)."""

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        """Marks the stream closed; the destination is the store's to close (a producer's
        writer may close its sink when it finishes)."""
        self.closed = True


class StreamedFile(ABC):
    """A file produced into a :class:`ChecksumSink` rather than held as bytes. After a complete
    write, ``size`` and ``checksum`` describe the bytes of that write (a retried write produces
    the file again from the start)."""

    size: int = 0
    checksum: str = ""
    digest: str = ""

    @abstractmethod
    def produce(self, sink: ChecksumSink) -> None:
        """Writes the whole file into ``sink``, from its first byte."""

    def write_to(self, sink: ChecksumSink) -> None:
        """Produces the file and records its size and checksum."""
        self.produce(sink)
        self.size, self.checksum, self.digest = sink.tell(), sink.checksum, sink.digest
