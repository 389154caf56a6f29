"""Reads Criteo click logs (Kaggle Display Advertising Challenge, Criteo 1TB) into a ClickDataset.

Input format: one sample per line, 40 tab-separated fields: the 0/1 label, 13 integer features
``I1..I13`` and 26 categorical features ``C1..C26`` (hex strings such as ``68fd1e64``); any
feature may be empty. A path is one such file or a folder of them (``day_0``, ``day_1``, ... or
``train.txt``; ``.gz`` files are decompressed on the fly), read in natural name order.

Output contract:

* ``dense = log1p(max(I, 0))`` with a missing integer read as 0;
* categorical ``C_f`` becomes a row of table ``f``: ``int(hex, 16) % cardinalities[f]`` (a
  CRC-32 of the bytes when the value is not hex of at most 16 digits), and a missing value row 0;
* reading streams record batches, so ``max_rows`` stops early on a multi-gigabyte day file and
  only the numeric result is ever held in memory. Nothing loops over rows in Python.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from embckpt import ConfigError
from embckpt.examples.dataset import ClickDataset
from embckpt.examples.workload import WorkloadConfig

__all__ = ["CRITEO_COLUMNS", "load_criteo_tsv"]

NUM_INT = 13
NUM_CAT = 26
INT_COLUMNS = [f"I{i}" for i in range(1, NUM_INT + 1)]
CAT_COLUMNS = [f"C{i}" for i in range(1, NUM_CAT + 1)]
CRITEO_COLUMNS = ["label", *INT_COLUMNS, *CAT_COLUMNS]

_FILE_NAME = re.compile(r"^(day_\d+|.+\.(txt|tsv))(\.gz)?$")
_BLOCK_BYTES = 16 << 20
_MAX_HEX_DIGITS = 16  # what fits in a uint64
# Byte -> hex digit value, -1 for bytes that are not hex digits.
_HEX_VALUE = np.full(256, -1, dtype=np.int64)
for _digits, _base in ((b"0123456789", 0), (b"abcdef", 10), (b"ABCDEF", 10)):
    _HEX_VALUE[np.frombuffer(_digits, dtype=np.uint8)] = np.arange(len(_digits)) + _base


def load_criteo_tsv(
    path: str | Path, cfg: WorkloadConfig, max_rows: int | None = None
) -> ClickDataset:
    """Reads a Criteo TSV file or folder into a dataset whose ids fit ``cfg.cardinalities``.

    Args:
        path: a file, or a folder of ``day_N`` / ``*.txt`` / ``*.tsv`` files (each maybe ``.gz``).
        cfg: the workload; it must have the Criteo schema (13 dense, 26 categorical, one id each).
        max_rows: stop after this many samples; all of them if None.

    Returns:
        The samples in file order, with ``ids_per_feature == 1``.

    Raises:
        ConfigError: the config is not Criteo-shaped, the path holds no click-log file, or a
            file is malformed (wrong column count, non-integer value, missing label); the
            message names the file.
    """
    if cfg.num_dense != NUM_INT or len(cfg.cardinalities) != NUM_CAT or cfg.ids_per_feature != 1:
        raise ConfigError(
            f"Criteo data needs num_dense={NUM_INT}, {NUM_CAT} cardinalities and "
            f"ids_per_feature=1; got {cfg.num_dense}, {len(cfg.cardinalities)} and "
            f"{cfg.ids_per_feature}"
        )
    if max_rows is not None and max_rows < 0:
        raise ConfigError(f"max_rows must be >= 0, got {max_rows}")
    dense: list[np.ndarray] = []
    sparse: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    remaining = max_rows
    for file in _list_files(Path(path)):
        for batch in _read_batches(file, remaining):
            d, s, y = _convert(batch, cfg.cardinalities, file)
            dense.append(d)
            sparse.append(s)
            labels.append(y)
            if remaining is not None:
                remaining -= len(y)
        if remaining == 0:
            break
    return ClickDataset(
        dense=np.concatenate(dense) if dense else np.zeros((0, NUM_INT), np.float32),
        sparse=np.concatenate(sparse) if sparse else np.zeros((0, NUM_CAT), np.int64),
        labels=np.concatenate(labels) if labels else np.zeros(0, np.float32),
    )


def _list_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ConfigError(f"{path}: no such Criteo file or folder")
    files = [p for p in path.iterdir() if p.is_file() and _FILE_NAME.match(p.name)]
    if not files:
        raise ConfigError(f"{path}: holds no day_N, *.txt or *.tsv file (optionally .gz)")

    def natural(p: Path) -> list[int | str]:
        # day_2 before day_10.
        return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", p.name)]

    return sorted(files, key=natural)


def _read_batches(file: Path, max_rows: int | None) -> Iterator[pa.RecordBatch]:
    """Streams ``file`` (up to ``max_rows`` rows) as typed record batches."""
    column_types = {"label": pa.int8()}
    column_types.update({name: pa.int64() for name in INT_COLUMNS})
    column_types.update({name: pa.string() for name in CAT_COLUMNS})
    rows = 0
    try:
        # pyarrow decompresses by the .gz suffix; Criteo has no quoting, so quotes are data.
        reader = pacsv.open_csv(
            file,
            read_options=pacsv.ReadOptions(column_names=CRITEO_COLUMNS, block_size=_BLOCK_BYTES),
            parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
            convert_options=pacsv.ConvertOptions(
                column_types=column_types, strings_can_be_null=True
            ),
        )
        while max_rows is None or rows < max_rows:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                break
            if max_rows is not None:
                batch = batch.slice(0, max_rows - rows)
            rows += batch.num_rows
            yield batch
    except (pa.ArrowInvalid, OSError) as exc:
        raise ConfigError(
            f"{file}: not a Criteo click log (label, {NUM_INT} integers, {NUM_CAT} categoricals, "
            f"tab-separated): {exc}"
        ) from exc


def _convert(
    batch: pa.RecordBatch, cardinalities: tuple[int, ...], file: Path
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Turns one typed batch into dense, sparse and label arrays."""
    label = batch.column("label")
    if label.null_count:
        raise ConfigError(f"{file}: {label.null_count} lines have no label")
    labels = label.to_numpy().astype(np.float32)
    dense = np.empty((batch.num_rows, NUM_INT), dtype=np.float32)
    for j, name in enumerate(INT_COLUMNS):
        values = pc.fill_null(batch.column(name), 0).to_numpy()
        dense[:, j] = np.log1p(np.maximum(values, 0))
    sparse = np.empty((batch.num_rows, NUM_CAT), dtype=np.int64)
    for f, name in enumerate(CAT_COLUMNS):
        sparse[:, f] = _categorical_rows(batch.column(name), cardinalities[f])
    return dense, sparse, labels


