"""File checksums: CRC32C for what this version writes, SHA-256 for format-1 manifests.

A checksum value names its algorithm: ``crc32c:<8 hex digits>`` (CRC-32C, Castagnoli, as S3,
GCS and iSCSI compute it, hardware-accelerated through ``google_crc32c``), or 64 bare hex digits
for SHA-256, as format-1 manifests may hold them. So a manifest whose files were
written at different times (a merge keeps the head's dense files) checks every file with the
algorithm it was written with.

CRC32C is used because hashing is on the critical path of every save and restore: it runs at
memory speed where SHA-256 managed about 1.5 GB/s per core, and an object store that computes
the same CRC32C on upload can check the bytes end to end. It guards against corruption, not
against an adversary who can also edit the manifest (neither did SHA-256 without a signed
manifest). :func:`combine` derives a whole file's CRC from the CRCs of its consecutive parts,
so a writer reads each byte once.
"""

from __future__ import annotations

import hashlib
import re

import google_crc32c
import pyarrow as pa

from embckpt.errors import CheckpointCorruptError

ALGORITHM = "crc32c"
"""The algorithm of the checksums this version writes (the manifest's ``checksum_algorithm``)."""
LEGACY_ALGORITHM = "sha256"
"""The algorithm of manifests without ``checksum_algorithm`` (format 1 before CRC32C)."""

_PREFIX = f"{ALGORITHM}:"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_CRC32C = re.compile(r"^crc32c:[0-9a-f]{8}$")
_POLY = 0x82F63B78  # CRC-32C, bit-reversed


def _mult(a: int, b: int) -> int:
    """a * b modulo the polynomial, both bit-reversed (as the CRC registers hold them)."""
    product, mask = 0, 1 << 31
    while a:
        if a & mask:
            product ^= b
            a ^= mask
        mask >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


# _X2N[k] is x^(2^k) modulo the polynomial (bit-reversed), k < 64: enough for any file size.
_X2N = [1 << 30]
for _ in range(63):
    _X2N.append(_mult(_X2N[-1], _X2N[-1]))


def crc32c(data: pa.Buffer | bytes) -> int:
    """The CRC-32C of ``data`` (a ``pa.Buffer`` slice is not copied)."""
    return int(google_crc32c.value(data))


def tag(crc: int) -> str:
    """The manifest's spelling of a CRC-32C value."""
    return f"{_PREFIX}{crc:08x}"


def checksum(data: pa.Buffer | bytes) -> str:
    """The checksum this version records for ``data``."""
    return tag(crc32c(data))


def combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """The CRC-32C of A + B from the CRCs of A and B and the length of B (zlib's method:
    shift A's CRC over B's length by a power of x modulo the polynomial); no byte is read."""
    return _mult(_x8n(length_b), crc_a) ^ crc_b


def matches(data: pa.Buffer | bytes, expected: str) -> bool:
    """True if ``data`` has the checksum ``expected``, whichever algorithm it names.

    Raises:
        ValueError: ``expected`` is neither a CRC32C nor a SHA-256 value.
    """
    if _CRC32C.match(expected):
        return checksum(data) == expected
    if _SHA256.match(expected):
        return hashlib.sha256(memoryview(data)).hexdigest() == expected
    raise ValueError(f"unknown checksum {expected!r} (expected crc32c:<8 hex> or a SHA-256)")


def algorithm_of(value: str) -> str:
    """The algorithm a checksum value names (for messages)."""
    return "CRC32C" if value.startswith(_PREFIX) else "SHA-256"


def _x8n(length: int) -> int:
    """x^(8 * length) modulo the polynomial: the shift over ``length`` bytes."""
    power, k = 1 << 31, 3
    while length:
        if length & 1:
            power = _mult(_X2N[k], power)
        length >>= 1
        k += 1
    return power


def verify(data: pa.Buffer | bytes, expected: str, path: str, what: str = "") -> None:
    """Checks ``data`` against the manifest's checksum ``expected``: the one check every read
    of a checkpoint's bytes goes through.

    Args:
        path: the file, for the message.
        what: the part of the file (``"row group 3 (bytes 4+100)"``); empty for a whole file.

    Raises:
        CheckpointCorruptError: the bytes do not match, or ``expected`` is no checksum.
    """
    where = f"{what}: " if what else ""
    try:
        good = matches(data, expected)
    except ValueError as exc:
        raise CheckpointCorruptError(path, f"{where}manifest entry: {exc}") from exc
    if not good:
        raise CheckpointCorruptError(
            path, f"{where}{algorithm_of(expected)} does not match the manifest"
        )


def verify_size(size: int, expected: int, path: str) -> None:
    """Checks a file's size against the manifest's.

    Raises:
        CheckpointCorruptError: the file is truncated or extended.
    """
    if size != expected:
        raise CheckpointCorruptError(path, f"size is {size} bytes, the manifest says {expected}")
