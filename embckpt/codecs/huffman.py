"""Canonical Huffman coding of byte rows; the row loops are compiled (huffman_kernels.py).

Contract: every row of a uint8 matrix [n, w] becomes its own byte-aligned bit string, so a row
read alone (a row-range read of a Parquet file) decodes alone. Rows are independent chunks: a
compiled kernel walks each row once with a 64-bit bit buffer (four codes per eight-byte load or
store), and decoding runs four rows side by side so their table lookups overlap. Tables,
validation and the bytes' layout stay here. The kernels write the same bytes as the numpy
passes (one per two byte columns) they replaced (tests/test_huffman.py); README's codec speed
table has their speeds.

Byte columns come in groups, each with its own code table: a codec groups the bytes that share
a distribution (all packed codes; each byte of the per-row scale and bias; each byte position
of a float), which is where much of the gain on parameters and floats comes from. Codes are
canonical and at most ``MAX_CODE_BITS`` long, so a table is fully described by 256 code lengths,
stored as a 256-character hex string; decoding is one lookup of ``MAX_CODE_BITS`` bits per
symbol. Bits are written least significant first, like FBGEMM's packing and DEFLATE, with each
code bit-reversed so that the lookup index is simply the next ``MAX_CODE_BITS`` bits.

``TableCache`` keeps the previous batch's tables between checkpoints (LC-Checkpoint's code-table
caching): they are reused while they cost at most ``tolerance`` more bits than fresh tables,
which keeps consecutive files' tables identical and lets readers reuse their decode tables.
"""

from __future__ import annotations

import functools
import heapq
import threading
from collections.abc import Callable, Sequence

import numpy as np

from embckpt.codecs import huffman_kernels
from embckpt.errors import CodecError

MAX_CODE_BITS = huffman_kernels.MAX_CODE_BITS
_ALPHABET = 256
_SAMPLE_BYTES = 1 << 20


def code_lengths(counts: np.ndarray) -> np.ndarray:
    """Huffman code lengths (at most ``MAX_CODE_BITS``) for symbol counts [256].

    Symbols with a zero count get length 0 (no code). Lengths are limited by halving the
    counts and rebuilding, which costs a negligible fraction of a bit at these sizes.
    """
    counts = np.asarray(counts, dtype=np.int64)
    lengths = np.zeros(_ALPHABET, dtype=np.uint8)
    present = np.flatnonzero(counts)
    if len(present) == 0:
        return lengths
    if len(present) == 1:
        lengths[present] = 1
        return lengths
    weights = counts[present]
    while True:
        depth = _huffman_depths(weights)
        if depth.max() <= MAX_CODE_BITS:
            lengths[present] = depth
            return lengths
        weights = np.maximum(weights >> 1, 1)


def _huffman_depths(weights: np.ndarray) -> np.ndarray:
    # Classic heap construction over at most 256 leaves (a loop over the alphabet, not the
    # data): merged nodes get increasing ids, so parents always follow their children.
    count = len(weights)
    heap = [(int(w), i) for i, w in enumerate(weights.tolist())]
    heapq.heapify(heap)
    parent = [0] * (2 * count - 1)
    node = count
    while len(heap) > 1:
        w1, a = heapq.heappop(heap)
        w2, b = heapq.heappop(heap)
        parent[a] = parent[b] = node
        heapq.heappush(heap, (w1 + w2, node))
        node += 1
    depth = [0] * (2 * count - 1)
    for i in range(2 * count - 3, -1, -1):
        depth[i] = depth[parent[i]] + 1
    return np.array(depth[:count], dtype=np.int64)


def lengths_to_hex(lengths: np.ndarray) -> str:
    """The metadata form of a table: one hex digit per symbol."""
    return "".join("0123456789abcdef"[int(v)] for v in lengths)


def lengths_from_hex(text: str) -> np.ndarray:
    """Inverse of :func:`lengths_to_hex`.

    Raises:
        CodecError: the text is not 256 hex digits describing a valid prefix code.
    """
    try:
        lengths = np.array([int(c, 16) for c in text], dtype=np.uint8)
    except (TypeError, ValueError):
        raise CodecError("Huffman table is not a hex string") from None
    used = lengths[lengths > 0].astype(np.float64)
    if (
        len(lengths) != _ALPHABET
        or lengths.max(initial=0) > MAX_CODE_BITS
        or np.sum(2.0**-used) > 1.0
    ):
        raise CodecError("Huffman table has the wrong size or is not a prefix code")
    return lengths


