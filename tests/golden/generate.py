"""Writes the golden encoded files of one codec format generation (run once, then commit).

Each case is a small Parquet row file written by ``storage.rowfile_write.encode_file`` with today's
encoder, plus the rows it must decode to (``.npy``) and ``index.json`` naming the cases. The
test (tests/test_codec_golden.py) decodes every file with the current code and compares: a
change that breaks reading files already on disk fails it. Never regenerate an existing
generation's folder; when a codec's format version changes, write a new folder beside it.

Run: ``.venv/bin/python tests/golden/generate.py codecs_v1``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from embckpt.codecs import Codec, EncodedRows, make_codec
from embckpt.storage.rowfile_write import encode_file

ROWS, COLS = 24, 16

CASES: dict[str, tuple[str, dict]] = {
    "raw": ("raw", {}),
    "raw-huffman": ("raw", {"entropy": "huffman"}),
    "fp16": ("fp16", {"entropy": "none"}),
    "bf16-zstd": ("bf16", {"entropy": "zstd"}),
    **{f"symmetric-{b}": ("symmetric", {"bits": b, "entropy": "none"}) for b in (2, 3, 4, 8)},
    **{f"asymmetric-{b}": ("asymmetric", {"bits": b, "entropy": "none"}) for b in (2, 3, 4, 8)},
    "asymmetric-4-huffman": ("asymmetric", {"bits": 4, "entropy": "huffman"}),
    "asymmetric-4-zstd": ("asymmetric", {"bits": 4, "entropy": "zstd"}),
    "asymmetric-4-lz4": ("asymmetric", {"bits": 4, "entropy": "lz4"}),
    "asymmetric-4-fp32params": ("asymmetric", {"bits": 4, "param_dtype": "float32"}),
    "symmetric-3-fp32params": ("symmetric", {"bits": 3, "param_dtype": "float32"}),
    **{f"adaptive-{b}": ("adaptive", {"bits": b, "entropy": "none"}) for b in (2, 3, 4, 8)},
    **{f"kmeans-{b}": ("kmeans", {"bits": b, "entropy": "none"}) for b in (2, 3, 4, 8)},
    **{f"exponent-{b}": ("exponent", {"bits": b, "entropy": "huffman"}) for b in (2, 3, 4, 8)},
    "exponent-2-zstd": ("exponent", {"bits": 2, "entropy": "zstd"}),
}


def sample_rows(delta: bool) -> torch.Tensor:
    """Embedding-like rows (or training deltas), with a zero row and a constant row."""
    g = torch.Generator().manual_seed(7)
    scale = 0.003 if delta else 0.08
    x = torch.randn(ROWS, COLS, generator=g) * torch.rand(ROWS, 1, generator=g) * scale
    x[1] = 0.0
    x[2] = 0.125
    return x


def main(folder: str) -> None:
    out = Path(__file__).parent / folder
    if out.exists():
        raise SystemExit(f"{out} exists: golden files are never regenerated")
    out.mkdir()
    index = {}
    for name, (codec_id, options) in CASES.items():
        codec = make_codec(codec_id, options)
        rows = sample_rows(delta=codec.additive)
        index[name] = write_case(out, name, codec, codec.encode(rows), COLS)
    (out / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")


def write_case(out: Path, name: str, codec: Codec, encoded: EncodedRows, cols: int) -> dict:
    """Writes one golden case, ``<name>.parquet`` (the rows file, row ids 0..n-1) and
    ``<name>.npy`` (what it decodes to), and returns its entry in ``index.json``."""
    n = len(next(iter(encoded.columns.values())))
    data = encode_file(
        rows=np.arange(n, dtype=np.int64),
        encoded=encoded,
        row_states={},
        elem_states={},
        metadata={"codec": codec.get_config()},
        row_group_rows=8,
    )
    (out / f"{name}.parquet").write_bytes(data.to_pybytes())
    np.save(out / f"{name}.npy", codec.decode(encoded, cols).numpy())
    return {"codec": codec.get_config(), "cols": cols}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "codecs_v1")
