"""Optimizer state through a lossy state codec (``optimizer_codec="log8"``): log8's round trip
within its relative-error bound (zeros and the batch's extremes exact, non-negative and signed
batches, empty batches, NaN and infinities refused); row-wise states stored as log8 columns,
and exactly as before under the lossless default; an additive codec refused for them; a
checkpoint of the toy model saved with log8 restores its states within the bound, its weights
bit for bit, and merges without quantizing the states again (2 ranks)."""

from __future__ import annotations

import json
import math
from typing import Any

import delta_codec  # noqa: F401  (registers test_delta, an additive codec)
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from codec_roundtrip import encoded_bytes_per_row, round_trip

from embckpt.codecs import codec_from_config, make_codec
from embckpt.codecs.base import EncodedRows
from embckpt.codecs.log8 import decode_tables, max_relative_error
from embckpt.errors import CodecError, ConfigError
from embckpt.storage.rowfile_read import decode_file, row_state_values
from embckpt.storage.rowfile_write import encode_file, row_state_columns

OCTAVES = 30.0


def _states(shape: tuple[int, ...], signed: bool, seed: int = 0) -> torch.Tensor:
    """Log-uniform magnitudes over ``OCTAVES`` octaves (as Adagrad accumulators of rarely and
    often seen rows spread), every 7th value zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp2(torch.rand(shape, generator=g) * OCTAVES - 20.0)
    if signed:
        x *= torch.randn(shape, generator=g).sign()
    x.view(-1)[::7] = 0.0
    return x


def _relative_errors(decoded: torch.Tensor, x: torch.Tensor) -> np.ndarray:
    nonzero = x != 0
    return ((decoded.double() - x.double()).abs() / x.double().abs())[nonzero].numpy()


def _bound(x: torch.Tensor, signed: bool) -> float:
    """log8's bound computed from the values themselves: half a grid step, in octaves."""
    magnitude = x.abs()[x != 0].double()
    octaves = math.log2(float(magnitude.max())) - math.log2(float(magnitude.min()))
    return 2.0 ** (octaves / (126 if signed else 254) / 2) - 1


# -- the log8 codec ---------------------------------------------------------------------------


@pytest.mark.parametrize("signed", [False, True], ids=["non-negative", "signed"])
@pytest.mark.parametrize("entropy", ["none", "zstd"])
def test_log8_round_trip_within_relative_bound(signed: bool, entropy: str) -> None:
    x = _states((400, 8), signed)
    codec = make_codec("log8", {"entropy": entropy})
    decoded = round_trip(codec, x)  # through a Parquet file, codec rebuilt from its metadata
    bound = _bound(x, signed)
    # The codec's own bound adds fp32 rounding (the logs, the decoded value): 1e-4 of it here.
    stated = max_relative_error(codec.encode(x).metadata)
    assert bound < stated < bound * 1.0001
    # 30 octaves: 4.2% on 255 levels, 8.6% on 127 (the sign takes a bit).
    assert bound == pytest.approx(0.0418 if not signed else 0.0860, abs=5e-4)
    errors = _relative_errors(decoded, x)
    assert errors.max() <= stated
    assert errors.max() > 0.9 * bound  # the bound is what values get, not a loose ceiling
    assert torch.equal(decoded[x == 0], torch.zeros(int((x == 0).sum())))
    assert torch.equal(decoded.sign(), x.sign())
    # The smallest and largest magnitudes are grid points: exact.
    magnitude = x.abs()
    for extreme in (magnitude[x != 0].min(), magnitude.max()):
        assert torch.equal(decoded.abs()[magnitude == extreme], magnitude[magnitude == extreme])


def test_log8_takes_one_byte_per_value() -> None:
    x = _states((300, 8), signed=False)
    encoded = make_codec("log8").encode(x)
    assert encoded.columns["payload"].type == pa.binary(8)
    assert encoded_bytes_per_row(encoded) == 8


