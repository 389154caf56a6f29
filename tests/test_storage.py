"""Manifest, Parquet row files, codec registry and config loading, without any model."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import torch

from embckpt.codecs import codec_from_config, make_codec
from embckpt.config import load_yaml
from embckpt.errors import CheckpointCorruptError, ConfigError, UnknownCodecError
from embckpt.examples.workload import DemoConfig
from embckpt.storage import checksum
from embckpt.storage import manifest as manifest_module
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.manifest import FileEntry, Manifest, TableEntry
from embckpt.storage.rowfile_read import decode_file
from embckpt.storage.rowfile_write import encode_file, index_file


def _manifest() -> Manifest:
    return Manifest(
        step=7,
        kind="diff",
        policy="one_shot",
        base_step=5,
        parent_step=5,
        world_size=2,
        codec={"id": "raw", "version": 1},
        tables=(
            TableEntry("t", 10, 4, "float32", "row_wise", ("momentum1",), (), ((0, 0, 0, 5, 4),)),
        ),
        files=(
            FileEntry("tables/t/r0_c0.p0.parquet", 10, "ab" * 32, "rows", 0, "t", 0, 0, 5, 4, 3),
        ),
    )


def test_manifest_round_trip_and_checksum() -> None:
    manifest = _manifest()
    assert Manifest.from_json(manifest.to_json(), "m") == manifest
    edited = manifest.to_json().replace('"world_size": 2', '"world_size": 3')
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        Manifest.from_json(edited, "some/MANIFEST.json")
    body = json.loads(manifest.to_json())
    body["format_version"] = 99
    with pytest.raises(CheckpointCorruptError):
        Manifest.from_json(json.dumps(body), "m")


def test_store_writes_atomically_and_checks_reads(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpts")
    written = store.write_file(3, "dense/x.bin", b"hello world")
    assert store.read_checked(3, written).to_pybytes() == b"hello world"
    assert store.leftover_steps() == [3] and store.committed_steps() == []
    assert not list((tmp_path / "ckpts").rglob("*.tmp-*"))
    path = Path(store.step_path(3, "dense/x.bin"))
    path.write_bytes(b"hello_world")
    with pytest.raises(CheckpointCorruptError, match=r"x\.bin: CRC32C"):
        store.read_checked(3, written)
    path.unlink()
    with pytest.raises(CheckpointCorruptError, match=r"x\.bin: cannot read"):
        store.read_checked(3, written)


def test_crc32c_combine_equals_one_pass() -> None:
    rng = np.random.default_rng(0)
    for len_a, len_b in ((0, 0), (5, 0), (0, 7), (1, 1), (4, 100_000), (3000, 12_345)):
        a, b = rng.bytes(len_a), rng.bytes(len_b)
        combined = checksum.combine(checksum.crc32c(a), checksum.crc32c(b), len(b))
        assert combined == checksum.crc32c(a + b) == google_crc32c.value(a + b)


def _rows_file() -> bytes:
    codec = make_codec("raw")
    return encode_file(
        rows=np.arange(0, 900, 3),
        encoded=codec.encode(torch.randn(300, 4)),
        row_states={"m": np.arange(300, dtype=np.float32)},
        elem_states={},
        metadata={"codec": codec.get_config()},
        row_group_rows=50,
    )


def test_index_gives_the_whole_files_crc_and_every_byte_counts(tmp_path: Path) -> None:
    data = _rows_file()
    index = index_file(data)
    assert len(index.row_groups) == 6
    # The file checksum combined from the pieces is the CRC32C an object store computes.
    assert index.file_checksum == f"crc32c:{google_crc32c.value(data.to_pybytes()):08x}"
    store = CheckpointStore(tmp_path)
    written = store.write_file(1, "tables/t/f.parquet", data, index.file_checksum)
    assert store.read_checked(1, written).to_pybytes() == data.to_pybytes()
    path = Path(store.step_path(1, written.path))
    good = path.read_bytes()
    footer_length = len(good) - 8
    # The leading magic, a row group, the footer, its length and the closing magic.
    for position in (
        0,
        3,
        4,
        index.row_groups[3].offset + 7,
        index.footer_offset,
        footer_length,
        len(good) - 1,
    ):
        damaged = bytearray(good)
        damaged[position] ^= 0x10
        path.write_bytes(bytes(damaged))
        with pytest.raises(CheckpointCorruptError, match=r"f\.parquet: CRC32C does not match"):
            store.read_checked(1, written)


def test_sha256_entries_still_check_and_unknown_checksums_are_errors(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    written = store.write_file(1, "dense/x.bin", b"old", hashlib.sha256(b"old").hexdigest())
    assert store.read_checked(1, written).to_pybytes() == b"old"
    Path(store.step_path(1, "dense/x.bin")).write_bytes(b"olD")
    with pytest.raises(CheckpointCorruptError, match=r"x\.bin: SHA-256 does not match"):
        store.read_checked(1, written)
    with pytest.raises(CheckpointCorruptError, match="unknown checksum 'md5:00'"):
        store.read_checked(1, dataclasses.replace(written, checksum="md5:00"))


def test_manifest_names_its_checksum_algorithm_and_reads_format_1_keys() -> None:
    manifest = _manifest()
    body = json.loads(manifest.to_json())
    assert body["checksum_algorithm"] == "crc32c" and body["format_version"] == 5
    assert "checksum" in body["files"][0] and "sha256" not in body["files"][0]
    # A format-1 manifest: no algorithm field, SHA-256 under the old keys.
    del body["checksum"], body["checksum_algorithm"]
    body["format_version"] = 1
    entry = body["files"][0]
    entry["sha256"] = entry.pop("checksum")
    entry["index"] = {
        "file_sha256": entry["sha256"],
        "footer_offset": 4,
        "footer_sha256": "cd" * 32,
        "row_groups": [
            {
                "first_row": 0,
                "last_row": 3,
                "rows": 2,
                "offset": 4,
                "length": 0,
                "sha256": "ef" * 32,
            }
        ],
    }
    body["checksum"] = manifest_module._checksum(body)
    old = Manifest.from_json(json.dumps(body), "m")
    assert old.checksum_algorithm == "sha256" and old.files[0].checksum == "ab" * 32
    index = old.files[0].partial_index
    assert index is not None and index.footer_checksum == "cd" * 32
    assert index.row_groups[0].checksum == "ef" * 32
    body["checksum_algorithm"] = "md5"
    body["checksum"] = manifest_module._checksum({k: v for k, v in body.items() if k != "checksum"})
    with pytest.raises(CheckpointCorruptError, match="checksum algorithm 'md5'"):
        Manifest.from_json(json.dumps(body), "m")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_row_file_round_trip_and_row_range(dtype: torch.dtype) -> None:
    codec = make_codec("raw")
    rows = np.arange(100, 400, 3, dtype=np.int64)
    weights = torch.randn(len(rows), 6).to(dtype)
    momentum = np.random.rand(len(rows)).astype(np.float32)
    data = encode_file(
        rows, codec.encode(weights), {"momentum1": momentum}, {}, {"codec": codec.get_config()}, 16
    )
    batch = decode_file(data, "f.parquet", 200, 300)
    keep = (rows >= 200) & (rows < 300)
    assert np.array_equal(batch.rows, rows[keep])
    decoded = codec_from_config(batch.header["codec"]).decode(batch.encoded, 6)
    assert decoded.dtype == dtype and torch.equal(decoded, weights[torch.from_numpy(keep)])
    assert np.array_equal(batch.row_states["momentum1"], momentum[keep])


def test_garbage_is_not_a_row_file() -> None:
    import pyarrow as pa

    with pytest.raises(CheckpointCorruptError, match="bad.parquet"):
        decode_file(pa.py_buffer(b"PAR1 nonsense PAR1"), "bad.parquet", 0, 10)


def test_unknown_codec_and_newer_version_are_refused() -> None:
    with pytest.raises(UnknownCodecError, match="unknown codec 'zzz'"):
        make_codec("zzz")
    with pytest.raises(UnknownCodecError, match="newer"):
        codec_from_config({"id": "raw", "version": 3})


def test_demo_config_loads_and_unknown_keys_fail(tmp_path: Path) -> None:
    config = load_yaml(Path(__file__).parents[1] / "configs" / "demo.yaml", DemoConfig)
    assert config.workload.sharding["t_cat_2"] == "column_wise"
    bad = tmp_path / "bad.yaml"
    bad.write_text("checkpoint:\n  polcy: full\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml\.checkpoint: unknown keys \['polcy'\]"):
        load_yaml(bad, DemoConfig)


def test_an_object_store_looks_up_its_step_manifests_together(tmp_path: Path) -> None:
    """On an object store each manifest lookup is a request: a store's scan of its step
    folders sends them together (a job keeps every checkpoint by default), and still tells
    committed steps from leftovers; a save's check looks up only its step's folder and newer
    ones (``prepare_step_folder``)."""
    import threading
    import time

    import pyarrow.fs as pafs
    from faultfs import FaultyHandler

    from embckpt.save.decide import prepare_step_folder
    from embckpt.storage.layout import MANIFEST_NAME

    class SlowLooks(FaultyHandler):
        """Each manifest lookup takes 50 ms, as a request to a remote store would."""

        def __init__(self) -> None:
            super().__init__()
            self.busy = self.most = self.looks = 0
            self.guard = threading.Lock()

        def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
            if not any(p.endswith(MANIFEST_NAME) for p in paths):
                return super().get_file_info(paths)
            with self.guard:
                self.busy += 1
                self.most = max(self.most, self.busy)
                self.looks += 1
            time.sleep(0.05)
            with self.guard:
                self.busy -= 1
            return super().get_file_info(paths)

    handler = SlowLooks()
    store = CheckpointStore(str(tmp_path / "ckpts"), filesystem=pafs.PyFileSystem(handler))
    assert not store.is_local
    committed = [s for s in range(1, 13) if s % 3]
    for step in range(1, 13):
        store.write_file(step, "dense/x.bin", b"x")
        if step in committed:
            store.write_file(step, MANIFEST_NAME, b"{}")
    assert store.committed_steps() == committed
    assert store.leftover_steps() == [3, 6, 9, 12]
    assert handler.most > 1  # the lookups overlapped
    handler.looks = 0
    assert prepare_step_folder(store, 12) is None  # a leftover of the newest step: cleared
    assert handler.looks == 2  # its folder, then remove_step's own check; not the 11 older
    assert store.leftover_steps() == [3, 6, 9]
    handler.looks = 0
    assert store.committed_after(9) == [10, 11] and handler.looks == 2  # 12 was cleared
    refused = prepare_step_folder(store, 11)
    assert refused is not None and "already exists" in refused
    refused = prepare_step_folder(store, 9)
    assert refused is not None and "newer checkpoints (steps 10, 11)" in refused
