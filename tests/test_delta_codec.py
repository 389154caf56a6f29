"""The ``delta`` codec: each row's change at the narrowest width that restores it within the
error a whole-row code at ``bits`` leaves; widths told apart by length alone."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from embckpt.codecs import DeltaCodec, EncodedRows, make_codec
from embckpt.codecs.delta import RAW_BITS, deltas_for
from embckpt.config import CheckpointConfig, codec_for
from embckpt.errors import CodecError


def _rows(n: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Trained-looking rows and a reference a few small updates behind (some rows far off)."""
    g = torch.Generator().manual_seed(seed)
    live = torch.randn(n, cols, generator=g) * 0.3
    reference = live - torch.randn(n, cols, generator=g) * 0.01
    reference[: n // 10] = torch.randn(n // 10, cols, generator=g)  # rows that moved a lot
    return live, reference


def _widths(encoded: EncodedRows) -> np.ndarray:
    column = encoded.columns["payload"]
    lengths = np.diff(np.frombuffer(column.buffers()[1], dtype=np.int32)[: len(column) + 1])
    by_length = {length: bits for bits, length in encoded.metadata["widths"]}
    return np.array([by_length.get(int(v), 0) for v in lengths])


@pytest.mark.parametrize("inner", ["adaptive", "asymmetric", "symmetric", "kmeans"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_no_row_restores_worse_than_a_whole_row_code(inner: str, bits: int) -> None:
    live, reference = _rows(512, 64)
    whole = make_codec(inner, {"bits": bits})
    codec = deltas_for(whole, "zstd")
    assert codec is not None
    restored = reference + codec.decode(codec.encode_delta(live, reference), 64)
    whole_error = (whole.decode(whole.encode(live), 64) - live).norm(dim=1)
    error = (restored - live).norm(dim=1)
    assert bool((error <= whole_error * (1 + 1e-5) + 1e-6).all())
    assert float(error.mean()) < float(whole_error.mean())


def test_rows_near_their_reference_cost_nothing_and_far_ones_pay() -> None:
    live, reference = _rows(400, 64)
    codec = DeltaCodec(make_codec("adaptive", {"bits": 4}).get_config())
    widths = _widths(codec.encode_delta(live, reference))
    assert (widths[:40] > 0).all()  # moved a lot: codes needed
    assert (widths[40:] < 4).mean() > 0.9  # small changes: narrower than the whole-row code
    unchanged = codec.encode_delta(live, live)
    assert (_widths(unchanged) == 0).all()
    assert codec.decode(unchanged, 64).abs().max() == 0


def test_changes_no_code_can_hold_are_stored_exactly() -> None:
    # Constant rows: a whole-row code is exact, so the change must be too.
    live = torch.full((6, 16), 0.25)
    reference = torch.randn(6, 16)
    codec = DeltaCodec(make_codec("asymmetric", {"bits": 4}).get_config())
    encoded = codec.encode_delta(live, reference)
    assert (_widths(encoded) == RAW_BITS).all()
    assert torch.equal(codec.decode(encoded, 16), live - reference)


@pytest.mark.parametrize("cols", [1, 2, 3, 5, 8])
def test_short_rows_round_trip(cols: int) -> None:
    live, reference = _rows(64, cols, seed=cols)
    codec = DeltaCodec(make_codec("adaptive", {"bits": 4}).get_config())
    encoded = codec.encode_delta(live, reference)
    lengths = [length for _, length in encoded.metadata["widths"]]
    assert len(set(lengths)) == len(lengths)
    whole = codec.whole
    whole_error = (whole.decode(whole.encode(live), cols) - live).norm(dim=1)
    error = (reference + codec.decode(encoded, cols) - live).norm(dim=1)
    assert bool((error <= whole_error * (1 + 1e-5) + 1e-6).all())


def test_a_file_rebuilds_the_codec_and_rejects_unknown_lengths() -> None:
    live, reference = _rows(128, 32)
    codec = deltas_for(make_codec("adaptive", {"bits": 3}), "none")
    assert codec is not None
    encoded = codec.encode_delta(live, reference)
    again = make_codec("delta", {k: v for k, v in codec.get_config().items() if k != "id"})
    assert torch.equal(again.decode(encoded, 32), codec.decode(encoded, 32))
    assert again.get_config()["bits"] == 3
    bad = pa.array([b"\x01\x02\x03"] * 4, type=pa.binary())
    with pytest.raises(CodecError, match="match no width"):
        codec.decode(EncodedRows({"payload": bad}, encoded.metadata), 32)


def test_the_config_wraps_quantizers_only() -> None:
    assert codec_for(CheckpointConfig(codec="adaptive", bits=4)).codec_id == "delta"
    assert codec_for(CheckpointConfig(codec="kmeans", bits=2)).codec_id == "delta"
    assert codec_for(CheckpointConfig(codec="adaptive", bits=4, diff_deltas=False)).codec_id == (
        "adaptive"
    )
    for lossless_or_delta in ("raw", "fp16", "exponent"):
        assert codec_for(CheckpointConfig(codec=lossless_or_delta)).codec_id == lossless_or_delta


def test_a_split_writes_rows_whole_where_their_change_needs_more_than_bits() -> None:
    live, reference = _rows(400, 64)
    reference[:40] = -live[:40]  # changes twice as wide as the rows: no 4-bit delta holds them
    codec = DeltaCodec(make_codec("adaptive", {"bits": 4}).get_config())
    split = codec.encode_split(live, reference)
    assert split.whole is not None
    assert set(range(40)) <= set(split.whole_rows.tolist())
    assert sorted([*split.delta_rows.tolist(), *split.whole_rows.tolist()]) == list(range(400))
    assert all(bits <= 4 for bits, _ in split.delta.metadata["widths"])
    restored = live.clone()
    restored[split.delta_rows] = reference[split.delta_rows] + codec.decode(split.delta, 64)
    restored[split.whole_rows] = codec.whole.decode(split.whole, 64)
    whole = codec.whole
    whole_error = (whole.decode(whole.encode(live), 64) - live).norm(dim=1)
    assert bool(((restored - live).norm(dim=1) <= whole_error * (1 + 1e-5) + 1e-6).all())
