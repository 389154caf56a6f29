"""Where a checkpoint's bytes go, per written row: measured from its files, not estimated.

Rows files (Parquet) are split by column with the footer's per-column-chunk sizes: row ids
(``row``), optimizer state (``state.*``, ``elem.*``), the codec's columns, and the rest of the
file (magic, footer: Parquet overhead). For the uniform-quantization layout (``asymmetric``,
``adaptive``, ``symmetric``: packed codes then fp16/fp32 scale and bias, embckpt/codecs/uniform.py)
the payload is split further into codes and scale+bias: exactly, from the Huffman code lengths of
every decoded byte, when the payload is Huffman-coded (what is left of the column is framing:
per-row byte alignment, the rows' delta-coded lengths and page headers); in proportion to the
layout's byte widths when it is stored plain; in proportion to what each part compresses to alone
when the column is zstd- or lz4-compressed (an estimate: the column is compressed as a whole).
Other codecs' columns stay one part (``codec``). Non-row files (``dense/*.safetensors``,
``MANIFEST.json``) are per-checkpoint costs.

Usage: ``python benchmarks/byte_budget.py DIR/step_000000000100``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embckpt.codecs import huffman
from embckpt.codecs.base import fixed_binary_values
from embckpt.codecs.packing import packed_width

PARTS = (
    "codes",
    "scale_bias",
    "payload_framing",
    "codec",
    "optimizer_state",
    "row_ids",
    "parquet_overhead",
    "non_row_files",
)
"""Budget parts, in report order; ``codec`` holds codec columns that could not be split."""

_UNIFORM_PARAMS = {"asymmetric": 2, "adaptive": 2, "symmetric": 1}
"""Per-row parameters (scale, bias) after the packed codes, for the uniform row layout."""
_PARAM_BYTES = {"float16": 2, "float32": 4}
WHOLE_SUFFIX = ".whole.parquet"
"""A delta diff's sibling file of rows written whole (embckpt/save/writer.py)."""
_CODE_WIDTHS = (2, 3, 4, 8)
"""Widths at which a delta entry is an inner uniform row; other widths are fp32 changes."""


def _column_part(name: str) -> str:
    if name == "row":
        return "row_ids"
    if name.startswith(("state.", "elem.")):
        return "optimizer_state"
    return "codec"


def _column_bytes(metadata: pq.FileMetaData) -> dict[str, int]:
    """Compressed bytes (page headers included) of each top-level column over all row groups."""
    sizes: dict[str, int] = {}
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        for index in range(row_group.num_columns):
            chunk = row_group.column(index)
            top = chunk.path_in_schema.split(".list.")[0]
            sizes[top] = sizes.get(top, 0) + chunk.total_compressed_size
    return sizes


def _uniform_widths(meta: Mapping[str, Any]) -> tuple[int, int] | None:
    """(code bytes, parameter bytes) per row when the file uses the uniform layout."""
    codec = meta.get("codec", {})
    params = _UNIFORM_PARAMS.get(codec.get("id", ""))
    param_bytes = _PARAM_BYTES.get(meta.get("codec_meta", {}).get("param_dtype", ""))
    if params is None or param_bytes is None or "bits" not in codec:
        return None
    return packed_width(int(meta["cols"]), int(codec["bits"])), params * param_bytes


