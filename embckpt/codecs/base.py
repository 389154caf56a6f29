"""The row-codec contract and its registry.

A codec turns a batch of embedding rows (a 2-D torch tensor, any device) into the per-row
Parquet columns the storage layer writes, plus JSON-able metadata kept in the file's key-value
metadata; ``decode`` inverts it. A reader rebuilds the codec from a file's metadata alone
(``get_config``), and everything a file needs to decode is in that file. Codecs may keep caches
between calls (a Huffman table, a k-means codebook) that make the next batch cheaper to encode
or decode, never ones a reader would need.
"""

from __future__ import annotations

import abc
import inspect
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import torch

from embckpt.errors import ConfigError, UnknownCodecError


@dataclass(frozen=True)
class EncodedRows:
    """One batch of encoded rows: equal-length Parquet columns and the codec's file metadata.

    ``compression`` optionally names a Parquet compression per column (e.g. ``{"payload":
    "zstd"}``), for codecs whose entropy stage is Parquet's own.
    """

    columns: Mapping[str, pa.Array]
    metadata: Mapping[str, Any] = field(default_factory=dict)
    compression: Mapping[str, str] = field(default_factory=dict)


class Codec(abc.ABC):
    """Encodes rows of one table shard. Subclasses set ``codec_id`` and ``format_version``.

    An ``additive`` codec encodes the difference between the rows and the last reconstructed
    state of the same rows (``exponent``, ``delta``); a reader adds what it decodes to the rows
    it already restored.
    """

    codec_id: ClassVar[str]
    format_version: ClassVar[int] = 1
    lossless: ClassVar[bool] = False
    additive: ClassVar[bool] = False
    rows_independent: ClassVar[bool] = False
    """Whether each row decodes from its own bytes and the batch's metadata alone, so that
    batches of equal metadata decode as one (:meth:`decode_many`)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "delta" in cls.__dict__:  # the flag's former name, in codecs users registered
            warnings.warn(
                f"{cls.__name__}.delta is deprecated: set `additive` instead",
                DeprecationWarning,
                stacklevel=2,
            )
            cls.additive = bool(cls.__dict__["delta"])

    def __getattr__(self, name: str) -> Any:
        if name == "delta":  # the flag's former name
            warnings.warn(
                "Codec.delta is deprecated: read `additive` instead",
                DeprecationWarning,
                stacklevel=2,
            )
            return self.additive
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @abc.abstractmethod
    def encode(self, rows: torch.Tensor) -> EncodedRows:
        """Encodes ``rows`` [n, cols]."""

    @abc.abstractmethod
    def decode(self, encoded: EncodedRows, num_cols: int) -> torch.Tensor:
        """Decodes to a CPU tensor [n, num_cols] of the dtype that was encoded."""

    def decode_many(self, items: Sequence[EncodedRows], num_cols: int) -> list[torch.Tensor]:
        """Decodes several batches (a block's files along a chain), each as :meth:`decode`
        would. Codecs whose rows decode independently of each other (``rows_independent``)
        decode the batches that share metadata and column types as one: a restore of a long
        chain pays one decode per group, not one per file."""
        if not self.rows_independent or len(items) < 2:
            return [self.decode(item, num_cols) for item in items]
        # Metadata holds JSON values (a file header's, or a codec's own): compared as they are.
        groups = equal_groups(
            (item.metadata, sorted((n, c.type) for n, c in item.columns.items())) for item in items
        )
        out: list[torch.Tensor | None] = [None] * len(items)
        for members in groups:
            if len(members) == 1:
                out[members[0]] = self.decode(items[members[0]], num_cols)
                continue
            first = items[members[0]]
            joined = EncodedRows(
                {
                    name: pa.concat_arrays([one_array(items[i].columns[name]) for i in members])
                    for name in first.columns
                },
                first.metadata,
            )
            decoded = self.decode(joined, num_cols)
            counts = [len(next(iter(items[i].columns.values()))) for i in members]
            for i, part in zip(members, torch.split(decoded, counts), strict=True):
                out[i] = part
        return [t for t in out if t is not None]

    def get_config(self) -> dict[str, Any]:
        """Everything needed to rebuild this codec: its id, format version and options."""
        return {"id": self.codec_id, "version": self.format_version, **self._options()}

    def _options(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Codec:
        options = {k: v for k, v in config.items() if k not in ("id", "version")}
        return cls(**options)


def one_array(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """``column`` as one Arrow array: a chunked column's only chunk as it is, several joined.
    Arrow's ``combine_chunks`` copies even a single chunk, and a restore's block columns are
    one-chunk slices of a file's read: a small diff's block was copied there for nothing."""
    if not isinstance(column, pa.ChunkedArray):
        return column
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def equal_groups(keys: Iterable[Any]) -> list[list[int]]:
    """The positions of ``keys`` grouped by equal key, in order of first appearance. Keys are
    compared as values, not serialised: a chain's files hold a few distinct ones, and a JSON
    key per file cost more than the comparisons (``decode_many``: 0.38 against 0.32 ms a link
    of a 32-table model on the 2-core machine of ``benchmarks/results/``)."""
    seen: list[Any] = []
    groups: list[list[int]] = []
    for i, key in enumerate(keys):
        if key in seen:
            groups[seen.index(key)].append(i)
        else:
            seen.append(key)
            groups.append([i])
    return groups


_REGISTRY: dict[str, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator adding a codec to the registry under its ``codec_id``."""
    _REGISTRY[cls.codec_id] = cls
    return cls


def make_codec(codec_id: str, options: Mapping[str, Any] | None = None) -> Codec:
    """Builds a registered codec from its id and options (as in ``CheckpointConfig``).

    Raises:
        UnknownCodecError: no codec is registered under ``codec_id``.
        ConfigError: an option the codec does not take, or a value it rejects.
    """
    return codec_from_config({"id": codec_id, **(options or {})})


def codec_from_config(config: Mapping[str, Any]) -> Codec:
    """Rebuilds the codec a file was written with.

    Raises:
        UnknownCodecError: the id is not registered, or the format version is newer than ours.
        ConfigError: an option the codec does not take, or a value it rejects.
    """
    codec_id = config.get("id")
    cls = _REGISTRY.get(str(codec_id))
    if cls is None:
        raise UnknownCodecError(f"unknown codec {codec_id!r}; known: {sorted(_REGISTRY)}")
    version = int(config.get("version", cls.format_version))
    if version > cls.format_version:
        raise UnknownCodecError(
            f"codec {codec_id!r} format version {version} is newer than this reader's "
            f"{cls.format_version}; upgrade embckpt"
        )
    try:
        return cls.from_config(config)
    except TypeError as exc:
        # An option the codec's constructor does not take: name the codec and what it takes.
        takes = sorted(set(inspect.signature(cls.__init__).parameters) - {"self"})
        raise ConfigError(f"codec {codec_id!r}: {exc}; its options are {takes}") from None


def fixed_binary_column(data: np.ndarray) -> pa.FixedSizeBinaryArray:
    """Wraps a C-contiguous uint8 array [n, width] as a Parquet fixed-size binary column.

    Zero-copy: Arrow takes the numpy buffer as it is.
    """
    data = np.ascontiguousarray(data, dtype=np.uint8)
    n, width = data.shape
    return pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(width), n, [None, pa.py_buffer(data.reshape(-1))]
    )


