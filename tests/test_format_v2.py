"""Format 2 written over format 1: a merge of a version-1 chain (SHA-256 checksums, binary
float payloads) writes a version-2 manifest and CRC32C rows files (whose copied payloads keep
their codec's version-1 layout) beside the head's dense files and their SHA-256, kept as they
were; it verifies and restores the same state."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from embckpt.read.export import reconstruct
from embckpt.read.merge import merge
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.layout import MANIFEST_NAME
from embckpt.storage.verify import verify

FIXTURE = Path(__file__).parent / "fixtures" / "v1" / "raw_one_shot"
LAST = 15


def _state(directory: Path) -> dict[str, torch.Tensor]:
    rebuilt = reconstruct(directory, LAST, threads=1)
    return {**rebuilt.tables, **{f"dense:{k}": v for k, v in rebuilt.dense.items()}}


def test_merging_a_format_1_chain_writes_format_2(tmp_path: Path) -> None:
    directory = tmp_path / "raw_one_shot"
    shutil.copytree(FIXTURE, directory)
    before = _state(directory)
    head = json.loads((directory / f"step_{LAST:012d}" / MANIFEST_NAME).read_text())
    assert head["format_version"] == 1 and "checksum_algorithm" not in head
    merged = merge(CheckpointStore(directory), LAST)
    assert merged.format_version == 2 and merged.checksum_algorithm == "crc32c"
    rows = [f for f in merged.files if f.role == "rows"]
    kept = [f for f in merged.files if f.role != "rows"]
    assert rows and kept
    assert all(f.checksum.startswith("crc32c:") for f in rows)
    assert {f.checksum for f in kept} <= {f["sha256"] for f in head["files"]}
    # Copied rows keep their codec's own format (a file's metadata is authoritative).
    first = directory / f"step_{LAST:012d}" / rows[0].path
    assert pq.read_schema(first).field("payload").type.id == pa.binary(16).id
    report = verify(CheckpointStore(directory))
    assert report.ok, report.problems
    after = _state(directory)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