def _split_payload(path: Path, meta: Mapping[str, Any], stored: int) -> dict[str, float] | None:
    """Codes, scale+bias and framing bytes of the ``payload`` column, or None if not split."""
    widths = _uniform_widths(meta)
    codec_meta = meta.get("codec_meta", {})
    if widths is None:
        return None
    code_bytes, param_bytes = widths
    column = pq.read_table(path, columns=["payload"]).column("payload").combine_chunks()
    entropy = codec_meta.get("entropy")
    if entropy == "huffman":
        tables = [huffman.lengths_from_hex(t) for t in codec_meta["huffman"]]
        columns = huffman.columns_from_runs(codec_meta["huffman_columns"], len(tables))
        if len(columns) != code_bytes + param_bytes:
            return None
        offset_type = np.int64 if pa.types.is_large_binary(column.type) else np.int32
        offsets = np.frombuffer(column.buffers()[1], dtype=offset_type)[: len(column) + 1]
        data = np.frombuffer(column.buffers()[2], dtype=np.uint8)
        decoded = huffman.decode_rows(
            data, offsets.astype(np.int64), codec_meta["huffman"], columns
        )
        lengths = np.stack(tables).astype(np.int64)  # [tables, 256] code bits of each byte
        bits = lengths[columns[None, :], decoded].sum(axis=0)  # per byte column
        codes, params = bits[:code_bytes].sum() / 8, bits[code_bytes:].sum() / 8
        return {"codes": codes, "scale_bias": params, "payload_framing": stored - codes - params}
    if not pa.types.is_fixed_size_binary(column.type):
        return None
    data = fixed_binary_values(column)
    if data.shape[1] != code_bytes + param_bytes:
        return None
    code_share, param_share = float(code_bytes), float(param_bytes)
    if entropy in ("zstd", "lz4"):
        # The column is compressed as a whole: shares from compressing each part alone.
        code_share = len(pa.compress(np.ascontiguousarray(data[:, :code_bytes]), entropy))
        param_share = len(pa.compress(np.ascontiguousarray(data[:, code_bytes:]), entropy))
    elif entropy != "none":
        return None
    scale = stored / (code_share + param_share)
    return {"codes": code_share * scale, "scale_bias": param_share * scale, "payload_framing": 0.0}


def _compressed(data: np.ndarray, entropy: str | None) -> int:
    """Bytes of ``data`` under the column's compression (its own size when uncompressed)."""
    data = np.ascontiguousarray(data)
    return len(pa.compress(data, entropy)) if entropy in ("zstd", "lz4") else data.nbytes


