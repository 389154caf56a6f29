"""Compiles every numba kernel of the codecs once, ahead of their first use.

Why: numba compiles a kernel at its first call and keeps the machine code in its disk cache
(``cache=True``, in ``__pycache__`` beside the source). Compiling the quantizing codecs'
kernels from a cold cache costs minutes of CPU (about a minute each for the adaptive range
search and the uniform quantizer on a 2-core machine), and every process that finds the cache
cold compiles them on its own: each rank of a demo at its first save, each test process at its
first encode. ``scripts/setup.sh`` runs this module once after installing embckpt
(``python -m embckpt.codecs.precompile``), so that the first demo and the first test run find
the cache warm. A process that finds the cache warm loads a kernel in milliseconds.

The work is split by kernel, so that no two processes compile the same one, and the parts run
in parallel processes (numba holds the GIL while it compiles). Each part calls the codecs
through their public API with small batches of the dtypes and layouts real rows have, which
compiles exactly the signatures checkpoints use (tests/test_precompile.py checks that every
kernel the codecs call is compiled by a part).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import time
from collections.abc import Callable

import numpy as np
import torch

from embckpt.codecs import delta_kernels, make_codec, row_kernels
from embckpt.codecs.delta import DeltaCodec
from embckpt.errors import import_extra

_ROWS, _COLS = 257, 16  # an odd row count: the tail paths of the packing loops too
_BITS = (2, 3, 4, 8)


def _rows(seed: int = 0) -> torch.Tensor:
    return torch.randn(_ROWS, _COLS, generator=torch.Generator().manual_seed(seed))


def _round_trip(name: str, options: dict) -> None:
    """Encodes a batch with codec ``name`` and decodes it, into a new array and in place."""
    codec = make_codec(name, options)
    encoded = codec.encode(_rows())
    codec.decode(encoded, _COLS)
    decode_into = getattr(codec, "decode_into", None)
    if decode_into is not None:
        decode_into(encoded, _COLS, np.empty((_ROWS, _COLS), dtype=np.float32))


def compile_adaptive_search() -> None:
    """The range search, fused (fp16 parameters) and ranges only (fp32 parameters); encoding
    alone (decoding is the uniform part's)."""
    for bits in _BITS:
        for param_dtype in ("float16", "float32"):
            options = {"bits": bits, "param_dtype": param_dtype, "entropy": "none"}
            make_codec("adaptive", options).encode(_rows())


def compile_uniform() -> None:
    """Quantize, pack and decode (fp16 and fp32 parameters, with and without a bias), the
    delta codec's narrower widths, and the addition of its rows into a block."""
    for bits in _BITS:
        for name in ("asymmetric", "symmetric"):
            for param_dtype in ("float16", "float32"):
                _round_trip(name, {"bits": bits, "param_dtype": param_dtype, "entropy": "none"})
    delta = make_codec("delta", {"inner": {"id": "adaptive", "bits": 4}})
    reference = _rows(1)
    encoded = delta.encode_delta(reference + 0.01 * _rows(2), reference)
    delta.decode(encoded, _COLS)
    for dtype in (np.float32, np.float64):  # delta rows added into a block (read/cells.py)
        row_kernels.add_rows(np.zeros((4, _COLS), dtype), np.arange(2), np.ones((2, _COLS), dtype))
    block, rows = np.zeros((4, _COLS), np.float32), np.arange(2)  # changes, row by row
    row_kernels.add_indexed(block, rows, np.array([0, -1]), np.ones((3, _COLS), np.float32), 0)
    row_kernels.copy_rows(block, rows, np.ones((2, _COLS), np.float32))  # rows replaced
    assert isinstance(delta, DeltaCodec)  # changes added as coded (read/changes.py)
    (entries,), parts = delta.row_entries([encoded])
    table = delta.kernel_parts(parts, _COLS)
    assert table is not None  # an adaptive inner codec: decoded as added
    delta_kernels.add_coded(
        block, rows, entries.keys[:2], entries.offsets[:2], entries.data, table, _COLS, 0
    )


def compile_kmeans_and_huffman() -> None:
    """k-means rows, codebook sums and packing; Huffman histograms, encode and decode."""
    try:
        import_extra("sklearn.cluster", "kmeans")
    except ImportError:
        pass  # without the extra, kmeans never runs: nothing of it to compile
    else:
        for bits in _BITS:
            _round_trip("kmeans", {"bits": bits, "entropy": "none"})
    compile_huffman()


def compile_huffman() -> None:
    """Huffman histograms, encode and decode (behind the 4- and 8-bit uniform codes)."""
    for bits in (4, 8):
        _round_trip("asymmetric", {"bits": bits, "entropy": "huffman"})


def load_kernels() -> None:
    """Loads every kernel a save or a restore calls (compiled, from numba's cache) into a
    process that others are forked from (``codecs/preload.py``, ``save/writer_zygote.py``).
    One torch thread first: the kernels' small torch operations then never start torch's
    OpenMP pool, which a forked child would lose (it can hang in its first parallel region)."""
    torch.set_num_threads(1)
    compile_adaptive_search()
    compile_uniform()
    compile_huffman()


#: Parts, longest first: each compiles kernels no other part does.
PARTS: dict[str, Callable[[], None]] = {
    "adaptive search": compile_adaptive_search,
    "uniform quantize, pack, decode": compile_uniform,
    "k-means and Huffman": compile_kmeans_and_huffman,
}


def _run_part(name: str) -> tuple[str, float]:
    torch.set_num_threads(1)
    started = time.perf_counter()
    PARTS[name]()
    return name, time.perf_counter() - started


def precompile(workers: int | None = None) -> dict[str, float]:
    """Runs every part, ``workers`` processes at a time (default: one per core, at most one
    per part); returns each part's seconds."""
    workers = workers or min(len(PARTS), os.cpu_count() or 1)
    if workers == 1:
        return dict(_run_part(name) for name in PARTS)
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited threads
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        return dict(pool.map(_run_part, PARTS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=None, help="processes (default: cores)")
    args = parser.parse_args()
    started = time.perf_counter()
    seconds = precompile(args.workers)
    parts = ", ".join(f"{name} {s:.1f}s" for name, s in seconds.items())
    print(f"embckpt: codec kernels compiled in {time.perf_counter() - started:.0f}s ({parts})")


if __name__ == "__main__":
    main()