def _canonical_reversed(lengths: np.ndarray) -> np.ndarray:
    """Canonical codes, bit-reversed within their length, for an LSB-first stream."""
    codes = np.zeros(_ALPHABET, dtype=np.int64)
    order = np.lexsort((np.arange(_ALPHABET), lengths))
    code = 0
    prev = 0
    for sym in order.tolist():
        length = int(lengths[sym])
        if length == 0:
            continue
        code <<= length - prev
        prev = length
        codes[sym] = int(format(code, f"0{length}b")[::-1], 2)
        code += 1
    return codes


@functools.lru_cache(maxsize=256)
def _decode_table(key: str) -> np.ndarray:
    """Lookup table indexed by the next ``MAX_CODE_BITS`` bits: ``length | symbol << 8``
    (``NO_CODE`` where no code starts with those bits)."""
    lengths = lengths_from_hex(key)
    codes = _canonical_reversed(lengths)
    entries = np.full(1 << MAX_CODE_BITS, huffman_kernels.NO_CODE, dtype=np.uint16)
    for sym in np.flatnonzero(lengths).tolist():
        length = int(lengths[sym])
        # Every index whose low `length` bits are this code decodes to this symbol.
        index = codes[sym] + (np.arange(1 << (MAX_CODE_BITS - length)) << length)
        entries[index] = length | sym << 8
    return entries


@functools.lru_cache(maxsize=256)
def _encode_table(key: str) -> np.ndarray:
    """Code and length of every byte value: ``code | length << 16`` (length 0: no code)."""
    lengths = lengths_from_hex(key).astype(np.int64)
    return (_canonical_reversed(lengths) | lengths << 16).astype(np.uint32)