def _split_delta(
    path: Path, meta: Mapping[str, Any], stored: int
) -> tuple[dict[str, float], dict[str, int]] | None:
    """Codes, scale+bias and framing bytes of a ``delta`` payload, and its rows per width.

    Every entry's length gives its width (embckpt/codecs/delta.py): none for an empty entry, the
    inner codec's uniform row (codes, then its parameters) for 2-8 bits, fp32 changes (all
    codes) otherwise. The stored column is shared out in proportion to what the codes, the
    parameters and the entries' lengths compress to apart (exact when stored uncompressed)."""
    codec = meta["codec"]
    params = _UNIFORM_PARAMS.get(codec.get("inner", {}).get("id", ""))
    if params is None:
        return None
    codec_meta = meta.get("codec_meta", {})
    column = pq.read_table(path, columns=["payload"]).column("payload").combine_chunks()
    offset_type = np.int64 if pa.types.is_large_binary(column.type) else np.int32
    offsets = np.frombuffer(column.buffers()[1], dtype=offset_type)[: len(column) + 1]
    offsets = offsets.astype(np.int64)
    lengths = np.diff(offsets)
    data = np.frombuffer(column.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    bits_of_length = {int(length): int(bits) for bits, length in codec_meta.get("widths", [])}
    code_length = np.zeros_like(lengths)  # bytes of codes at the start of each entry
    width_rows = {"0": int(np.count_nonzero(lengths == 0))}
    for length, bits in bits_of_length.items():
        has = lengths == length
        width_rows[str(bits)] = int(np.count_nonzero(has))
        coded = bits in _CODE_WIDTHS
        code_length[has] = packed_width(int(meta["cols"]), bits) if coded else length
    position = np.arange(len(data)) - np.repeat(offsets[:-1] - offsets[0], lengths)
    is_code = position < np.repeat(code_length, lengths)
    entropy = codec.get("entropy")
    shares = np.array(
        [
            _compressed(data[is_code], entropy),
            _compressed(data[~is_code], entropy),
            _compressed(lengths.astype(np.int32), entropy),
        ],
        dtype=np.float64,
    )
    codes, scale_bias, framing = shares * stored / shares.sum()
    return {"codes": codes, "scale_bias": scale_bias, "payload_framing": framing}, width_rows


def rows_file_budget(path: str | Path) -> dict[str, Any]:
    """Bytes of one rows file by part (see :data:`PARTS`), plus ``rows``, ``bytes`` and, for a
    ``delta`` file, ``delta_widths`` (rows per code width; 0: unchanged, 32: fp32; ``whole``:
    a delta diff's rows written whole)."""
    path = Path(path)
    parquet = pq.ParquetFile(path)
    metadata = parquet.metadata
    meta = json.loads(parquet.schema_arrow.metadata[b"embckpt"])
    parts = dict.fromkeys(PARTS, 0.0)
    widths: dict[str, int] = {}
    for column, size in _column_bytes(metadata).items():
        split = None
        if column == "payload" and meta.get("codec", {}).get("id") == "delta":
            delta = _split_delta(path, meta, size)
            split, widths = delta if delta is not None else (None, {})
        elif column == "payload":
            split = _split_payload(path, meta, size)
        if split is None:
            parts[_column_part(column)] += size
        else:
            for part, value in split.items():
                parts[part] += value
    if path.name.endswith(WHOLE_SUFFIX):
        widths = {"whole": metadata.num_rows}
    size = path.stat().st_size
    parts["parquet_overhead"] = size - sum(parts.values())
    return {**parts, "rows": metadata.num_rows, "bytes": size, "delta_widths": widths}


def checkpoint_budget(step_dir: str | Path) -> dict[str, Any]:
    """The byte budget of one checkpoint folder: totals by part and per written row."""
    step_dir = Path(step_dir)
    totals = dict.fromkeys(PARTS, 0.0)
    widths: dict[str, int] = {}
    rows = files = 0
    for path in sorted(step_dir.glob("tables/*/*.parquet")):
        budget = rows_file_budget(path)
        rows += int(budget["rows"])
        files += 1
        for part in PARTS:
            totals[part] += budget[part]
        for bits, count in budget["delta_widths"].items():
            widths[bits] = widths.get(bits, 0) + count
    others: Iterable[Path] = [*step_dir.glob("dense/*"), step_dir / "MANIFEST.json"]
    totals["non_row_files"] = float(sum(p.stat().st_size for p in others if p.is_file()))
    total = sum(totals.values())
    manifest = step_dir / "MANIFEST.json"
    kind = json.loads(manifest.read_text()).get("kind") if manifest.is_file() else None
    return {
        "kind": kind,
        "rows": rows,
        "rows_files": files,
        "bytes": total,
        "parts": totals,
        "per_row": {part: value / max(rows, 1) for part, value in totals.items()},
        "bytes_per_row": total / max(rows, 1),
        "delta_widths": widths,
    }


def merge_budgets(budgets: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Several checkpoints' budgets as one: parts summed, per-row figures over all their rows."""
    budgets = list(budgets)
    totals = {part: sum(b["parts"][part] for b in budgets) for part in PARTS}
    rows = sum(b["rows"] for b in budgets)
    widths: dict[str, int] = {}
    for budget in budgets:
        for bits, count in budget.get("delta_widths", {}).items():
            widths[bits] = widths.get(bits, 0) + count
    return {
        "checkpoints": len(budgets),
        "rows": rows,
        "bytes": sum(totals.values()),
        "parts": totals,
        "per_row": {part: value / max(rows, 1) for part, value in totals.items()},
        "bytes_per_row": sum(totals.values()) / max(rows, 1),
        "delta_widths": widths,
    }


def format_budget(budgets: Mapping[str, Mapping[str, Any]]) -> str:
    """A text table: one column per budget (e.g. ``full``, ``diff``), bytes per written row."""
    names = list(budgets)
    width = max(14, *(len(n) + 2 for n in names))
    lines = [f"{'bytes per written row':>22}" + "".join(f"{n:>{width}}" for n in names)]
    for part in (*PARTS, "total"):
        values = [
            b["bytes_per_row"] if part == "total" else b["per_row"][part] for b in budgets.values()
        ]
        lines.append(f"{part:>22}" + "".join(f"{v:{width}.3f}" for v in values))
    lines.append(f"{'rows':>22}" + "".join(f"{b['rows']:{width}d}" for b in budgets.values()))
    for name, budget in budgets.items():
        mix = budget.get("delta_widths")
        if mix:
            shares = ", ".join(
                f"{bits}{' bits' if bits.isdigit() else ''} {count / budget['rows']:.1%}"
                for bits, count in mix.items()
            )
            lines.append(f"{name}: delta rows by width: {shares}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("step_dirs", nargs="+", help="checkpoint folders (step_NNNNNNNNNNNN)")
    parser.add_argument("--json", action="store_true", help="print the budgets as JSON")
    args = parser.parse_args()
    budgets = {str(d): checkpoint_budget(d) for d in args.step_dirs}
    print(json.dumps(budgets, indent=1) if args.json else format_budget(budgets))


if __name__ == "__main__":
    main()
