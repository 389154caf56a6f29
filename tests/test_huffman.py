"""The compiled Huffman kernels write the bytes the numpy implementation they replaced wrote
(checkpoints written before and after compare byte for byte), and decode them back."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from embckpt.codecs import huffman as hm
from embckpt.codecs import huffman_kernels
from embckpt.codecs.common import float_tables, param_tables
from embckpt.errors import CodecError

#: sha256 (first 16 hex digits) of tables, offsets and buffer of every case below, as the numpy
#: implementation (one vectorised pass per byte-column pair) encoded them.
NUMPY_DIGESTS = {
    "uniform_w1": "df662c35f7a8f50d",
    "geometric_w1": "339ced3a032c0662",
    "uniform_w2": "6390f4fa6ad6dc1b",
    "geometric_w2": "80b6a38e22047fec",
    "uniform_w3": "0e497be83cdceb7e",
    "geometric_w3": "64f553625b3bd852",
    "uniform_w4": "099f88cdbd49d24b",
    "geometric_w4": "2b531b5c980bd4ef",
    "uniform_w5": "26c02e9ec3486c5f",
    "geometric_w5": "929a9a9660c67462",
    "uniform_w7": "748434a82b9796e2",
    "geometric_w7": "eb4ce5d31b68066a",
    "uniform_w17": "48e0a24589baf2e3",
    "geometric_w17": "39e918312cf0411c",
    "uniform_w64": "42c6b9a8d3786920",
    "geometric_w64": "c82ba4530c02efb1",
    "params_16_4": "8ecffda0d3afc3c0",
    "params_24_4": "12da3fbda72f3000",
    "params_32_4": "81506bafd3d2ea83",
    "params_64_4": "2b4b20aec045655e",
    "params_33_2": "12377a123e514be0",
    "floats16_1": "21612ad240fd7290",
    "floats32_1": "5901340d671f2d02",
    "floats16_3": "25ef4f9b0604e853",
    "floats32_3": "eaf046c17cf9f7fb",
    "floats16_64": "baf3614850d24bab",
    "floats32_64": "eecbde57eed62397",
    "long_codes": "1092b43cd4a9d189",
    "sampled": "905e81f0ea86e1ba",
    "empty_rows": "e382159148ff4e6d",
}


def _cases() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Rows and column tables of every group layout the codecs use: one table (log8,
    exponent), packed codes then per-row parameters (uniform, k-means), one table per float
    byte position (floats); random and trained-like (Gaussian codes, fp16/fp32 values) bytes."""
    rng = np.random.default_rng(1234)
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for width in (1, 2, 3, 4, 5, 7, 17, 64):
        one = np.zeros(width, np.int64)
        out[f"uniform_w{width}"] = (rng.integers(0, 256, (257, width)).astype(np.uint8), one)
        geometric = np.minimum(rng.geometric(0.15, (257, width)) - 1, 255).astype(np.uint8)
        out[f"geometric_w{width}"] = (geometric, one)
    for code_bytes, params in ((16, 4), (24, 4), (32, 4), (64, 4), (33, 2)):
        codes = np.clip(np.rint(rng.normal(128, 20, (513, code_bytes))), 0, 255).astype(np.uint8)
        scales = rng.normal(0, 0.05, (513, params // 2)).astype(np.float16).view(np.uint8)
        rows = np.ascontiguousarray(np.concatenate([codes, scales], 1))
        out[f"params_{code_bytes}_{params}"] = (rows, param_tables(code_bytes, params))
    for cols in (1, 3, 64):
        half = rng.normal(0, 0.05, (301, cols)).astype(np.float16).view(np.uint8)
        out[f"floats16_{cols}"] = (np.ascontiguousarray(half), float_tables(2 * cols, 2))
        single = rng.normal(0, 0.05, (301, cols)).astype(np.float32).view(np.uint8)
        out[f"floats32_{cols}"] = (np.ascontiguousarray(single), float_tables(4 * cols, 4))
    # A steep distribution and rows of its rarest symbols only: four 12-bit codes per window.
    steep = np.minimum(rng.geometric(0.5, (4000, 40)) - 1, 29).astype(np.uint8)
    rare = np.tile(np.arange(12, 18, dtype=np.uint8), (3, 7))[:, :40]
    out["long_codes"] = (
        np.ascontiguousarray(np.concatenate([steep, rare])),
        np.zeros(40, np.int64),
    )
    # Over the histogram sample threshold (1 MB): tables from a row sample.
    big = np.minimum(rng.geometric(0.1, (20000, 68)) - 1, 255).astype(np.uint8)
    out["sampled"] = (big, param_tables(64, 4))
    out["empty_rows"] = (np.zeros((0, 5), np.uint8), np.zeros(5, np.int64))
    return out


CASES = _cases()


def _tables(data: np.ndarray, columns: np.ndarray) -> list[str]:
    return hm.TableCache().tables_for(data, columns) if len(data) else ["1" + "0" * 255]


def _reference(data: np.ndarray, tables: list[str], columns: np.ndarray) -> bytes:
    """The format by its definition, one row and one code at a time: canonical codes, bit
    reversed, least significant bit first, each row padded to whole bytes."""
    codes = [hm._canonical_reversed(hm.lengths_from_hex(t)) for t in tables]
    lengths = [hm.lengths_from_hex(t) for t in tables]
    out = bytearray()
    for row in data.tolist():
        acc, bits = 0, 0
        for value, t in zip(row, columns.tolist(), strict=True):
            acc |= int(codes[t][value]) << bits
            bits += int(lengths[t][value])
        out += acc.to_bytes((bits + 7) // 8, "little")
    return bytes(out)


@pytest.mark.parametrize("name", sorted(CASES))
def test_encode_matches_numpy_bytes_and_round_trips(name: str) -> None:
    data, columns = CASES[name]
    tables = _tables(data, columns)
    offsets, buffer = hm.encode_rows(data, tables, columns)
    digest = hashlib.sha256(
        json.dumps(tables).encode() + offsets.astype(np.int64).tobytes() + buffer.tobytes()
    ).hexdigest()[:16]
    assert digest == NUMPY_DIGESTS[name]
    assert np.array_equal(hm.decode_rows(buffer, offsets, tables, columns), data)
    # A row range of the column, as a row-group read sees it (rows near the end included).
    lo, hi = len(data) // 3, len(data) - 1
    if hi > lo:
        part = hm.decode_rows(buffer, offsets[lo : hi + 1], tables, columns)
        assert np.array_equal(part, data[lo:hi])


@pytest.mark.parametrize("name", ["geometric_w7", "params_33_2", "floats32_3", "long_codes"])
def test_encode_matches_the_format_definition(name: str) -> None:
    data, columns = CASES[name]
    data = data[:200]
    tables = _tables(data, columns)
    offsets, buffer = hm.encode_rows(data, tables, columns)
    assert buffer.tobytes() == _reference(data, tables, columns)
    sizes = [len(_reference(data[r : r + 1], tables, columns)) for r in range(len(data))]
    assert np.array_equal(np.diff(offsets), sizes)


def test_decode_reads_only_its_rows_bytes() -> None:
    """Rows at the end of an exactly sized buffer, and rows in the middle of a larger one,
    decode alike (the kernel reads eight bytes at a time)."""
    data, columns = CASES["geometric_w17"]
    tables = _tables(data, columns)
    offsets, buffer = hm.encode_rows(data, tables, columns)
    exact = np.frombuffer(buffer.tobytes(), dtype=np.uint8)  # no slack behind the last row
    for lo, hi in ((0, len(data)), (len(data) - 5, len(data)), (3, 4), (0, 1)):
        part = hm.decode_rows(exact, offsets[lo : hi + 1], tables, columns)
        assert np.array_equal(part, data[lo:hi])


def test_encode_rejects_uncodable_bytes() -> None:
    data = np.array([[1, 2, 3]], dtype=np.uint8)
    only_one = "1" + "0" * 255  # a table with a code for byte 0 alone
    with pytest.raises(CodecError, match="no code"):
        hm.encode_rows(data, [only_one], np.zeros(3, np.int64))


def test_decode_rejects_truncated_and_invalid_rows() -> None:
    data, columns = CASES["geometric_w17"]
    tables = _tables(data, columns)
    offsets, buffer = hm.encode_rows(data, tables, columns)
    short = offsets.copy()
    short[1:] -= 1  # the first row a byte short (the others shifted by one)
    with pytest.raises(CodecError, match="truncated"):
        hm.decode_rows(buffer, short, tables, columns)
    with pytest.raises(CodecError, match="outside"):
        hm.decode_rows(buffer[:-1], offsets, tables, columns)
    # A table with one code ("0" for byte 0): bits 1 start no code.
    ones = np.full(4, 0xFF, dtype=np.uint8)
    with pytest.raises(CodecError, match="no code"):
        hm.decode_rows(ones, np.array([0, 4]), ["1" + "0" * 255], np.zeros(3, np.int64))


def test_histogram_kernel_counts_like_bincount() -> None:
    data, columns = CASES["params_33_2"]
    counts = np.zeros((int(columns.max()) + 1, 256), dtype=np.int64)
    huffman_kernels.histograms(data, 3, columns, counts)
    index = data[::3].astype(np.int64) + columns * 256
    expected = np.bincount(index.ravel(), minlength=counts.size).reshape(counts.shape)
    assert np.array_equal(counts, expected)
