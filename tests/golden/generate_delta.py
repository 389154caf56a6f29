"""Writes the golden files of ``delta``, the per-row-width diff codec (run once, then commit).

As ``generate.py`` does for the whole-row codecs, in a folder of its own (``delta_v1``): each
file holds the changes of 24 rows against a reference, chosen so that every width appears
(none, 2, 3, 4 and 8 bits, fp32); the ``.npy`` holds the decoded changes. Never regenerate the
folder; when delta's format version changes, write a new folder beside it.

Run: ``.venv/bin/python tests/golden/generate_delta.py``
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from embckpt.codecs import DeltaCodec, make_codec
from embckpt.storage.shardfile import encode_file

ROWS, COLS = 24, 16
FOLDER = "delta_v1"


def rows_and_reference() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows, and a reference at growing distances from them (row 0 equal, the last rows far)."""
    g = torch.Generator().manual_seed(5)
    live = torch.randn(ROWS, COLS, generator=g) * 0.3
    distance = torch.logspace(-4, 0.5, ROWS)[:, None]
    reference = live + torch.randn(ROWS, COLS, generator=g) * distance
    reference[0] = live[0]
    live[-1] = 0.125  # a constant row: its whole-row code is exact, so its change is stored whole
    return live, reference


CASES = {
    "delta-adaptive-4": ({"inner": {"id": "adaptive", "bits": 4}, "entropy": "zstd"}),
    "delta-asymmetric-2": ({"inner": {"id": "asymmetric", "bits": 2}, "entropy": "none"}),
}


def main() -> None:
    out = Path(__file__).parent / FOLDER
    if out.exists():
        raise SystemExit(f"{out} exists: golden files are never regenerated")
    out.mkdir()
    index = {}
    live, reference = rows_and_reference()
    for name, options in CASES.items():
        inner = make_codec(options["inner"]["id"], {"bits": options["inner"]["bits"]})
        codec = DeltaCodec(inner.get_config(), options["entropy"])
        encoded = codec.encode_delta(live, reference)
        data = encode_file(
            rows=np.arange(ROWS, dtype=np.int64),
            encoded=encoded,
            row_states={},
            elem_states={},
            metadata={"codec": codec.get_config()},
            row_group_rows=8,
        )
        (out / f"{name}.parquet").write_bytes(data.to_pybytes())
        np.save(out / f"{name}.npy", codec.decode(encoded, COLS).numpy())
        index[name] = {
            "codec": codec.get_config(),
            "cols": COLS,
            "widths": encoded.metadata["widths"],
        }
    (out / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
