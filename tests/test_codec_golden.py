"""Golden encoded files: every codec format generation committed under tests/golden/ must keep
decoding, with today's code, to the rows it decoded to when it was written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from embckpt.codecs import codec_from_config
from embckpt.storage.rowfile_read import decode_file

GOLDEN = Path(__file__).parent / "golden"
CASES = [
    (folder.name, name, spec)
    for folder in sorted(p for p in GOLDEN.iterdir() if (p / "index.json").exists())
    for name, spec in json.loads((folder / "index.json").read_text()).items()
]


def test_every_codec_has_a_golden_file() -> None:
    from embckpt.codecs.base import _REGISTRY

    covered = {spec["codec"]["id"] for _, _, spec in CASES}
    # Other tests register throwaway codecs named test_*; every shipped codec needs a golden file.
    shipped = {codec_id for codec_id in _REGISTRY if not codec_id.startswith("test_")}
    assert covered == shipped, shipped - covered


@pytest.mark.parametrize(("folder", "name", "spec"), CASES, ids=[f"{f}/{n}" for f, n, _ in CASES])
def test_golden_file_decodes(folder: str, name: str, spec: dict) -> None:
    path = GOLDEN / folder / f"{name}.parquet"
    expected = np.load(GOLDEN / folder / f"{name}.npy")
    batch = decode_file(pa.py_buffer(path.read_bytes()), str(path), 0, len(expected))
    assert batch.header["codec"] == spec["codec"]
    decoded = codec_from_config(batch.header["codec"]).decode(batch.encoded, spec["cols"])
    scale = float(np.abs(expected).max()) or 1.0
    np.testing.assert_allclose(decoded.numpy(), expected, rtol=1e-6, atol=1e-6 * scale)
    # A row range decodes to the same rows.
    part = decode_file(pa.py_buffer(path.read_bytes()), str(path), 5, 17)
    sub = codec_from_config(part.header["codec"]).decode(part.encoded, spec["cols"])
    np.testing.assert_allclose(sub.numpy(), expected[5:17], rtol=1e-6, atol=1e-6 * scale)
