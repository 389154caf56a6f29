"""Row codecs: round trips within each codec's error bound at every bit width, edge-case rows,
the registry and config mapping, the Huffman stage, and exponent-coded deltas over many
checkpoints. Every round trip goes through a real Parquet row file (codecs.testing)."""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import numpy as np
import pytest
import torch
from codec_roundtrip import encoded_bytes_per_row, round_trip

from embckpt.codecs import Codec, DeltaCodec, EncodedRows, codec_from_config, make_codec
from embckpt.codecs import huffman as hm
from embckpt.codecs.adaptive import AdaptiveCodec, greedy_ranges, range_loss
from embckpt.codecs.packing import pack_codes, packed_width, unpack_codes
from embckpt.codecs.uniform import AsymmetricCodec, quantize_affine
from embckpt.config import CheckpointConfig, codec_for, state_codec_name
from embckpt.errors import CodecError, ConfigError, UnknownCodecError

BITS = (2, 3, 4, 8)
UNIFORM = ("symmetric", "asymmetric", "adaptive")
LOSSY = ("fp16", "bf16", *UNIFORM, "kmeans", "exponent")
STAGES = ("none", "huffman", "zstd")
#: Every lossy codec at every bit width it takes (None: it takes none).
LOSSY_WIDTHS = [(c, b) for c in LOSSY for b in ((None,) if c in ("fp16", "bf16") else BITS)]


def _rows(n: int = 300, cols: int = 16, seed: int = 0) -> torch.Tensor:
    """Embedding-like rows: per-row scale and offset, a few outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cols, generator=g) * torch.rand(n, 1, generator=g) * 0.2
    x += torch.randn(n, 1, generator=g) * 0.01
    x[::17, cols // 2] *= 6.0
    return x


def _codec(codec_id: str, bits: int | None, entropy: str = "none") -> Codec:
    options: dict = {"entropy": entropy}
    if bits is not None:
        options["bits"] = bits
    return make_codec(codec_id, options)


def _bound(codec_id: str, bits: int | None, x: torch.Tensor) -> torch.Tensor:
    """Per-element error bound [n, 1] (or [n, cols]) of each codec on rows ``x``."""
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    peak = x.abs().amax(1, keepdim=True)
    rounding = 2.0**-9 * peak + 1e-30  # fp16 scale and bias
    if codec_id == "fp16":
        return x.abs() * 2.0**-11 + 2.0**-25
    if codec_id == "bf16":
        return x.abs() * 2.0**-8 + 1e-38
    assert bits is not None
    levels = (1 << bits) - 1
    if codec_id == "asymmetric":
        return 0.5 * (hi - lo) / levels + rounding
    if codec_id == "symmetric":
        return 0.5 * peak / ((1 << (bits - 1)) - 1) + rounding
    if codec_id == "adaptive":
        # Clipping can cost up to the clipped share of the range, on top of half a step.
        ratio = AdaptiveCodec(bits=bits).ratio
        return 0.5 * (hi - lo) / levels + ratio * (hi - lo) + rounding
    if codec_id == "kmeans":
        return (hi - lo) + rounding
    if codec_id == "exponent":
        return x.abs() + 1e-30
    raise AssertionError(codec_id)


# -- round trips within bounds --------------------------------------------------------------


@pytest.mark.parametrize(("codec_id", "bits"), LOSSY_WIDTHS)
def test_round_trip_within_bound(codec_id: str, bits: int | None) -> None:
    x = _rows()
    for entropy in STAGES:
        codec = _codec(codec_id, bits, entropy)
        decoded = round_trip(codec, x)
        err = (decoded - x).abs()
        assert bool((err <= _bound(codec_id, bits, x)).all()), (codec_id, bits, entropy, err.max())
        assert codec_from_config(codec.get_config()).get_config() == codec.get_config()


@pytest.mark.parametrize("bits", BITS)
def test_error_ordering_on_gaussian_rows(bits: int) -> None:
    """Symmetric >= asymmetric >= adaptive, kmeans below asymmetric: Check-N-Run's ordering."""
    x = torch.randn(400, 64, generator=torch.Generator().manual_seed(1)) * 0.05
    err = {
        cid: float((round_trip(_codec(cid, bits), x) - x).norm(dim=1).mean())
        for cid in ("symmetric", "asymmetric", "adaptive", "kmeans")
    }
    assert err["adaptive"] < err["asymmetric"] < err["symmetric"], err
    assert err["kmeans"] < err["asymmetric"], err


def test_headline_fulls_leave_their_codes_uncompressed_and_diffs_compress_their_changes() -> None:
    # The headline setting's codec: fulls by its whole-row codec (near incompressible codes,
    # which a restore would otherwise decompress), diffs' changes with zstd.
    codec = codec_for(CheckpointConfig(codec="adaptive", bits=4))
    assert isinstance(codec, DeltaCodec)
    rows = _rows()
    assert "payload" not in codec.whole.encode(rows).compression
    assert codec.encode_delta(rows + 0.01, rows).compression == {"payload": "zstd"}
    for name in ("asymmetric", "symmetric", "adaptive"):
        assert make_codec(name, {}).get_config()["entropy"] == "none", name
        assert make_codec(name, {"entropy": "zstd"}).encode(rows).compression == {"payload": "zstd"}