def _categorical_rows(column: pa.Array, rows: int) -> np.ndarray:
    """Maps a categorical column to table rows; nulls to row 0."""
    # A column repeats a small vocabulary (hot values recur in most rows), so hash each distinct
    # value once and gather the result back to the rows.
    encoded = pc.dictionary_encode(column)
    row_of_value = (_hash_values(encoded.dictionary) % np.uint64(rows)).astype(np.int64)
    # Null rows get code -1, which picks the appended 0: missing values go to row 0.
    codes = pc.fill_null(encoded.indices, -1).to_numpy()
    return np.append(row_of_value, 0)[codes]


def _hash_values(values: pa.Array) -> np.ndarray:
    """Returns ``int(v, 16)`` for each value that is 1-16 hex digits, else its CRC-32, as uint64."""
    if len(values) == 0:
        return np.zeros(0, dtype=np.uint64)
    values = values.cast(pa.large_binary())
    _, offset_buffer, data_buffer = values.buffers()
    offsets = np.frombuffer(offset_buffer, dtype=np.int64)[
        values.offset : values.offset + len(values) + 1
    ]
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer else np.zeros(1, np.uint8)
    lengths = np.diff(offsets)
    # Right-align every value in a 16-digit window; the padding reads as leading zeros.
    column = np.arange(_MAX_HEX_DIGITS)
    pad = _MAX_HEX_DIGITS - lengths[:, None]
    inside = column >= pad
    positions = np.clip(offsets[:-1, None] + column - pad, 0, len(data) - 1)
    digits = np.where(inside, _HEX_VALUE[data[positions]], 0)
    valid = (lengths > 0) & (lengths <= _MAX_HEX_DIGITS) & (digits >= 0).all(axis=1)
    shifts = (4 * (_MAX_HEX_DIGITS - 1 - column)).astype(np.uint64)
    hashed = np.bitwise_or.reduce(np.maximum(digits, 0).astype(np.uint64) << shifts, axis=1)
    # Non-hex values do not occur in the public Criteo logs; hashing the few distinct ones that a
    # custom log might hold one by one keeps the common path vectorised.
    for i in np.flatnonzero(~valid):
        hashed[i] = zlib.crc32(values[i].as_py())
    return hashed
