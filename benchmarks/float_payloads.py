"""Float payloads on disk: format 1 (row bytes in a binary column) against format 2 (Parquet
float lists, BYTE_STREAM_SPLIT), for ``raw``, ``fp16`` and ``bf16``, on trained rows.

The rows are the trained 64-dim rows ``benchmarks/codecs.py`` caches (run it first, or point
``--cache`` at its cache). For each layout and entropy stage: bytes per row
of the whole Parquet file (row ids, footer and all), and file encode / decode speed (fp32 bytes
per second through ``encode_file`` + ``codec.encode``, ``decode_file`` + ``codec.decode``),
as process CPU time (Arrow and torch on one thread; other work on the shared machine does not
count) and as wall time, best of ``--reps``. Format-1 files of the ``none`` and ``zstd``
stages are built as that version wrote them; its ``huffman`` layout is unchanged in format 2.
Writes ``benchmarks/results/float_payloads.json``.

Run: ``.venv/bin/python benchmarks/float_payloads.py [--rows 131072]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

sys.path.insert(0, str(Path(__file__).parent))

from common import write_result  # noqa: E402

from embckpt.codecs import make_codec  # noqa: E402
from embckpt.codecs.base import EncodedRows, fixed_binary_column  # noqa: E402
from embckpt.storage.rowfile_read import decode_file  # noqa: E402
from embckpt.storage.rowfile_write import encode_file  # noqa: E402

ROW_GROUP = 65536
HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _format1(codec_id: str, entropy: str, rows: torch.Tensor) -> EncodedRows:
    """What format 1 wrote for the ``none`` and ``zstd`` stages: bytes in a binary column."""
    values = rows if codec_id == "raw" else rows.to(HALF[codec_id])
    payload = values.contiguous().view(torch.uint8).numpy().reshape(len(rows), -1)
    meta: dict[str, Any] = {"entropy": entropy}
    if codec_id == "raw":
        meta = {"dtype": "float32"} if entropy == "none" else {**meta, "dtype": "float32"}
    hint = {"payload": entropy} if entropy == "zstd" else {}
    return EncodedRows({"payload": fixed_binary_column(payload)}, meta, hint)


def _best(fn: Any, reps: int) -> tuple[Any, float, float]:
    result = fn()
    cpu, wall = float("inf"), float("inf")
    for _ in range(reps):
        w, c = time.perf_counter(), time.process_time()
        result = fn()
        cpu, wall = min(cpu, time.process_time() - c), min(wall, time.perf_counter() - w)
    return result, cpu, wall


def measure(codec_id: str, entropy: str, fmt: int, rows: torch.Tensor, reps: int) -> dict:
    codec = make_codec(codec_id, {"entropy": entropy})
    n, cols = rows.shape
    ids = np.arange(n, dtype=np.int64)
    config = {**codec.get_config(), "version": fmt}

    def write() -> pa.Buffer:
        encoded = (
            _format1(codec_id, entropy, rows)
            if fmt == 1 and entropy != "huffman"
            else codec.encode(rows)
        )
        return encode_file(ids, encoded, {}, {}, {"codec": config}, ROW_GROUP)

    data, enc_cpu, enc_wall = _best(write, reps)

    def read() -> torch.Tensor:
        return codec.decode(decode_file(data, "bench", 0, n).encoded, cols)

    decoded, dec_cpu, dec_wall = _best(read, reps)
    exact = rows.to(HALF[codec_id]).float() if codec_id in HALF else rows
    assert torch.equal(decoded.float(), exact), (codec_id, entropy, fmt)
    fp32 = rows.numel() * 4 / 1e9
    return {
        "codec": codec_id,
        "entropy": entropy,
        "format": fmt,
        "disk_bytes_per_row": round(data.size / n, 2),
        "encode_cpu_gbps": round(fp32 / enc_cpu, 3),
        "decode_cpu_gbps": round(fp32 / dec_cpu, 3),
        "encode_wall_gbps": round(fp32 / enc_wall, 3),
        "decode_wall_gbps": round(fp32 / dec_wall, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=131072)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cache", default="/tmp/embckpt_codec_bench_tables.npz")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    if not Path(args.cache).exists():
        raise SystemExit(f"{args.cache}: no trained rows; run benchmarks/codecs.py first")
    with np.load(args.cache) as tables:
        final = tables["final"]
    rows = torch.from_numpy(np.ascontiguousarray(final[: args.rows]))
    results = []
    for codec_id in ("raw", "fp16", "bf16"):
        for fmt, stages in ((1, ("none", "zstd", "huffman")), (2, ("none", "zstd", "lz4"))):
            for entropy in stages:
                result = measure(codec_id, entropy, fmt, rows, args.reps)
                print(result)
                results.append(result)
    print("written to", write_result("float_payloads", {"rows": len(rows), "results": results}))


if __name__ == "__main__":
    main()