def test_raw_is_bit_exact_even_for_nan_and_inf() -> None:
    x = _rows(20, 6)
    x[3, 2], x[4, 0], x[5, 5] = float("nan"), float("inf"), -float("inf")
    for entropy in STAGES:
        decoded = round_trip(make_codec("raw", {"entropy": entropy}), x)
        assert torch.equal(decoded.view(torch.int32), x.view(torch.int32))
    # The default raw codec: format 2, float lists, no entropy stage (full saves keep pace).
    assert make_codec("raw").get_config() == {"id": "raw", "version": 2, "entropy": "none"}
    assert dict(make_codec("raw").encode(x).metadata) == {"dtype": "float32", "entropy": "none"}


def test_row_range_reads_decode_a_subset() -> None:
    x = _rows(500, 12)
    for codec_id, bits in (("asymmetric", 3), ("kmeans", 4), ("exponent", 2), ("fp16", None)):
        for entropy in STAGES:
            # Fresh codecs: kmeans seeds its codebook from the previous batch it encoded.
            whole = round_trip(_codec(codec_id, bits, entropy), x)
            part = round_trip(_codec(codec_id, bits, entropy), x, row_range=(130, 377))
            assert torch.equal(part, whole[130:377]), (codec_id, entropy)


@pytest.mark.parametrize("cols", [1, 5, 7, 64])
def test_odd_widths_and_generic_path(cols: int) -> None:
    x = _rows(50, cols)
    for codec_id in ("symmetric", "asymmetric", "adaptive", "kmeans", "exponent"):
        for bits in BITS:
            decoded = round_trip(_codec(codec_id, bits), x)
            assert bool(((decoded - x).abs() <= _bound(codec_id, bits, x)).all()), (codec_id, bits)


def test_kernel_fbgemm_and_torch_paths_agree_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    import embckpt.codecs.uniform as uniform

    x = _rows(400, 32)
    lo, hi = x.amin(1), x.amax(1)
    for bits in (2, 3, 4, 8):
        kernel = quantize_affine(x, lo + 0.1 * (hi - lo), hi, bits, True)
        with monkeypatch.context() as m:
            m.setattr(uniform, "COMPILED", False)
            fbgemm = quantize_affine(x, lo + 0.1 * (hi - lo), hi, bits, True)
            m.setattr(uniform, "fbgemm_fits", lambda *_: False)
            plain = quantize_affine(x, lo + 0.1 * (hi - lo), hi, bits, True)
        for other in (fbgemm, plain):
            assert torch.equal(kernel[0], other[0]) and torch.equal(kernel[1], other[1]), bits


def _adversarial_rows(cols: int) -> torch.Tensor:
    """Rows that stress the kernels: constant, zero, one-hot, tiny steps (fp16 subnormal
    scales), a wide range, values on fp16 rounding ties, plus ordinary rows."""
    x = _rows(64, cols, seed=cols)
    x[0] = 0.0
    x[1] = 0.37
    x[2, 0] = 1.0
    x[3] = torch.linspace(-1, 1, cols) * 1e-4
    x[4] = torch.linspace(-3e4, 6e4, cols)
    x[5] = torch.linspace(0, 1, cols).half().float() * 0.5 + 2.0**-11
    x[6] = -x[7]
    x[8] = torch.linspace(-1, 1, cols) * 2.0**-20
    return x