def as_binary(column: pa.FixedSizeBinaryArray) -> pa.BinaryArray:
    """A fixed-size binary column as a variable-length one of the same bytes (the data
    buffer shared, offsets added), so that it can share a packed file with binary columns.
    Under Parquet's delta-coded lengths the equal lengths take next to nothing."""
    if column.null_count:
        raise ValueError("fixed-size binary column has nulls")
    n, width = len(column), column.type.byte_width
    if n * width >= 1 << 31:
        raise ValueError(f"{n * width} bytes do not fit a binary column's 32-bit offsets")
    data = column.buffers()[1].slice(column.offset * width, n * width)
    offsets = np.arange(0, (n + 1) * width, width, dtype=np.int32)
    return pa.BinaryArray.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), data])


def fixed_binary_values(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The bytes of a fixed-size binary column as a uint8 array [n, width] (one copy at most);
    also of a binary column whose entries are all one length (:func:`as_binary`).

    Raises:
        ValueError: nulls, or binary entries of different lengths.
    """
    column = one_array(column)
    if column.null_count:
        raise ValueError("fixed-size binary column has nulls")
    if pa.types.is_binary(column.type):
        return _equal_entries(column)
    width = column.type.byte_width
    buf = np.frombuffer(column.buffers()[1], dtype=np.uint8)
    start = column.offset * width
    return buf[start : start + len(column) * width].reshape(len(column), width)


def _equal_entries(column: pa.BinaryArray) -> np.ndarray:
    """The entries of a binary column [n, width], a view of its data: all must be one length."""
    n = len(column)
    offsets = np.frombuffer(column.buffers()[1], dtype=np.int32)[
        column.offset : column.offset + n + 1
    ]
    lengths = np.diff(offsets)
    width = int(lengths[0]) if n else 0
    if n and (lengths != width).any():
        raise ValueError("binary column of rows of different lengths where one width is needed")
    data = column.buffers()[2]
    buf = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
    return buf[offsets[0] : offsets[0] + n * width].reshape(n, width)