def _stacked(
    build: Callable[[str], np.ndarray], tables: Sequence[str], column_tables: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The tables the columns use, one block each, and each column's block start."""
    used, block = np.unique(np.asarray(column_tables, dtype=np.int64), return_inverse=True)
    parts = [build(tables[t]) for t in used.tolist()]
    size = len(parts[0]) if parts else 0
    flat = np.ascontiguousarray(np.concatenate(parts)) if parts else np.zeros(0, np.uint32)
    return flat, (block.astype(np.uint64) * np.uint64(size)).reshape(-1)


def encode_rows(
    data: np.ndarray, tables: Sequence[str], column_tables: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Huffman-codes each row of ``data`` [n, w] (uint8) into its own byte-aligned bit string.

    Args:
        data: the rows' bytes.
        tables: code tables (hex lengths).
        column_tables: for each of the ``w`` byte columns, the index of its table.

    Returns:
        ``offsets`` [n + 1] (int64 byte offsets of each row's string) and ``buffer`` (uint8,
        ``offsets[-1]`` bytes): the two buffers of an Arrow binary column.

    Raises:
        CodecError: a byte value in ``data`` has no code in its column's table.
    """
    data = np.ascontiguousarray(data, dtype=np.uint8)
    n = data.shape[0]
    table, base = _stacked(_encode_table, tables, column_tables)
    # Two compiled passes: every row's size first (it fixes the offsets), then the bits.
    bits = np.empty(n, dtype=np.int64)
    if huffman_kernels.row_bits(data, table, base, bits) >= 0:
        raise CodecError("a byte value has no code in its column's Huffman table")
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum((bits + 7) >> 3, out=offsets[1:])
    total = int(offsets[-1])
    out = np.empty(total + 8, dtype=np.uint8)
    huffman_kernels.encode(data, table, base, offsets, out)
    return offsets, out[:total]


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


def decode_rows(
    buffer: np.ndarray, offsets: np.ndarray, tables: Sequence[str], column_tables: np.ndarray
) -> np.ndarray:
    """Inverse of :func:`encode_rows`: one byte per column of ``column_tables`` per row.

    ``offsets`` may start anywhere in ``buffer`` (a slice of a larger column).

    Raises:
        CodecError: a row's bit string is shorter than its symbols need, or holds bits that
            are no code of its table.
    """
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    n = len(offsets) - 1
    out = np.empty((n, len(column_tables)), dtype=np.uint8)
    if n <= 0 or len(column_tables) == 0:
        return out
    if offsets[0] < 0 or offsets[-1] > len(buffer) or np.any(np.diff(offsets) < 0):
        raise CodecError("Huffman row offsets fall outside their buffer")
    table, base = _stacked(_decode_table, tables, column_tables)
    # Read-only, as Arrow's buffers are: one compiled signature for every caller (numba
    # compiles a writable and a read-only array apart; precompile.py compiles this one).
    buffer = _read_only(np.ascontiguousarray(buffer, dtype=np.uint8))
    # The kernel reads unchecked: rows too close to the buffer's end decode from a padded copy
    # of the last rows' bytes.
    span = huffman_kernels.read_span(len(column_tables))
    fast = int(np.searchsorted(offsets[:-1], len(buffer) - span, side="right"))
    bad = huffman_kernels.decode(buffer, offsets[: fast + 1], table, base, out[:fast]) >= 0
    if fast < n:
        start = int(offsets[fast])
        tail = np.zeros(int(offsets[-1]) - start + span, dtype=np.uint8)
        tail[: len(tail) - span] = buffer[start : offsets[-1]]
        tail = _read_only(tail)
        bad |= huffman_kernels.decode(tail, offsets[fast:] - start, table, base, out[fast:]) >= 0
    if bad:
        raise CodecError("a Huffman-coded row is truncated or holds no code of its table")
    return out


def table_cost(counts: np.ndarray, lengths: np.ndarray) -> float:
    """Bits ``counts`` take under ``lengths``; infinite when a used symbol has no code."""
    if np.any((counts > 0) & (lengths == 0)):
        return float("inf")
    return float(np.dot(counts.astype(np.float64), lengths.astype(np.float64)))


class TableCache:
    """The code tables of the previous batch, reused while they stay nearly optimal.

    Args:
        tolerance: reuse the cached tables while they cost at most this fraction more bits
            than tables built for the new batch.
    """

    def __init__(self, tolerance: float = 0.01) -> None:
        self.tolerance = tolerance
        self._lengths: list[np.ndarray] | None = None
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def tables_for(self, data: np.ndarray, column_tables: np.ndarray) -> list[str]:
        """The tables (hex lengths) to code ``data`` [n, w] with, one per table index in
        ``column_tables``."""
        counts = _histograms(data, column_tables)
        with self._lock:
            cached = self._lengths
        usable = cached is not None and len(cached) == len(counts)
        if usable:
            assert cached is not None
            old = sum(table_cost(c, t) for c, t in zip(counts, cached, strict=True))
            # No table beats the entropy: within tolerance of it, reuse without building.
            if old <= (1 + self.tolerance) * sum(_entropy_bits(c) for c in counts):
                return self._hit(cached)
        fresh = [code_lengths(c) for c in counts]
        if usable:
            assert cached is not None
            new = sum(table_cost(c, t) for c, t in zip(counts, fresh, strict=True))
            if old <= (1 + self.tolerance) * new:
                return self._hit(cached)
        with self._lock:
            self.misses += 1
            self._lengths = fresh
        return [lengths_to_hex(t) for t in fresh]

    def _hit(self, cached: list[np.ndarray]) -> list[str]:
        with self._lock:
            self.hits += 1
        return [lengths_to_hex(t) for t in cached]


def _entropy_bits(counts: np.ndarray) -> float:
    used = counts[counts > 0].astype(np.float64)
    if len(used) == 0:
        return 0.0
    return float(-(used * np.log2(used / used.sum())).sum())


def _histograms(data: np.ndarray, column_tables: np.ndarray) -> list[np.ndarray]:
    """Byte counts per table; above ~1 MB from a row sample, with every byte value kept
    codable (a sample can miss a rare value the batch holds)."""
    groups = int(column_tables.max()) + 1 if len(column_tables) else 1
    data = np.ascontiguousarray(data, dtype=np.uint8)
    sampled = data.size > _SAMPLE_BYTES and data.shape[0] > 1
    counts = np.zeros((groups, _ALPHABET), dtype=np.int64)
    columns = np.ascontiguousarray(column_tables, dtype=np.int64)
    step = max(1, data.size // _SAMPLE_BYTES) if sampled else 1
    huffman_kernels.histograms(data, step, columns, counts)
    if sampled:
        counts += 1
    return list(counts)


def column_runs(column_tables: np.ndarray) -> list[list[int]]:
    """The metadata form of ``column_tables``: runs of [table, count]."""
    runs: list[list[int]] = []
    for t in column_tables.tolist():
        if runs and runs[-1][0] == t:
            runs[-1][1] += 1
        else:
            runs.append([int(t), 1])
    return runs


def columns_from_runs(runs: object, tables: int) -> np.ndarray:
    """Inverse of :func:`column_runs`.

    Raises:
        CodecError: the runs are malformed or name a table that does not exist.
    """
    try:
        pairs = [(int(t), int(c)) for t, c in runs]  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        raise CodecError(f"malformed Huffman column runs {runs!r}") from None
    if any(not 0 <= t < tables or c < 0 for t, c in pairs):
        raise CodecError(f"Huffman column runs {runs!r} name a missing table")
    return np.repeat([t for t, _ in pairs], [c for _, c in pairs]).astype(np.int64)
