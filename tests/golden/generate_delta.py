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

import torch
from generate import write_case  # the row codecs' generator, beside this one

from embckpt.codecs import DeltaCodec, make_codec

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
        index[name] = write_case(out, name, codec, encoded, COLS)
        index[name]["widths"] = encoded.metadata["widths"]
    (out / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
