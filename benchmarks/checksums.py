"""Checksum cost per byte of a rows file, before (SHA-256) and after (CRC32C), write and read.

Write side, before: SHA-256 of the whole file (``CheckpointStore.write_file``) and again of
every row group and the footer (``index_file``): two passes. After: ``index_file``'s CRC32C of
the row groups and footer, combined into the file's: one pass. Read side: a whole-file check
(``read_checked``, ``verify``); partial reads check the same bytes piece by piece.

The file is a 64-column fp32 rows file of ``--rows`` rows (about 256 bytes a row), written
once; each variant is timed ``--reps`` times, best kept, as CPU time of the measuring thread
(``time.thread_time``: other work on the shared machine does not count) and as wall time.
Writes ``benchmarks/results/checksums.json``.

Run: ``.venv/bin/python benchmarks/checksums.py [--rows 262144]``
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

from common import write_result  # noqa: E402

from embckpt.codecs import make_codec  # noqa: E402
from embckpt.storage import checksum  # noqa: E402
from embckpt.storage.rowfile_write import encode_file, index_file  # noqa: E402


def _best(fn: Any, reps: int) -> tuple[float, float]:
    fn()
    cpu, wall = float("inf"), float("inf")
    for _ in range(reps):
        w, c = time.perf_counter(), time.thread_time()
        fn()
        cpu, wall = min(cpu, time.thread_time() - c), min(wall, time.perf_counter() - w)
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=262144)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    codec = make_codec("raw", {"entropy": "none"})
    data = encode_file(
        rows=np.arange(args.rows, dtype=np.int64),
        encoded=codec.encode(torch.randn(args.rows, 64)),
        row_states={},
        elem_states={},
        metadata={"codec": codec.get_config()},
        row_group_rows=65536,
    )
    index = index_file(data)
    pieces = [data.slice(g.offset, g.length) for g in index.row_groups]
    pieces.append(data.slice(index.footer_offset))

    def sha_write() -> None:
        hashlib.sha256(memoryview(data)).hexdigest()
        for piece in pieces:
            hashlib.sha256(memoryview(piece)).hexdigest()

    variants = {
        "write_before_sha256_two_passes": sha_write,
        "write_after_crc32c_index_file": lambda: index_file(data),
        "read_before_sha256": lambda: hashlib.sha256(memoryview(data)).hexdigest(),
        "read_after_crc32c": lambda: checksum.matches(data, index.file_checksum),
    }
    results: dict[str, Any] = {"file_bytes": data.size, "row_groups": len(index.row_groups)}
    for name, fn in variants.items():
        cpu, wall = _best(fn, args.reps)
        results[name] = {
            "cpu_ms_per_gb": round(cpu / data.size * 1e12, 1),
            "cpu_gb_per_s": round(data.size / cpu / 1e9, 2),
            "wall_gb_per_s": round(data.size / wall / 1e9, 2),
        }
        print(name, results[name])
    print("written to", write_result("checksums", results))


if __name__ == "__main__":
    main()
