"""Writes the golden files of ``log8``, the optimizer-state codec (run once, then commit).

As ``generate.py`` does for the row codecs, in a folder of its own (``log8_v1``): its inputs
are optimizer states (non-negative accumulators, signed moments), not embedding rows. Never
regenerate the folder; when log8's format version changes, write a new folder beside it.

Run: ``.venv/bin/python tests/golden/generate_log8.py``
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from generate import write_case  # the row codecs' generator, beside this one

from embckpt.codecs import make_codec

ROWS, COLS = 24, 16
FOLDER = "log8_v1"


def sample_states(signed: bool) -> torch.Tensor:
    """Adagrad-like accumulators over 24 octaves (or Adam-like signed moments), a zero row."""
    g = torch.Generator().manual_seed(11)
    x = torch.exp2(torch.rand(ROWS, COLS, generator=g) * 24 - 20)
    if signed:
        x *= torch.randn(ROWS, COLS, generator=g).sign()
    x[1] = 0.0
    return x


CASES = {
    "log8": ({"entropy": "none"}, False),
    "log8-signed": ({"entropy": "none"}, True),
    "log8-zstd": ({"entropy": "zstd"}, False),
}


def main() -> None:
    out = Path(__file__).parent / FOLDER
    if out.exists():
        raise SystemExit(f"{out} exists: golden files are never regenerated")
    out.mkdir()
    index = {}
    for name, (options, signed) in CASES.items():
        codec = make_codec("log8", options)
        index[name] = write_case(out, name, codec, codec.encode(sample_states(signed)), COLS)
    (out / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