@pytest.mark.parametrize(
    "x",
    [
        torch.zeros(0, 4),
        torch.zeros(5, 3),
        torch.full((6, 2), 0.37),
        torch.tensor([[2.5e-6]]),
        torch.tensor([[-3.0, 0.0, 3.0]]),
    ],
    ids=["empty", "zeros", "constant", "one-value", "opposite-signs"],
)
def test_log8_edge_batches_are_exact(x: torch.Tensor) -> None:
    decoded = round_trip(make_codec("log8"), x)
    assert decoded.shape == x.shape
    assert torch.equal(decoded, x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_log8_refuses_nan_and_inf(bad: float) -> None:
    x = _states((30, 4), signed=False)
    x[17, 2] = bad
    with pytest.raises(CodecError, match="row 17"):
        make_codec("log8").encode(x)


def test_log8_decode_refuses_metadata_without_its_range() -> None:
    codec = make_codec("log8")
    encoded = codec.encode(_states((10, 2), signed=False))
    for broken in ({"log2_min": None}, {"signed": "no"}, {"log2_min": 5.0, "log2_max": 1.0}):
        bad = EncodedRows(columns=encoded.columns, metadata={**encoded.metadata, **broken})
        with pytest.raises(CodecError, match="log8"):
            codec.decode(bad, 2)


@pytest.mark.parametrize("entropy", ["none", "huffman"])
def test_log8_decode_many_equals_each_decode(entropy: str) -> None:
    """Batches of different ranges, signed and not, one of them in two chunks, decoded by one
    lookup (a chain's row-wise states), give each batch's own decode bit for bit."""
    codec = make_codec("log8", {"entropy": entropy})
    batches = [_states((n, 1), signed=n % 2 == 1, seed=n) * 2.0**n for n in (40, 1, 33, 0, 64)]
    items = [codec.encode(x) for x in batches]
    split = items[0].columns["payload"]
    items[0] = EncodedRows(
        columns={"payload": pa.chunked_array([split[:15], split[15:]])},
        metadata=items[0].metadata,
    )
    together = codec.decode_many(items, 1)
    assert len({json.dumps(i.metadata, sort_keys=True) for i in items}) >= 4  # ranges differ
    for item, decoded in zip(items, together, strict=True):
        assert torch.equal(decoded.view(torch.int32), codec.decode(item, 1).view(torch.int32))


def test_log8_tables_built_together_are_each_linspace_grid() -> None:
    """The code tables of many batches, built in one pass, are each batch's grid as
    ``np.linspace`` gives it, bit for bit: signed and not, zero and tiny ranges."""
    rng = np.random.default_rng(3)
    metas = [{"signed": False, "log2_min": 0.0, "log2_max": 0.0}]
    metas.append({"signed": True, "log2_min": -3.5, "log2_max": -3.5})
    metas.append({"signed": False, "log2_min": -7.0, "log2_max": float(np.nextafter(-7.0, 0))})
    for _ in range(300):
        lo = float(rng.uniform(-80, 20))
        metas.append(
            {"signed": bool(rng.integers(2)), "log2_min": lo, "log2_max": lo + 40 * rng.random()}
        )
    tables = decode_tables(metas)
    for meta, table in zip(metas, tables, strict=True):
        levels = 127 if meta["signed"] else 255
        grid = np.exp2(np.linspace(meta["log2_min"], meta["log2_max"], levels))
        magnitudes = np.concatenate([[0.0], grid])
        if meta["signed"]:
            magnitudes = np.concatenate([magnitudes, -magnitudes])
        assert np.array_equal(table.view(np.int32), magnitudes.astype(np.float32).view(np.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_log8_encodes_on_the_tensors_device_alike() -> None:
    x = _states((500, 8), signed=True)
    codec = make_codec("log8")
    on_cpu, on_gpu = codec.encode(x), codec.encode(x.cuda())
    assert on_cpu.metadata == on_gpu.metadata
    assert on_cpu.columns["payload"].equals(on_gpu.columns["payload"])


# -- row-wise states in rows files -----------------------------------------------------------


def _file(row_states: dict, n: int, state_codec: str = "raw") -> pa.Buffer:
    raw = make_codec("raw")
    weights = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4)
    return encode_file(
        rows=np.arange(n, dtype=np.int64),
        encoded=raw.encode(weights),
        row_states=row_states,
        elem_states={},
        metadata={"codec": raw.get_config(), "state_codec": make_codec(state_codec).get_config()},
        row_group_rows=64,
    )


def _column_bytes(data: pa.Buffer, name: str) -> int:
    meta = pq.read_metadata(pa.BufferReader(data))
    column = meta.schema.names.index(name)
    groups = (meta.row_group(g) for g in range(meta.num_row_groups))
    return sum(g.column(column).total_uncompressed_size for g in groups)


def test_lossless_state_codec_writes_the_plain_state_column_as_before() -> None:
    momentum = _states((300,), signed=False)
    stored = row_state_columns(make_codec("raw"), {"momentum1": momentum})
    data = _file(stored, 300)
    # Byte for byte the file the writer made before state codecs applied to row-wise states.
    assert data.to_pybytes() == _file({"momentum1": momentum.numpy()}, 300).to_pybytes()
    schema = pq.read_schema(pa.BufferReader(data))
    assert schema.names == ["row", "table", "col", "payload", "state.momentum1"]
    assert schema.field("state.momentum1").type == pa.float32()
    assert b"state_meta" not in schema.metadata[b"embckpt"]
    batch = decode_file(data, "f.parquet", 0, 300)
    assert np.array_equal(batch.row_states["momentum1"], momentum.numpy())


def test_log8_row_states_are_one_byte_columns_decoded_within_bound() -> None:
    momentum = _states((300,), signed=False)
    codec = make_codec("log8")
    data = _file(row_state_columns(codec, {"momentum1": momentum}), 300, "log8")
    schema = pq.read_schema(pa.BufferReader(data))
    assert schema.names == ["row", "table", "col", "payload", "state.momentum1.payload"]
    assert schema.field("state.momentum1.payload").type == pa.binary(1)
    plain = _file({"momentum1": momentum.numpy()}, 300)
    assert _column_bytes(data, "state.momentum1.payload") * 3 < _column_bytes(
        plain, "state.momentum1"
    )
    batch = decode_file(data, "f.parquet", 100, 250)  # a row range: rows 100..249
    assert batch.header["state_meta"]["momentum1"]["signed"] is False
    values = row_state_values(batch, codec_from_config(batch.header["state_codec"]))
    assert values["momentum1"].dtype == np.float32
    truth = momentum[100:250]
    errors = _relative_errors(torch.from_numpy(values["momentum1"]), truth)
    assert errors.max() <= max_relative_error(batch.header["state_meta"]["momentum1"])
    assert errors.max() < _bound(momentum, signed=False) * 1.0001
    assert np.array_equal(
        values["momentum1"][truth.numpy() == 0], np.zeros(int((truth == 0).sum()))
    )


@pytest.mark.parametrize("codec", ["exponent", "test_delta"])
def test_additive_state_codecs_are_refused_by_the_config(codec: str) -> None:
    from embckpt import CheckpointConfig

    with pytest.raises(ConfigError, match=f"optimizer_codec '{codec}' is additive"):
        CheckpointConfig(optimizer_codec=codec)
    CheckpointConfig(codec=codec)  # as the row codec, they are what diffs are made of


# -- a checkpoint saved with optimizer_codec="log8" (2 ranks) --------------------------------

STEPS = (2, 4, 6)  # a full, then incremental diffs


def _save_restore_merge(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import torch.distributed as dist
    import toy_model as tm
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from embckpt import CheckpointConfig, Checkpointer
    from embckpt.read.merge import merge
    from embckpt.storage.chain import read_chain
    from embckpt.storage.fs import CheckpointStore

    out: dict[str, Any] = {}
    config = CheckpointConfig(
        policy="incremental", full_every=0, optimizer_codec="log8", fsync=False
    )
    for name, optimizer in (
        ("rowwise", EmbOptimType.EXACT_ROWWISE_ADAGRAD),
        ("adagrad", EmbOptimType.EXACT_ADAGRAD),
    ):
        directory = f"{root}/{name}"
        model, opt = tm.build(world_size, seed=0, optimizer=optimizer)
        with Checkpointer(model, directory, optimizer=opt, config=config) as ckpt:
            for step in range(1, STEPS[-1] + 1):
                tm.train_step(model, opt, step, rank, hot=120)
                if step in STEPS:
                    ckpt.save(step).wait()
            truth = tm.snapshot_state(model, opt, rank)
        fresh, fresh_opt = tm.build(world_size, seed=7, optimizer=optimizer)
        with Checkpointer(fresh, directory, optimizer=fresh_opt, config=config) as ckpt:
            ckpt.restore(STEPS[-1])
            restored = tm.snapshot_state(fresh, fresh_opt, rank)
        state_metas: dict[str, list] = {}
        if rank == 0:
            store = CheckpointStore(directory)
            state_metas["chain"] = _state_metas(store, read_chain(store, STEPS[-1]))
            state_metas["merged"] = _state_metas(store, [merge(store, STEPS[-1])])
        dist.barrier()
        with Checkpointer(fresh, directory, optimizer=fresh_opt, config=config) as ckpt:
            ckpt.restore(STEPS[-1])
            after_merge = tm.snapshot_state(fresh, fresh_opt, rank)
        out[name] = {
            "truth": {k: v.numpy() for k, v in truth.items()},
            "restored": {k: v.numpy() for k, v in restored.items()},
            "merge_diff": tm.differences(restored, after_merge),
            "state_metas": state_metas,
        }
    return out


def _state_columns(batch: Any) -> list[str]:
    """A batch's optimizer-state column names, as stored."""
    names = []
    for name, values in batch.row_states.items():
        if isinstance(values, np.ndarray):
            names.append(f"state.{name}")
        else:
            names.extend(f"state.{name}.{c}" for c in values.columns)
    for name, state in batch.elem_states.items():
        names.extend(f"elem.{name}.{c}" for c in state.columns)
    return names


def _state_metas(store: Any, manifests: list) -> list:
    """The ``state_meta``, ``elem_meta`` and column names of every rows file of ``manifests``."""
    metas = []
    for manifest in manifests:
        for entry in manifest.files:
            if entry.role != "rows":
                continue
            checked = store.open_rows(manifest.step, entry, None)  # a packed file's block too
            batch = checked.read_all()
            checked.close()
            metas.append(
                {
                    "state": batch.header.get("state_meta", {}),
                    "elem": batch.header["elem_meta"],
                    "columns": ["row", *batch.encoded.columns, *_state_columns(batch)],
                }
            )
    return metas


@pytest.fixture(scope="module")
def log8_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from embckpt.examples.launcher import run_ranks

    return run_ranks(_save_restore_merge, 2, str(tmp_path_factory.mktemp("log8")))


@pytest.mark.parametrize("name", ["rowwise", "adagrad"])
def test_log8_checkpoint_restores_states_within_bound(log8_runs, name: str) -> None:
    # A state comes from one file of the chain; that file's grid spans its own values (an
    # older file's smaller accumulators included): the widest grid of the chain bounds all.
    files = log8_runs[0][name]["state_metas"]["chain"]
    bound = max(max_relative_error(m) for f in files for m in (f["state"] or f["elem"]).values())
    assert 0 < bound < 0.05
    checked = 0
    for out in log8_runs:
        truth, restored = out[name]["truth"], out[name]["restored"]
        assert set(truth) == set(restored)
        for key, value in truth.items():
            got = restored[key]
            if not key.startswith("s:"):  # weights (raw), dense state: bit for bit
                assert np.array_equal(got, value), key
                continue
            x = torch.from_numpy(value)
            assert np.array_equal(got[value == 0], value[value == 0]), key
            if (x != 0).any():
                errors = _relative_errors(torch.from_numpy(got), x)
                assert errors.max() <= bound, key
                assert errors.max() > 0, key  # quantized, not stored as is
                checked += 1
    assert checked


@pytest.mark.parametrize("name", ["rowwise", "adagrad"])
def test_log8_states_are_stored_by_the_state_codec(log8_runs, name: str) -> None:
    metas = log8_runs[0][name]["state_metas"]["chain"]
    prefix = "state." if name == "rowwise" else "elem."
    for meta in metas:  # data-parallel tables' files hold no state (the dense optimizer's)
        columns = [c for c in meta["columns"] if c.startswith(("state.", "elem."))]
        assert all(c.startswith(prefix) and c.endswith(".payload") for c in columns), meta
        coded = meta["state"] if name == "rowwise" else meta["elem"]
        assert {c.split(".")[1] for c in columns} == set(coded), meta
        assert all("log2_min" in m for m in coded.values()), meta
    assert any(meta["state"] or meta["elem"] for meta in metas)


@pytest.mark.parametrize("name", ["rowwise", "adagrad"])
def test_merge_keeps_log8_states_as_encoded(log8_runs, name: str) -> None:
    runs = log8_runs[0][name]["state_metas"]
    for out in log8_runs:
        assert out[name]["merge_diff"] == [], out[name]["merge_diff"][:5]
    # Each merged file carries a source file's metadata: its states were copied, not quantized
    # again over the merged file's rows (another range, another grid).
    sources = [m["state"] or m["elem"] for m in runs["chain"]]
    coded_files = 0
    for meta in runs["merged"]:
        coded = meta["state"] or meta["elem"]
        columns = [c for c in meta["columns"] if c.startswith(("state.", "elem."))]
        assert all(c.endswith(".payload") for c in columns), meta  # still log8 columns
        assert bool(columns) == bool(coded), meta
        assert coded in sources, meta
        coded_files += bool(coded)
    assert coded_files