@pytest.mark.parametrize("cols", [1, 3, 7, 13, 64])
def test_kernels_match_the_torch_path(cols: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled CPU kernels write the torch path's bytes and decode to its values, for
    every uniform codec and width, on random and adversarial rows (any number of them)."""
    import embckpt.codecs.uniform as uniform

    batches = [_adversarial_rows(cols), _rows(1, cols, seed=3), _rows(3, cols) * 1e3]
    for codec_id in UNIFORM:
        for bits in BITS:
            codec = _codec(codec_id, bits)
            for x in batches:
                fast = codec.encode(x)
                with monkeypatch.context() as m:
                    m.setattr(uniform, "COMPILED", False)
                    slow = codec.encode(x)
                    slow_rows = codec.decode(slow, cols)
                assert fast.metadata == slow.metadata, (codec_id, bits)
                if codec_id == "adaptive":
                    # Same walk, sums in another order: a near tie may pick another range.
                    err = (codec.decode(fast, cols) - x).norm(dim=1)
                    ref = (slow_rows - x).norm(dim=1)
                    assert bool((err <= ref * (1 + 1e-3) + 1e-7).all()), (bits, cols)
                else:
                    assert fast.columns["payload"].equals(slow.columns["payload"]), (codec_id, bits)
                # Decoding the same bytes: the kernel and torch (or FBGEMM) agree to rounding.
                decoded = codec.decode(slow, cols)
                assert torch.allclose(decoded, slow_rows, rtol=1e-6, atol=0), (codec_id, bits)


def test_kernel_fp16_rounding_matches_torch() -> None:
    from embckpt.codecs import fp16_bits

    every = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16)
    values = torch.cat([every.float(), -every.float()])
    between = (values[:-1] + values[1:]) / 2  # exact ties: round to even
    g = torch.Generator().manual_seed(0)
    random = torch.randn(4000, generator=g) * torch.logspace(-9, 4.8, 4000)
    tests = torch.cat([values[::7], between[::7], random, torch.tensor([65519.0, 65520.0, 7e4])])
    rounded = np.array([fp16_bits.half_round(np.float32(v)) for v in tests.tolist()])
    assert np.array_equal(rounded, tests.half().float().numpy())
    halves = np.array([fp16_bits.half_bits(np.float32(v)) for v in values[::7].tolist()])
    assert np.array_equal(
        halves.astype(np.uint16), values[::7].half().view(torch.int16).numpy().view(np.uint16)
    )


@pytest.mark.parametrize("bits", BITS)
def test_compiled_decode_is_the_affine_formula_bit_for_bit(bits: int) -> None:
    """``uniform_kernels.dequantize`` (each width its own loop, the parameters read from each
    row's bytes) gives ``scale * q + bias`` as numpy computes it from the unpacked codes: in
    float64 for fp32 parameters, float32 for fp16 ones (subnormal and zero scales among them),
    with a stored bias or the symmetric grid's implied one, every column count (partial bytes
    too) and scales from 1e-8 to 1e2."""
    from embckpt.codecs import uniform_kernels

    rng = np.random.default_rng(bits)
    for cols in (1, 2, 3, 5, 7, 9, 16, 17, 31, 128):
        n = 97
        packed = rng.integers(0, 256, (n, packed_width(cols, bits)), dtype=np.uint8)
        codes = unpack_codes(torch.from_numpy(packed.copy()), bits, cols).numpy()
        scale = (rng.random(n) - 0.3) * 10.0 ** rng.integers(-8, 3, n)
        bias = (rng.random(n) - 0.5) * 10.0 ** rng.integers(-8, 3, n)
        for dtype, stored in itertools.product((np.float16, np.float32), (True, False)):
            s, b = scale.astype(dtype), bias.astype(dtype)
            params = [s[:, None].view(np.uint8)] + ([b[:, None].view(np.uint8)] if stored else [])
            fused = np.concatenate([packed, *params], axis=1)
            fused.flags.writeable = False  # as Arrow's buffers come
            s64 = s.astype(np.float64)
            b64 = b.astype(np.float64) if stored else -float(1 << (bits - 1)) * s64
            if dtype == np.float32:
                expected = (codes * s64[:, None] + b64[:, None]).astype(np.float32)
            else:
                expected = codes.astype(np.float32) * s64.astype(np.float32)[:, None]
                expected += b64.astype(np.float32)[:, None]
            out = np.empty((n, cols), np.float32)
            uniform_kernels.dequantize(fused, bits, cols, dtype == np.float16, stored, out)
            assert out.tobytes() == expected.tobytes(), (bits, cols, dtype, stored)


def test_kernel_fp16_values_are_numpys_for_every_bit_pattern() -> None:
    from embckpt.codecs.fp16_bits import half_value

    patterns = np.arange(1 << 16, dtype=np.uint32)
    expected = patterns.astype(np.uint16).view(np.float16).astype(np.float32)
    got = np.array([half_value(p) for p in patterns], dtype=np.float32)
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(got), nan)
    assert got[~nan].tobytes() == expected[~nan].tobytes()


# -- edge-case rows -------------------------------------------------------------------------


@pytest.mark.parametrize("codec_id", LOSSY)
def test_constant_and_zero_rows(codec_id: str) -> None:
    x = _rows(40, 8)
    x[0] = 0.0
    x[1] = 0.37
    x[2] = -1234.5
    x[3, :] = 1e-3
    bits = None if codec_id in ("fp16", "bf16") else 4
    decoded = round_trip(_codec(codec_id, bits), x)
    assert torch.equal(decoded[0], torch.zeros(8)), codec_id
    if codec_id != "exponent":  # an additive codec keeps only the largest buckets
        for r in (1, 2, 3):
            assert torch.allclose(decoded[r], x[r], rtol=2.0**-7, atol=0), (codec_id, decoded[r])


@pytest.mark.parametrize("codec_id", LOSSY)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_are_refused(codec_id: str, bad: float) -> None:
    x = _rows(30, 8)
    x[17, 5] = bad
    bits = None if codec_id in ("fp16", "bf16") else 4
    with pytest.raises(CodecError, match="row 17"):
        _codec(codec_id, bits).encode(x)


@pytest.mark.parametrize("compiled", [True, False])
def test_a_row_holding_plus_infinity_is_refused_whatever_the_range_search_finds(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """+inf is a row's max, not its min: adaptive's range search over such a row settled on a
    finite range and clipped the value, silently (found on these seeds, with the kernels)."""
    from embckpt.codecs import uniform

    monkeypatch.setattr(uniform, "COMPILED", compiled)
    for seed in range(30):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(30, 8, generator=g) * (1 + seed)
        x[17, seed % 8] = float("inf")
        for codec_id in LOSSY:
            bits = None if codec_id in ("fp16", "bf16") else 4
            with pytest.raises(CodecError, match="row 17"):
                _codec(codec_id, bits).encode(x)


@pytest.mark.parametrize("codec_id", ["symmetric", "asymmetric", "adaptive", "kmeans", "bf16"])
@pytest.mark.parametrize("magnitude", [1e30, 1e5, 1e-6, 1e-30])
def test_large_and_tiny_magnitudes(codec_id: str, magnitude: float) -> None:
    """Rows fp16 parameters cannot hold switch the file to fp32 parameters, keeping the
    relative error of every row; nothing overflows or flushes to zero."""
    x = _rows(60, 16) / 0.2 * magnitude
    x[5] = _rows(1, 16)[0]  # an ordinary row beside them
    bits = None if codec_id == "bf16" else 4
    codec = _codec(codec_id, bits)
    decoded = round_trip(codec, x)
    assert bool(torch.isfinite(decoded).all())
    bound = _bound(codec_id, bits, x) if codec_id != "kmeans" else None
    if bound is not None:
        assert bool(((decoded - x).abs() <= bound * (1 + 1e-6)).all()), codec_id
    rel = ((decoded.double() - x.double()).norm(dim=1) / x.double().norm(dim=1)).max()
    assert rel < 0.2, (codec_id, rel)
    meta = codec.encode(x).metadata
    if codec_id != "bf16" and magnitude in (1e30, 1e5, 1e-6, 1e-30):
        assert meta["param_dtype"] == "float32"


def test_fp16_refuses_values_beyond_its_range() -> None:
    x = _rows(10, 4)
    x[7, 1] = 1e5
    with pytest.raises(CodecError, match="row 7"):
        make_codec("fp16").encode(x)
    round_trip(make_codec("bf16"), x)
    # Sums that overflow (values near fp32's maximum) are not mistaken for infinities.
    huge = torch.full((4, 8), 3e38)
    huge[1] = -3e38
    for codec_id in ("bf16", "asymmetric", "exponent"):
        decoded = round_trip(make_codec(codec_id), huge)
        assert bool(torch.isfinite(decoded).all()), codec_id


def test_empty_batch() -> None:
    x = torch.zeros(0, 16)
    for codec_id in LOSSY:
        bits = None if codec_id in ("fp16", "bf16") else 3
        for entropy in STAGES:
            assert round_trip(_codec(codec_id, bits, entropy), x).shape == (0, 16)


def test_rows_on_other_dtypes_and_non_contiguous() -> None:
    x = _rows(64, 32)
    for source in (x.double(), x.half(), x.t().contiguous().t()):
        decoded = round_trip(make_codec("asymmetric", {"bits": 8}), source)
        assert decoded.dtype == torch.float32
        assert float((decoded - x).abs().max()) < 0.01


# -- packing, adaptive search, kmeans, exponent ---------------------------------------------


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_codes_inverts_and_matches_fbgemm_layout(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    for k in (1, 3, 8, 13, 64):
        codes = torch.randint(0, 1 << bits, (9, k), generator=g, dtype=torch.uint8)
        packed = pack_codes(codes, bits)
        assert packed.shape == (9, packed_width(k, bits))
        assert torch.equal(unpack_codes(packed, bits, k), codes)
    if bits in (2, 4):
        x = torch.tensor([[0.0, 1.0, 2.0, 3.0] * 4])
        fused = torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(x, bits)
        width = packed_width(16, bits)
        assert torch.equal(
            pack_codes(unpack_codes(fused[:, :width], bits, 16), bits), fused[:, :width]
        )


def _param_search_greedy(x: np.ndarray, bits: int, n_bins: int, steps: int) -> tuple[float, float]:
    """caffe2's param_search_greedy for one row, written plainly (the reference)."""
    levels = (1 << bits) - 1

    def loss(lo: float, hi: float) -> float:
        lo16 = float(np.float16(lo))
        scale = float(np.float16((hi - lo16) / levels)) if hi > lo16 else 1.0
        q = np.clip(np.round((x - lo16) / scale), 0, levels)
        return float(np.sum((x - (q * scale + lo16)) ** 2))

    xmin, xmax = float(x.min()), float(x.max())
    step = (xmax - xmin) / n_bins
    lo, hi, cur = xmin, xmax, loss(xmin, xmax)
    best = (float("inf"), xmin, xmax)
    for _ in range(steps):
        up, down = loss(lo + step, hi), loss(lo, hi - step)
        if cur < up and cur < down and cur < best[0]:
            best = (cur, lo, hi)
        lo, hi, cur = (lo + step, hi, up) if up < down else (lo, hi - step, down)
    return best[1], best[2]


@pytest.mark.parametrize("bits", BITS)
def test_vectorised_greedy_search_matches_reference(bits: int) -> None:
    x = _rows(40, 24, seed=bits)
    codec = AdaptiveCodec(bits=bits)
    steps = math.floor(codec.n_bins * codec.ratio + 1e-9)
    lo, hi = greedy_ranges(x, x.amin(1), x.amax(1), bits, codec.n_bins, steps, True)
    levels = (1 << bits) - 1
    for r in range(len(x)):
        ref = _param_search_greedy(x[r].double().numpy(), bits, codec.n_bins, steps)
        ours = range_loss(x[r : r + 1], lo[r : r + 1], hi[r : r + 1], levels, True)
        theirs = range_loss(
            x[r : r + 1], torch.tensor([ref[0]]), torch.tensor([ref[1]]), levels, True
        )
        assert float(ours) <= float(theirs) * (1 + 1e-4) + 1e-12, (r, ref, lo[r], hi[r])


def _trained_like_rows(n: int, seed: int) -> torch.Tensor:
    """Rows shaped like trained DLRM embeddings (benchmarks/codecs.py's): heavy-tailed
    values, per-row scales spread over two decades, a small per-row offset."""
    g = torch.Generator().manual_seed(seed)
    x = torch.distributions.StudentT(4.0).sample((n, 64))
    x *= torch.logspace(-3, -1, n)[torch.randperm(n, generator=g)][:, None]
    return (x + torch.randn(n, 1, generator=g) * 1e-3).float()


@pytest.mark.parametrize("bits", BITS)
def test_kernel_search_keeps_the_greedy_error(bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled search's l2 error is within 1% of the torch greedy search's, mean over
    rows, and no row is more than 1% worse."""
    import embckpt.codecs.uniform as uniform

    torch.manual_seed(bits)
    x = _trained_like_rows(3000, bits)
    codec = _codec("adaptive", bits)
    err = (codec.decode(codec.encode(x), 64) - x).norm(dim=1)
    with monkeypatch.context() as m:
        m.setattr(uniform, "COMPILED", False)
        ref = (codec.decode(codec.encode(x), 64) - x).norm(dim=1)
    assert float(err.mean()) <= 1.01 * float(ref.mean()), (float(err.mean()), float(ref.mean()))
    assert float((err / ref).max()) <= 1.01
    asym = _codec("asymmetric", bits).decode(_codec("asymmetric", bits).encode(x), 64) - x
    assert float(err.mean()) < float(asym.norm(dim=1).mean())  # the search still pays


def _walk_row_by_row(
    x: np.ndarray, bits: int, n_bins: int, steps: int, half: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's range by the reference walk below."""
    lo = np.empty(len(x), dtype=np.float32)
    hi = np.empty(len(x), dtype=np.float32)
    _row_by_row_kernel()(x, bits, n_bins, steps, half, lo, hi)
    return lo, hi


@functools.cache
def _row_by_row_kernel() -> Any:
    """The compiled search as it stood before the lockstep kernel (adaptive_kernels.search_rows):
    one row's walk at a time, a branch per choice, left-to-right min and max, each sum of squares
    left to right (the canonical order). The reference that the lockstep kernel must reproduce bit
    for bit."""
    from numba import njit

    from embckpt.codecs import adaptive_kernels as k

    @njit
    def sumsq(x, r, inv, off, top):  # type: ignore[no-untyped-def]
        acc = np.float32(0)
        for j in range(x.shape[1]):
            t = x[r, j] * inv - off
            d = t - min(max(np.rint(t), np.float32(0)), top)
            acc += d * d
        return acc

    @njit
    def walk(x, bits, n_bins, steps, half, lo, hi):  # type: ignore[no-untyped-def]
        top = np.float32((1 << bits) - 1)
        bins = np.float32(n_bins)
        for r in range(x.shape[0]):
            cur_lo = x[r, 0]
            cur_hi = x[r, 0]
            for j in range(x.shape[1]):
                cur_lo = min(cur_lo, x[r, j])
                cur_hi = max(cur_hi, x[r, j])
            lo[r] = cur_lo
            hi[r] = cur_hi
            step = (cur_hi - cur_lo) / bins
            best = np.float32(np.inf)
            inv, off, square = k._scoring(cur_lo, cur_hi, top, half)
            loss = sumsq(x, r, inv, off, top) * square
            for _ in range(steps):
                inv1, off1, sq1 = k._scoring(cur_lo + step, cur_hi, top, half)
                inv2, off2, sq2 = k._scoring(cur_lo, cur_hi - step, top, half)
                up = sumsq(x, r, inv1, off1, top) * sq1
                down = sumsq(x, r, inv2, off2, top) * sq2
                if loss < up and loss < down and loss < best:
                    best = loss
                    lo[r] = cur_lo
                    hi[r] = cur_hi
                if up < down:
                    cur_lo += step
                    loss = up
                else:
                    cur_hi -= step
                    loss = down

    return walk


def _zero_heavy_rows(cols: int) -> torch.Tensor:
    """Rows whose min or max is a zero, of either sign or both (the min and max must keep
    the first), constant rows, and rows on a coarse grid (ties between ranges)."""
    x = _rows(400, cols, seed=cols)
    x[::7, ::3] = 0.0
    x[::11, ::2] = -0.0
    x[::13] = 0.0
    x[::17] = -0.0
    x[::19] = 0.37
    x[::23, 0] = -0.0
    x[::23, 1:] = 0.0
    x[::29] = x[::29].abs()
    x[1::29] = -x[1::29].abs()
    x[::31] = torch.round(x[::31] * 100) / 100
    return x


@pytest.mark.parametrize("bits", BITS)
def test_lockstep_search_reproduces_the_row_by_row_walk(bits: int) -> None:
    """adaptive_kernels.search_rows picks exactly the ranges of the row-by-row walk it replaced, and
    the adaptive codec writes exactly the bytes of those ranges quantized, on trained-like rows,
    zero-heavy rows and odd widths, with fp16-rounded and exact parameters (exact ties between
    ranges included: both sum in the same order)."""
    from embckpt.codecs import adaptive_kernels
    from embckpt.codecs.base import fixed_binary_values
    from embckpt.codecs.uniform import half_params_fit

    torch.manual_seed(bits)
    codec = AdaptiveCodec(bits=bits)
    steps = math.floor(codec.n_bins * codec.ratio + 1e-9)
    batches = [_trained_like_rows(20000, bits)] + [_zero_heavy_rows(c) for c in (1, 7, 64, 100)]
    for x in batches:
        xn = x.numpy()
        for half in (False, True):
            ref_lo, ref_hi = _walk_row_by_row(xn, bits, codec.n_bins, steps, half)
            lo, hi, xmin, xmax = (np.empty(len(xn), dtype=np.float32) for _ in range(4))
            none = np.empty((0, 0), dtype=np.uint8)
            assert adaptive_kernels.search_rows(
                xn, bits, codec.n_bins, steps, half, lo, hi, xmin, xmax, False, none
            )
            assert np.array_equal(lo.view(np.uint32), ref_lo.view(np.uint32)), (bits, half)
            assert np.array_equal(hi.view(np.uint32), ref_hi.view(np.uint32)), (bits, half)
        # The codec's bytes: the reference's ranges, searched and quantized as its options say.
        xn = x.numpy()
        half = half_params_fit(x.amin(1), x.amax(1), bits)
        ref_lo, ref_hi = map(
            torch.from_numpy, _walk_row_by_row(xn, bits, codec.n_bins, steps, half)
        )
        expected = codec._fuse(x, ref_lo, ref_hi, half_params_fit(ref_lo, ref_hi, bits))
        payload = fixed_binary_values(codec.encode(x).columns["payload"])
        assert np.array_equal(payload, expected.numpy()), bits


def test_lockstep_search_stops_at_non_finite_rows() -> None:
    from embckpt.codecs import adaptive_kernels

    x = _rows(200, 16)
    x[150, 3] = float("nan")
    out = np.empty((200, packed_width(16, 4) + 4), dtype=np.uint8)
    lo, hi, xmin, xmax = (np.empty(200, dtype=np.float32) for _ in range(4))
    assert not adaptive_kernels.search_rows(
        x.numpy(), 4, 50, 5, True, lo, hi, xmin, xmax, True, out
    )
    x[150, 3] = float("-inf")
    assert not adaptive_kernels.search_rows(
        x.numpy(), 4, 50, 5, True, lo, hi, xmin, xmax, True, out
    )


def test_torch_paths_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path (CUDA tensors take it) stays within every bound with the kernels off."""
    import embckpt.codecs.uniform as uniform

    monkeypatch.setattr(uniform, "COMPILED", False)
    x = _rows(200, 24)
    for codec_id in UNIFORM:
        for bits in BITS:
            decoded = round_trip(_codec(codec_id, bits, "zstd"), x)
            assert bool(((decoded - x).abs() <= _bound(codec_id, bits, x)).all()), (codec_id, bits)


def test_adaptive_options_and_format() -> None:
    codec = make_codec("adaptive", {"bits": 2, "n_bins": 25, "ratio": 0.6})
    assert codec.get_config()["n_bins"] == 25
    x = _rows(50, 16)
    encoded = codec.encode(x)
    # Same format as asymmetric: the asymmetric decoder reads it.
    assert torch.equal(AsymmetricCodec(bits=2).decode(encoded, 16), codec.decode(encoded, 16))
    with pytest.raises(ConfigError):
        make_codec("adaptive", {"ratio": 1.5})


@pytest.mark.parametrize("bits", BITS)
def test_kmeans_kernel_matches_the_torch_path(bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled per-row alternation assigns exactly the torch path's codes, refits the
    same parameters up to summation order, and encodes to the same error."""
    import embckpt.codecs.kmeans as km
    import embckpt.codecs.uniform as uniform

    for x in (_adversarial_rows(13), _rows(300, 64, seed=bits), _rows(1, 5)):
        codec = _codec("kmeans", bits)
        codebook = codec._fit(x, x.amin(1), x.amax(1) - x.amin(1), 1 << bits)
        scale, bias = x.amax(1) - x.amin(1), x.amin(1)
        fast = km._alternate(x, codebook, 3, scale, bias)
        fast0 = km._alternate(x, codebook, 0, fast[1], fast[2])
        with monkeypatch.context() as m:
            m.setattr(uniform, "COMPILED", False)
            m.setattr(km, "use_kernels", lambda _: False)
            slow = km._alternate(x, codebook, 3, scale, bias)
            slow0 = km._alternate(x, codebook, 0, fast[1], fast[2])
            slow_err = (round_trip(_codec("kmeans", bits), x) - x).norm(dim=1).mean()
        assert torch.equal(fast0[0], slow0[0]), bits
        for ours, theirs in zip(fast[1:], slow[1:], strict=True):
            assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-6 * float(x.abs().max())), bits
        err = (round_trip(_codec("kmeans", bits), x) - x).norm(dim=1).mean()
        assert float(err) <= float(slow_err) * 1.001 + 1e-9, (bits, float(err), float(slow_err))


def test_kmeans_codebook_is_per_file_and_cached() -> None:
    codec = make_codec("kmeans", {"bits": 3})
    first = codec.encode(_rows(200, 16, seed=1))
    second = codec.encode(_rows(200, 16, seed=2))
    for encoded in (first, second):
        book = encoded.metadata["codebook"]
        assert len(book) == 8 and book == sorted(book)
    # The second batch starts from the first's codebook (no refit from scratch).
    assert codec._codebook is not None


def test_exponent_symbols_and_values() -> None:
    x = torch.tensor([[0.5, -0.5, 0.25, 0.0, 1e-8, 0.75, -0.3, 0.01]])
    codec = make_codec("exponent", {"bits": 2, "entropy": "none"})
    encoded = codec.encode(x)
    values = encoded.metadata["values"]
    assert len(values) == 3  # the three largest-magnitude (sign, exponent) buckets
    decoded = round_trip(codec, x)[0]
    assert decoded[3] == 0 and decoded[4] == 0 and decoded[7] == 0  # dropped
    assert decoded[0] == decoded[5] == pytest.approx(0.625)  # bucket [0.5, 1): mean of 0.5, 0.75


@pytest.mark.parametrize("bits", [2, 3])
def test_exponent_deltas_stay_bounded_over_20_checkpoints(bits: int) -> None:
    """Error feedback: each checkpoint encodes the weights minus the reconstruction, so the
    reconstruction error stays bounded; encoding step-to-step changes lets it grow."""
    g = torch.Generator().manual_seed(bits)
    weights = torch.randn(200, 32, generator=g) * 0.05
    reference = weights.clone()  # as restored from a lossless full checkpoint
    naive = weights.clone()
    previous = weights.clone()
    codec = make_codec("exponent", {"bits": bits})
    step_size = 0.002
    errors, naive_errors = [], []
    for _ in range(20):
        weights = weights + torch.randn(weights.shape, generator=g) * step_size
        reference += round_trip(codec, weights - reference)
        naive += round_trip(codec, weights - previous)
        previous = weights.clone()
        errors.append(float((weights - reference).norm(dim=1).mean()))
        naive_errors.append(float((weights - naive).norm(dim=1).mean()))
    per_step = step_size * math.sqrt(32)
    assert max(errors) < 1.5 * per_step, errors
    assert max(errors[10:]) < 1.5 * max(errors[:10]), errors  # no growth
    assert naive_errors[-1] > 2 * errors[-1], (naive_errors[-1], errors[-1])


# -- Huffman --------------------------------------------------------------------------------


def test_huffman_round_trip_and_subset_decode() -> None:
    rng = np.random.default_rng(0)
    data = np.minimum(rng.geometric(0.2, size=(300, 21)) - 1, 255).astype(np.uint8)
    data[:, 17:] = rng.integers(0, 256, size=(300, 4))  # "parameter" bytes: their own tables
    columns = np.array([0] * 17 + [1, 2, 3, 4])
    tables = hm.TableCache().tables_for(data, columns)
    offsets, buffer = hm.encode_rows(data, tables, columns)
    assert np.array_equal(hm.decode_rows(buffer, offsets, tables, columns), data)
    assert np.array_equal(hm.decode_rows(buffer, offsets[50:101], tables, columns), data[50:100])
    for width in (1, 2, 3):  # odd widths end in a single-byte unit
        part = np.ascontiguousarray(data[:, :width])
        offsets, buffer = hm.encode_rows(part, tables[:1], columns[:width] * 0)
        assert np.array_equal(
            hm.decode_rows(buffer, offsets, tables[:1], columns[:width] * 0), part
        )
    counts = np.bincount(data[:, :17].ravel())
    entropy = -sum(p * math.log2(p) for p in counts / counts.sum() if p > 0)
    head = np.ascontiguousarray(data[:, :17])
    offsets, buffer = hm.encode_rows(head, tables[:1], np.zeros(17, dtype=np.int64))
    assert len(buffer) * 8 < (entropy + 0.1) * head.size + 8 * 300


def test_huffman_lengths_are_limited_and_prefix_free() -> None:
    counts = np.array([2**i for i in range(30)] + [0] * 226)
    lengths = hm.code_lengths(counts)
    assert lengths.max() <= hm.MAX_CODE_BITS
    assert np.sum(2.0 ** -lengths[lengths > 0].astype(float)) <= 1.0
    with pytest.raises(CodecError):
        hm.lengths_from_hex("1" * 256)  # 256 one-bit codes cannot be prefix-free


def test_huffman_table_cache_reuses_close_tables() -> None:
    codec = make_codec("asymmetric", {"bits": 4, "entropy": "huffman"})
    tables = [tuple(codec.encode(_rows(5000, 32, seed=s)).metadata["huffman"]) for s in range(4)]
    assert len(set(tables)) < len(tables)
    assert codec._tables.hits >= 1


def test_huffman_shrinks_skewed_symbols() -> None:
    g = torch.Generator().manual_seed(0)
    # Training deltas: most rows moved a little, a few a lot.
    delta = torch.randn(500, 64, generator=g) * torch.rand(500, 1, generator=g).pow(4) * 0.01
    sizes = {
        e: encoded_bytes_per_row(make_codec("exponent", {"bits": 2, "entropy": e}).encode(delta))
        for e in ("none", "huffman")
    }
    assert sizes["huffman"] < 0.5 * sizes["none"], sizes


# -- registry and config --------------------------------------------------------------------


def test_codec_for_maps_config() -> None:
    # Quantizers come wrapped in their ``delta`` codec, which writes fulls with the codec asked for.
    wrapped = codec_for(CheckpointConfig(codec="adaptive", bits=3, entropy="huffman"))
    assert isinstance(wrapped, DeltaCodec) and wrapped.get_config()["bits"] == 3
    codec = wrapped.whole
    assert codec.get_config()["bits"] == 3 and codec.get_config()["entropy"] == "huffman"
    assert wrapped.entropy == "zstd"  # Huffman's fixed-size tables do not fit variable rows
    default = codec_for(CheckpointConfig(codec="asymmetric", diff_deltas=False))
    assert default.get_config()["entropy"] == type(default)().entropy  # "auto": its own
    assert codec_for(CheckpointConfig()).get_config() == {
        "id": "raw",
        "version": 2,
        "entropy": "none",
    }
    options = CheckpointConfig(codec="kmeans", codec_options={"bits": 2, "iterations": 1})
    assert codec_for(options).get_config()["inner"]["iterations"] == 1
    with pytest.raises(ConfigError, match="conflicts"):
        codec_for(CheckpointConfig(codec="kmeans", bits=4, codec_options={"bits": 2}))
    with pytest.raises(ConfigError, match="options are"):
        codec_for(CheckpointConfig(codec="raw", bits=4))
    with pytest.raises(ConfigError):
        CheckpointConfig(codec="asymmetric", bits=5)
    with pytest.raises(ConfigError):
        CheckpointConfig(entropy="gzip")
    with pytest.raises(UnknownCodecError):
        codec_for(CheckpointConfig(codec="nope"))


def test_unknown_version_and_bad_metadata_are_clear_errors() -> None:
    with pytest.raises(UnknownCodecError, match="newer"):
        codec_from_config({"id": "kmeans", "version": 2})
    codec = make_codec("exponent", {"bits": 2})
    encoded = codec.encode(_rows(5, 4))
    broken = type(encoded)(columns=encoded.columns, metadata={"entropy": "huffman"})
    with pytest.raises((CodecError, KeyError)):
        codec.decode(broken, 4)
    huff = make_codec("asymmetric", {"bits": 4, "entropy": "huffman"}).encode(_rows(5, 16))
    meta = {**huff.metadata, "huffman_columns": [[0, 3]]}
    with pytest.raises(CodecError, match="cover"):
        make_codec("asymmetric", {"bits": 4}).decode(type(huff)(huff.columns, meta), 16)


def test_delta_and_lossless_flags() -> None:
    assert make_codec("exponent").additive and not make_codec("asymmetric").additive
    assert make_codec("raw").lossless and not make_codec("fp16").lossless
    # Optimizer state follows the rows by default: lossless rows keep it lossless, quantized
    # rows take log8; a codec given is the codec.
    assert state_codec_name(CheckpointConfig()) == "raw"
    assert state_codec_name(CheckpointConfig(codec="kmeans", bits=2)) == "log8"
    assert state_codec_name(CheckpointConfig(codec="adaptive", optimizer_codec="raw")) == "raw"
    assert state_codec_name(CheckpointConfig(codec="fp16")) == "log8"


def test_parameter_bytes_per_row() -> None:
    """Per-row parameters: fp16 scale and bias (4 bytes), symmetric's scale alone (2)."""
    x = _rows(64, 64)
    for codec_id, expected in (("asymmetric", 32 + 4), ("symmetric", 32 + 2), ("kmeans", 32 + 4)):
        encoded = make_codec(codec_id, {"bits": 4, "entropy": "none"}).encode(x)
        assert encoded_bytes_per_row(encoded) == expected, codec_id
    assert (
        encoded_bytes_per_row(make_codec("exponent", {"bits": 4, "entropy": "none"}).encode(x))
        == 32
    )


def test_the_former_name_of_additive_still_works_with_a_warning() -> None:
    from embckpt.codecs.base import Codec

    with pytest.warns(DeprecationWarning, match="set `additive`"):

        class OldStyle(Codec):  # a user's codec written against the former name
            codec_id = "old_style"
            delta = True

            def encode(self, rows: torch.Tensor) -> EncodedRows:
                raise NotImplementedError

            def decode(self, encoded: EncodedRows, num_cols: int) -> torch.Tensor:
                raise NotImplementedError

    assert OldStyle.additive
    with pytest.warns(DeprecationWarning, match="read `additive`"):
        assert make_codec("exponent").delta
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        make_codec("raw").nothing  # noqa: B018


def test_a_fixed_size_payload_made_binary_reads_back_the_same_bytes() -> None:
    """``as_binary`` (a delta diff's whole rows, packed beside its delta rows) shares the
    bytes; ``fixed_binary_values`` reads either type, a slice of one too, and refuses binary
    entries of different lengths."""
    import pyarrow as pa

    from embckpt.codecs.base import as_binary, fixed_binary_column, fixed_binary_values

    data = np.random.default_rng(0).integers(0, 256, (50, 68), dtype=np.uint8)
    fixed = fixed_binary_column(data)
    binary = as_binary(fixed)
    assert pa.types.is_binary(binary.type)
    assert binary.to_pylist() == fixed.to_pylist()
    np.testing.assert_array_equal(fixed_binary_values(binary), data)
    np.testing.assert_array_equal(fixed_binary_values(as_binary(fixed.slice(7, 20))), data[7:27])
    np.testing.assert_array_equal(fixed_binary_values(binary.slice(3, 10)), data[3:13])
    np.testing.assert_array_equal(fixed_binary_values(pa.chunked_array([binary])), data)
    with pytest.raises(ValueError, match="different lengths"):
        fixed_binary_values(pa.array([b"ab", b"abc"], type=pa.binary()))
