"""Files written as a stream: the bytes go to their destination as they are produced, never
held whole in memory, and are checksummed on the way.

A :class:`StreamedFile` knows how to write itself into a :class:`ChecksumSink`;
``CheckpointStore.write_file`` opens the destination (a temporary file renamed once complete on
local disks), hands the producer a sink over it, and runs the producer again from the start
when a transient error makes it retry. The sink keeps the CRC32C of each *segment* the producer
cuts (a rows file cuts its magic, each row group and its footer, so its index needs no second
pass over the bytes) and combines them into the whole file's CRC32C.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import google_crc32c

from embckpt.storage import checksum as checksums
from embckpt.storage.phases import PhaseClock, timed


class ChecksumSink:
    """A write-only, file-like stream (what ``pyarrow.parquet.ParquetWriter`` accepts) that
    forwards every write to ``out`` and keeps the CRC32C of what went through.

    Args:
        out: writes all of the bytes it is given (a file's or a buffer's ``write``).
        clock: a save's clock: the forwarding counts as ``write``, the CRC as ``hash``.
    """

    def __init__(self, out: Callable[[Any], Any], clock: PhaseClock | None = None) -> None:
        self._out = out
        self._clock = clock
        self._position = 0
        self._segment_start = 0
        self._segment_crc = 0
        self._file_crc = 0
        self.closed = False

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        with timed(self._clock, "hash"):
            self._segment_crc = google_crc32c.extend(self._segment_crc, data)
        with timed(self._clock, "write"):
            self._out(data)
        self._position += size
        return size

    def cut(self) -> tuple[int, int, int]:
        """Ends the current segment: its offset, length and CRC32C; the next byte starts
        another."""
        offset, length = self._segment_start, self._position - self._segment_start
        crc = self._segment_crc
        self._file_crc = checksums.combine(self._file_crc, crc, length)
        self._segment_start, self._segment_crc = self._position, 0
        return offset, length, crc

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

    @abstractmethod
    def produce(self, sink: ChecksumSink) -> None:
        """Writes the whole file into ``sink``, from its first byte."""

    def write_to(self, sink: ChecksumSink) -> None:
        """Produces the file and records its size and checksum."""
        self.produce(sink)
        self.size, self.checksum = sink.tell(), sink.checksum
