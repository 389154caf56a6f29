"""The GPU encoder (codecs/device_encode.py) writes exactly the bytes of the CPU path.

Without a CUDA device, Triton's interpreter runs the kernels on CPU tensors: conftest.py turns
it on (``TRITON_INTERPRET=1``) before anything imports triton, unless the environment already
says; with CUDA, the ``gpu`` test runs the compiled kernels instead. Every test needs Triton,
which the project does not require, and skips without it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # conftest.py turned it on already, before triton loaded
    os.environ.setdefault("TRITON_INTERPRET", "1")

from codec_rows import embedding_rows  # noqa: E402
from golden.generate import sample_rows  # noqa: E402

from embckpt.codecs import Codec, make_codec  # noqa: E402
from embckpt.codecs.base import fixed_binary_values  # noqa: E402
from embckpt.codecs.device_encode import device_fused, is_available  # noqa: E402
from embckpt.errors import CodecError  # noqa: E402

CODECS = ("asymmetric", "symmetric", "adaptive")
BITS = (2, 3, 4, 8)
INTERPRETED = is_available(torch.device("cpu"))
interpreted = pytest.mark.skipif(
    not INTERPRETED,
    reason="needs triton and its interpreter (TRITON_INTERPRET=1, which this module sets "
    "when there is no CUDA device)",
)


def assert_as_on_cpu(codec: Codec, x: torch.Tensor, on_device: bool | None = True) -> None:
    """The device path's bytes and metadata are ``codec.encode``'s on the CPU, or it
    declines (None) exactly where the CPU stores fp32 parameters or refuses the rows;
    ``on_device``: whether it must serve the rows (None: either)."""
    fused = device_fused(codec, x)
    try:
        expected = codec.encode(x.cpu())
    except CodecError:
        assert fused is None
        return
    if expected.metadata["param_dtype"] == "float32":
        assert fused is None
        assert not on_device
        return
    assert fused is not None, codec.get_config()
    assert on_device is not False
    assert fused[0].device == x.device
    got = codec.encode_fused(*fused)
    assert got.metadata == expected.metadata
    assert got.compression == expected.compression
    if not got.columns["payload"].equals(expected.columns["payload"]):
        ours = fixed_binary_values(got.columns["payload"])
        theirs = fixed_binary_values(expected.columns["payload"])
        rows = np.flatnonzero((ours != theirs).any(axis=1)) if ours.shape == theirs.shape else []
        raise AssertionError(f"{codec.get_config()}: rows {rows[:20]} differ")


@interpreted
def test_golden_rows_encode_as_on_cpu() -> None:
    x = sample_rows(delta=False)
    for codec_id in CODECS:
        for bits in BITS:
            # At 8 bits a narrow row's step is below fp16's normal range: fp32 parameters.
            codec = make_codec(codec_id, {"bits": bits, "entropy": "none"})
            assert_as_on_cpu(codec, x, on_device=bits < 8)


@interpreted
@pytest.mark.parametrize("cols", [16, 64, 100, 128])
def test_embedding_rows_encode_as_on_cpu(cols: int) -> None:
    fitting = embedding_rows(256, cols, seed=cols, tiny=False)
    # Narrow widths also with tiny rows (the interpreter's time grows with the width).
    mixed = embedding_rows(256, cols, seed=cols + 1) if cols <= 64 else None
    for codec_id in CODECS:
        for bits in BITS:
            codec = make_codec(codec_id, {"bits": bits, "entropy": "none"})
            assert_as_on_cpu(codec, fitting)
            if mixed is not None:
                assert_as_on_cpu(codec, mixed, on_device=None)


@interpreted
def test_options_views_and_empty_batches() -> None:
    x = embedding_rows(256, 24, seed=5, tiny=False)
    for options in (
        {"bits": 4, "param_dtype": "float16"},
        {"bits": 3, "n_bins": 25, "ratio": 0.6},
        {"bits": 2, "n_bins": 4, "ratio": 0.2},  # under two steps: each row's own range
        {"bits": 4, "entropy": "huffman"},
    ):
        assert_as_on_cpu(make_codec("adaptive", options), x)
    wide = torch.cat([x, x.flip(0)], dim=1)
    assert_as_on_cpu(make_codec("asymmetric", {"bits": 4}), wide[10:200, 24:])
    assert_as_on_cpu(make_codec("adaptive", {"bits": 8}), wide[::3, :24])
    for codec_id in CODECS:
        assert_as_on_cpu(make_codec(codec_id), x[:0])
    # fp16 parameters cannot hold a tiny row: the CPU refuses it under param_dtype float16.
    tiny = x.clone()
    tiny[9] *= 1e-5
    assert_as_on_cpu(make_codec("asymmetric", {"param_dtype": "float16"}), tiny, on_device=False)


@interpreted
def test_fallbacks_return_none() -> None:
    x = embedding_rows(64, 16, seed=2, tiny=False)
    for codec_id in CODECS:
        assert device_fused(make_codec(codec_id, {"param_dtype": "float32"}), x) is None
        for bad in (float("nan"), float("inf"), 7e4, 1e30):
            y = x.clone()
            y[40, 3] = bad
            assert device_fused(make_codec(codec_id), y) is None, (codec_id, bad)
    assert device_fused(make_codec("fp16"), x) is None
    assert device_fused(make_codec("exponent"), x) is None
    assert device_fused(make_codec("asymmetric"), x.double()) is None
    assert device_fused(make_codec("asymmetric"), x.t()) is None  # columns not contiguous


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or not is_available(torch.device("cuda")) or INTERPRETED,
    reason="needs a CUDA device and triton, with its interpreter off",
)
def test_cuda_kernels_encode_as_on_cpu() -> None:
    for cols in (16, 64, 100):
        fitting = embedding_rows(4096, cols, seed=cols, tiny=False).cuda()
        mixed = embedding_rows(4096, cols, seed=cols + 1).cuda()
        for codec_id in CODECS:
            for bits in BITS:
                codec = make_codec(codec_id, {"bits": bits, "entropy": "none"})
                assert_as_on_cpu(codec, fitting)
                assert_as_on_cpu(codec, mixed, on_device=None)
    assert_as_on_cpu(make_codec("adaptive"), sample_rows(delta=False).cuda())
    wide = embedding_rows(3000, 128, seed=3, tiny=False).cuda()
    assert_as_on_cpu(make_codec("adaptive", {"bits": 4}), wide[7:2900, 3:67])
    y = wide.clone()
    y[2000, 5] = float("nan")
    assert device_fused(make_codec("adaptive"), y) is None
