"""``delta``: a diff's rows as their change since the checkpoint a restore starts from, each row
at the narrowest width that restores it as well as a whole-row code would.

Why: a row a diff writes has usually moved little since that checkpoint (the full's
reconstruction, or the chain's for incremental diffs), so its change spans a far smaller range
than the row itself. The change is taken against the *reconstruction* (error feedback, as
LC-Checkpoint does), so it also carries the earlier code's own error and errors never pile up
along a chain.

Quality: ``bits`` stays the user's quality level. For every row the codec computes the squared
l2 error a whole-row code of the inner codec at ``bits`` would leave (the row's budget), then
gives the row the first width whose restored error is within it, trying in turn:

- width 0: no codes at all, the row restores as its reference (when the reference is already
  within budget, as it is for most rows a few steps after a checkpoint);
- the inner codec on the change at 2, 3, 4 and 8 bits;
- the change's own fp32 bytes (``RAW_BITS``), exact up to the rounding of the addition.

So no row restores worse than a whole-row code at ``bits`` would (up to fp32 rounding). How
often each width pays depends on how far rows moved: a few steps apart, most rows cost nothing
or 2-bit codes; early in training, when rows grow from their small initial values, the change
is as wide as the row. The writer therefore uses :meth:`DeltaCodec.encode_split`: a row whose
change needs more than ``bits`` bits is written whole instead (the same bytes as a whole-row
code, or fewer), in a second block the restore replaces rows from (a sibling file, or beside
the delta rows in their packed file).
(benchmarks/results/policies.json records the mix per checkpoint kind.)

Format (version 1): ``payload`` is a variable-size binary column, one entry per row: empty for
width 0, the inner codec's fixed-size ``payload`` entry (codes, then scale and bias) for widths
2-8, or the fp32 change (little-endian, ``cols`` values) for ``RAW_BITS``. The length of an
entry tells its width: the file's metadata ``widths`` lists ``[bits, length]`` for every width
present (lengths distinct, checked when encoding) and ``parts`` the inner codec's metadata of
each width (``{str(bits): metadata}``: parameter dtype, k-means codebook). The codec config
holds ``inner``, the whole-row codec's config, and ``entropy``: Parquet's compression of the
column (``none``, ``zstd`` or ``lz4``; variable lengths rule out fixed-size Huffman tables).
Decoding adds nothing by itself: it returns the change, which the reader adds (``additive = True``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from embckpt.codecs.base import (
    Codec,
    EncodedRows,
    codec_from_config,
    fixed_binary_column,
    fixed_binary_values,
    one_array,
    register,
)
from embckpt.codecs.common import PAYLOAD, binary_buffers, binary_column, float_rows
from embckpt.codecs.packing import packed_width
from embckpt.codecs.uniform import UniformCodec
from embckpt.errors import CodecError, ConfigError

#: Widths tried for a row's change, narrowest first; ``RAW_BITS`` is the change's fp32 bytes.
CODE_WIDTHS = (2, 3, 4, 8)
RAW_BITS = 32
DELTA_ENTROPY = ("none", "zstd", "lz4")


@dataclass(frozen=True)
class SplitRows:
    """A batch split between deltas and whole rows (positions among the batch's rows)."""

    delta: EncodedRows
    delta_rows: np.ndarray
    whole: EncodedRows | None
    whole_rows: np.ndarray


@dataclass(frozen=True)
class WidthGroup:
    """The rows of a batch (or of several) whose change is coded at one width."""

    bits: int  # a code width of the inner codec, or RAW_BITS
    rows: np.ndarray  # positions among the batch's rows, ascending
    data: np.ndarray  # uint8 [len(rows), entry length]: each row's payload entry
    part: Mapping[str, Any]  # the inner codec's metadata for this width

    def inner(self) -> EncodedRows:
        """The rows as the inner codec's batch at ``bits`` (not for ``RAW_BITS``)."""
        return EncodedRows({PAYLOAD: fixed_binary_column(self.data)}, self.part)


@dataclass(frozen=True)
class RowEntries:
    """One batch's payload entries: each row's decode group (``keys``, -1: width 0), and
    where its entry lies in ``data`` (``offsets`` [n + 1])."""

    keys: np.ndarray
    offsets: np.ndarray
    data: np.ndarray


@register
class DeltaCodec(Codec):
    """Per-row-width deltas of a quantizing codec, within the whole-row error budget.

    Args:
        inner: config of the whole-row codec (``get_config()`` of ``asymmetric``,
            ``symmetric``, ``adaptive`` or ``kmeans``).
        entropy: Parquet compression of the payload column: ``none``, ``zstd`` or ``lz4``.
        bits: the quality level, the whole-row code's width (default: ``inner``'s).
    """

    codec_id = "delta"
    format_version = 1
    additive = True

    def __init__(
        self, inner: Mapping[str, Any], entropy: str = "zstd", bits: int | None = None
    ) -> None:
        if entropy not in DELTA_ENTROPY:
            raise ConfigError(f"codec 'delta': entropy must be one of {DELTA_ENTROPY}")
        self.whole = codec_from_config({**inner, **({} if bits is None else {"bits": bits})})
        if self.whole.additive or self.whole.lossless or not hasattr(self.whole, "bits"):
            raise ConfigError(
                f"codec 'delta': inner codec {inner.get('id')!r} is not a whole-row quantizer"
            )
        self.inner = dict(self.whole.get_config())
        self.bits: int = self.whole.bits  # type: ignore[attr-defined]
        self.entropy = entropy
        self._widths: dict[int, Codec] = {}

    def _options(self) -> dict[str, Any]:
        return {"inner": self.inner, "entropy": self.entropy, "bits": self.bits}

    def width_codec(self, bits: int) -> Codec:
        """The inner codec at ``bits``, entropy stage off (the column is compressed whole)."""
        codec = self._widths.get(bits)
        if codec is None:
            codec = codec_from_config({**self.inner, "bits": bits, "entropy": "none"})
            self._widths[bits] = codec
        return codec

    def encode(self, rows: torch.Tensor) -> EncodedRows:
        """Rows against a zero reference: each row at the narrowest width within budget."""
        return self.encode_delta(rows, torch.zeros_like(rows, dtype=torch.float32))

    def encode_delta(self, live: torch.Tensor, reference: torch.Tensor) -> EncodedRows:
        """Encodes ``live - reference`` [n, cols], each row at the narrowest width whose
        restored error stays within what a whole-row code of ``live`` at ``bits`` leaves."""
        x = float_rows(live, self.codec_id)
        change = x - reference.to(x.device, torch.float32)
        groups, rest = self._narrowest(x, change, CODE_WIDTHS)
        if len(rest):
            exact = change.index_select(0, torch.from_numpy(rest).to(x.device)).cpu().numpy()
            groups[RAW_BITS] = (rest, exact.astype("<f4").view(np.uint8), {})
        return self._pack(x.shape[0], groups)

    def encode_split(self, live: torch.Tensor, reference: torch.Tensor) -> SplitRows:
        """As :meth:`encode_delta`, but a row whose change needs more than ``bits`` bits is
        written as a whole-row code of ``live`` (by ``whole``) instead: no larger, and within
        budget by definition. A restore adds the deltas and replaces the whole rows."""
        x = float_rows(live, self.codec_id)
        change = x - reference.to(x.device, torch.float32)
        groups, rest = self._narrowest(x, change, [b for b in CODE_WIDTHS if b <= self.bits])
        kept = np.ones(x.shape[0], dtype=bool)
        kept[rest] = False
        picked = np.flatnonzero(kept)
        if len(rest):
            # The delta rows' positions among the rows the delta keeps, for _pack.
            renumber = np.cumsum(kept) - 1
            groups = {b: (renumber[rows], data, m) for b, (rows, data, m) in groups.items()}
        whole = None
        if len(rest):
            whole = self.whole.encode(x.index_select(0, torch.from_numpy(rest).to(x.device)))
        return SplitRows(self._pack(len(picked), groups), picked, whole, rest)

    def _narrowest(
        self, x: torch.Tensor, change: torch.Tensor, widths: Sequence[int]
    ) -> tuple[dict[int, tuple[np.ndarray, np.ndarray, dict[str, Any]]], np.ndarray]:
        """Each row's narrowest width among 0 and ``widths`` within budget: the groups (rows,
        payload bytes, inner metadata) by width, and the rows none of them holds."""
        n, cols = x.shape
        budget = _squared_error(self.width_codec(self.bits), x, cols)
        width = np.full(n, -1, dtype=np.int64)
        width[(_sq_norm(change) <= budget).cpu().numpy()] = 0
        groups: dict[int, tuple[np.ndarray, np.ndarray, dict[str, Any]]] = {}
        seen_lengths = {0}
        for bits in _code_widths(cols):
            todo = np.flatnonzero(width < 0)
            if not len(todo) or bits not in widths:
                continue
            codec = self.width_codec(bits)
            index = torch.from_numpy(todo).to(x.device)
            part = change.index_select(0, index)
            encoded = codec.encode(part)
            decoded = codec.decode(encoded, cols).to(x.device)
            ok = (_sq_norm(decoded - part) <= budget.index_select(0, index)).cpu().numpy()
            data = fixed_binary_values(encoded.columns[PAYLOAD])
            # A length already taken (parameters widened to fp32 for this batch) would make
            # the widths ambiguous: such rows go on to the next width (or are left over).
            if ok.any() and data.shape[1] not in seen_lengths:
                width[todo[ok]] = bits
                groups[bits] = (todo[ok], data[ok], dict(encoded.metadata))
                seen_lengths.add(data.shape[1])
        return groups, np.flatnonzero(width < 0)

    def _pack(
        self, n: int, groups: Mapping[int, tuple[np.ndarray, np.ndarray, dict[str, Any]]]
    ) -> EncodedRows:
        """One binary entry per row, each group's rows scattered to their places in row order."""
        lengths = np.zeros(n, dtype=np.int64)
        for rows, data, _ in groups.values():
            lengths[rows] = data.shape[1]
        widths = sorted((bits, int(data.shape[1])) for bits, (_, data, _) in groups.items())
        if len({length for _, length in widths}) != len(widths) or any(w == 0 for _, w in widths):
            raise CodecError(f"codec 'delta': widths {widths} do not have distinct lengths")
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        buffer = np.empty(int(offsets[-1]), dtype=np.uint8)
        for rows, data, _ in groups.values():
            positions = offsets[rows][:, None] + np.arange(data.shape[1])
            buffer[positions] = data
        meta = {
            "widths": [list(w) for w in widths],
            "parts": {str(bits): m for bits, (_, _, m) in groups.items() if bits != RAW_BITS},
        }
        hint = {PAYLOAD: self.entropy} if self.entropy != "none" else {}
        return EncodedRows({PAYLOAD: binary_column(offsets, buffer)}, meta, hint)

    def decode(self, encoded: EncodedRows, num_cols: int) -> torch.Tensor:
        return self.decode_many([encoded], num_cols)[0]

    def decode_many(self, items: Sequence[EncodedRows], num_cols: int) -> list[torch.Tensor]:
        """Decodes the batches (a block's diffs along a chain) with one inner decode per width
        and inner metadata over all of them: a long chain of small diffs pays per width, not
        per file."""
        sizes, groups = self.width_groups(items)
        out = np.zeros((sum(sizes), num_cols), dtype=np.float32)
        for group in groups:
            out[group.rows] = self.decode_group(group, num_cols)
        return list(torch.split(torch.from_numpy(out), sizes))

    def decode_group(self, group: WidthGroup, num_cols: int) -> np.ndarray:
        """One width group's changes, float32 [len(group.rows), num_cols], on the CPU: the raw
        ones as stored, the others decoded by that width's codec."""
        if group.bits == RAW_BITS:
            return group.data.view("<f4")
        return self.width_codec(group.bits).decode(group.inner(), num_cols).float().numpy()

    def decode_group_into(self, group: WidthGroup, num_cols: int, out: np.ndarray) -> None:
        """:meth:`decode_group` written into ``out`` (float32 [len(group.rows), num_cols],
        C-contiguous): a uniform inner codec decodes straight into it, without a buffer of its
        own to copy from."""
        if group.bits != RAW_BITS:
            inner = self.width_codec(group.bits)
            if isinstance(inner, UniformCodec) and inner.decode_into(group.inner(), num_cols, out):
                return
        out[:] = self.decode_group(group, num_cols)

    def row_entries(
        self, items: Sequence[EncodedRows]
    ) -> tuple[list[RowEntries], list[tuple[int, int, Mapping[str, Any]]]]:
        """Each batch's payload entries and their decode groups, and those groups:
        ``(bits, entry length, inner metadata)``, numbered over all of ``items``.

        Raises:
            CodecError: a payload that is not a binary column, or a row matching no width.
        """
        entries: list[RowEntries] = []
        parts: list[tuple[int, int, Mapping[str, Any]]] = []
        for encoded in items:
            column = one_array(encoded.columns[PAYLOAD])
            if not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
                raise CodecError("delta payload is not a binary column")
            offsets, data = binary_buffers(column)
            keys = self._row_keys(np.diff(offsets), encoded.metadata, parts)
            entries.append(RowEntries(keys, offsets, data))
        return entries, parts

    def kernel_parts(
        self, parts: Sequence[tuple[int, int, Mapping[str, Any]]], num_cols: int
    ) -> np.ndarray | None:
        """``parts`` (of :meth:`row_entries`) as ``delta_kernels.add_coded`` takes them (int64
        [len(parts), 4]: width, fp16 parameters, bias stored, entry length), or None where
        one of them is a width that kernel does not decode (a k-means inner codec, the
        compiled kernels off).

        Raises:
            CodecError: an entry length that is not its width's for ``num_cols`` columns.
        """
        table = np.zeros((len(parts), 4), dtype=np.int64)
        for k, (bits, length, part) in enumerate(parts):
            if bits == RAW_BITS:
                half, bias, expected = False, False, 4 * num_cols
            else:
                inner = self.width_codec(bits)
                layout = (
                    inner.fused_layout(part, num_cols) if isinstance(inner, UniformCodec) else None
                )
                if layout is None:
                    return None
                half, expected = layout
                bias = inner.bias_stored
            if length != expected:
                raise CodecError(
                    f"delta rows of {length} bytes for {num_cols} columns at {bits} bits "
                    f"(expected {expected})"
                )
            table[k] = (bits, half, bias, length)
        return table

    def width_groups(self, items: Sequence[EncodedRows]) -> tuple[list[int], list[WidthGroup]]:
        """The rows of ``items`` (counted over all of them, in order) of each width and inner
        metadata, and each item's row count: what a decoder, on the CPU or a GPU
        (``device_decode.py``), decodes one group at a time. Width-0 rows are in no group
        (their change is zero).

        Raises:
            CodecError: a payload that is not a binary column, or a row matching no width.
        """
        return self.groups_of(*self.row_entries(items))

    def groups_of(
        self, entries: Sequence[RowEntries], parts: Sequence[tuple[int, int, Mapping[str, Any]]]
    ) -> tuple[list[int], list[WidthGroup]]:
        """:meth:`width_groups` of batches whose entries :meth:`row_entries` gave."""
        sizes = [len(e.keys) for e in entries]
        if not sum(sizes):
            return sizes, []
        # Imported here: its compiled signatures load with the module (numba's start-up,
        # which importing the codecs does not pay).
        from embckpt.codecs import row_kernels

        # Each column's own buffers, joined by numpy: casting every column to large_binary
        # and concatenating them in Arrow cost about a tenth of a chain's width grouping.
        datas, starts, at = [], [], 0
        for e in entries:
            first, end = int(e.offsets[0]), int(e.offsets[-1])
            datas.append(e.data[first:end])
            starts.append(e.offsets[:-1] + (at - first))
            at += end - first
        buffer = np.concatenate(datas) if len(datas) > 1 else np.ascontiguousarray(datas[0])
        start = np.concatenate(starts)
        key = np.concatenate([e.keys for e in entries])
        groups = []
        for k, (bits, length, part) in enumerate(parts):
            rows = np.flatnonzero(key == k)
            if len(rows):
                data = row_kernels.gather_entries(buffer, start[rows], length)
                groups.append(WidthGroup(bits, rows, data, part))
        return sizes, groups

    @staticmethod
    def _row_keys(
        lengths: np.ndarray,
        meta: Mapping[str, Any],
        parts: list[tuple[int, int, Mapping[str, Any]]],
    ) -> np.ndarray:
        """Each row's decode group (-1: width 0, the row restores as its reference) from its
        entry's length, groups keyed by width, entry length and the inner codec's metadata
        (compared as dicts: serialising them for a key cost more), new ones added to
        ``parts``.

        Raises:
            CodecError: a row's length matches none of the batch's widths.
        """
        widths = {int(length): int(bits) for bits, length in meta.get("widths", [])}
        # A lookup table, not np.unique: a diff's few rows decode in microseconds.
        lookup = np.full(max([int(lengths.max(initial=0)), *widths]) + 1, -2, dtype=np.int64)
        lookup[0] = -1
        for length, bits in widths.items():
            part = (bits, length, {} if bits == RAW_BITS else meta["parts"][str(bits)])
            if part not in parts:
                parts.append(part)
            lookup[length] = parts.index(part)
        keys = lookup[lengths]
        if (keys == -2).any():
            unknown = np.unique(lengths[keys == -2])
            raise CodecError(f"delta rows of {unknown.tolist()} bytes match no width {widths}")
        return keys


def deltas_for(codec: Codec, entropy: str) -> DeltaCodec | None:
    """The delta codec of a whole-row quantizer (None for codecs that are not one: lossless,
    16-bit floats, or already deltas)."""
    if codec.additive or codec.lossless or not hasattr(codec, "bits") or codec.codec_id == "delta":
        return None
    return DeltaCodec(codec.get_config(), entropy if entropy in DELTA_ENTROPY else "zstd")


def _code_widths(cols: int) -> list[int]:
    """The code widths worth trying for rows of ``cols`` values: of widths that pack into the
    same number of bytes (short rows), only the widest, which is the most exact at that size."""
    return [
        bits
        for i, bits in enumerate(CODE_WIDTHS)
        if all(packed_width(cols, bits) < packed_width(cols, w) for w in CODE_WIDTHS[i + 1 :])
    ]


def _sq_norm(x: torch.Tensor) -> torch.Tensor:
    # vector_norm measured faster than (x * x).sum(1) here (no temporary).
    return torch.linalg.vector_norm(x, dim=1).square_()


def _squared_error(codec: Codec, x: torch.Tensor, cols: int) -> torch.Tensor:
    """Each row's squared l2 error under ``codec`` (on ``x``'s device)."""
    decoded = codec.decode(codec.encode(x), cols).to(x.device)
    return _sq_norm(decoded - x)
