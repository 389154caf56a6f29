"""Manifest, Parquet row files, codec registry and config loading, without any model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from embckpt.codecs import codec_from_config, make_codec
from embckpt.config import load_yaml
from embckpt.errors import CheckpointCorruptError, ConfigError, UnknownCodecError
from embckpt.examples.workload import DemoConfig
from embckpt.storage.fs import CheckpointStore
from embckpt.storage.manifest import FileEntry, Manifest, TableEntry
from embckpt.storage.shardfile import decode_file, encode_file


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
    with pytest.raises(CheckpointCorruptError, match=r"x\.bin: SHA-256"):
        store.read_checked(3, written)
    path.unlink()
    with pytest.raises(CheckpointCorruptError, match=r"x\.bin: cannot read"):
        store.read_checked(3, written)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_row_file_round_trip_and_row_range(dtype: torch.dtype) -> None:
    codec = make_codec("raw")
    rows = np.arange(100, 400, 3, dtype=np.int64)
    weights = torch.randn(len(rows), 6).to(dtype)
    momentum = np.random.rand(len(rows)).astype(np.float32)
    data = encode_file(
        rows, codec.encode(weights), {"momentum1": momentum}, {}, {"codec": codec.get_config()}, 16
    )
    block = decode_file(data, "f.parquet", 200, 300)
    keep = (rows >= 200) & (rows < 300)
    assert np.array_equal(block.rows, rows[keep])
    decoded = codec_from_config(block.metadata["codec"]).decode(block.encoded, 6)
    assert decoded.dtype == dtype and torch.equal(decoded, weights[torch.from_numpy(keep)])
    assert np.array_equal(block.row_states["momentum1"], momentum[keep])


def test_garbage_is_not_a_row_file() -> None:
    import pyarrow as pa

    with pytest.raises(CheckpointCorruptError, match="bad.parquet"):
        decode_file(pa.py_buffer(b"PAR1 nonsense PAR1"), "bad.parquet", 0, 10)


def test_unknown_codec_and_newer_version_are_refused() -> None:
    with pytest.raises(UnknownCodecError, match="unknown codec 'zzz'"):
        make_codec("zzz")
    with pytest.raises(UnknownCodecError, match="newer"):
        codec_from_config({"id": "raw", "version": 2})


def test_demo_config_loads_and_unknown_keys_fail(tmp_path: Path) -> None:
    config = load_yaml(Path(__file__).parents[1] / "configs" / "demo.yaml", DemoConfig)
    assert config.workload.sharding["t_cat_2"] == "column_wise"
    bad = tmp_path / "bad.yaml"
    bad.write_text("checkpoint:\n  polcy: full\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml\.checkpoint: unknown keys \['polcy'\]"):
        load_yaml(bad, DemoConfig)
