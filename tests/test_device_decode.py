"""The GPU decoder (codecs/device_decode.py) gives exactly the CPU decode, and a restore into
blocks where rows decode on their device equals one that decodes them on the CPU.

Without a CUDA device, Triton's interpreter runs the kernel on CPU tensors (conftest.py turns
it on); with CUDA, the ``gpu`` test runs the compiled kernel. Every test needs Triton, which
the project does not require, and skips without it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # conftest.py turned it on already, before triton loaded
    os.environ.setdefault("TRITON_INTERPRET", "1")

from embckpt.codecs import Codec, make_codec  # noqa: E402
from embckpt.codecs.delta import RAW_BITS, DeltaCodec  # noqa: E402
from embckpt.codecs.device_decode import (  # noqa: E402
    decode_many_on_device,
    decode_on_device,
    serves,
)
from embckpt.codecs.device_encode import is_available  # noqa: E402
from embckpt.errors import CodecError  # noqa: E402

CODECS = ("asymmetric", "symmetric", "adaptive")
BITS = (2, 4, 8)  # 3-bit codes decode on the CPU (device_decode._SERVED_BITS)
INTERPRETED = is_available(torch.device("cpu"))
interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="needs triton and its interpreter (TRITON_INTERPRET=1)"
)


def _rows(n: int, cols: int, seed: int, wide: bool = False) -> torch.Tensor:
    """Rows of many scales (``wide``: beyond what fp16 parameters hold), a zero row and a
    constant one: every parameter path."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-6, 6, n) if wide else torch.logspace(-1, 2, n)
    rows = torch.randn(n, cols, generator=g) * scales[:, None]
    rows[0] = 0.0
    rows[1] = 0.25
    return rows


def _assert_as_on_cpu(codec: Codec, rows: torch.Tensor, device: torch.device) -> bool:
    """Whether the rows were checked: False where the CPU codec refuses them (fp16
    parameters that cannot hold them), so there is nothing to decode."""
    cols = rows.shape[1]
    try:
        encoded = codec.encode(rows)
    except CodecError:
        return False
    expected = codec.decode(encoded, cols)
    got = decode_on_device(codec, encoded, cols, device)
    assert got is not None and got.device.type == device.type
    assert torch.equal(got.cpu().view(torch.int32), expected.view(torch.int32)), (
        codec.get_config(),
        cols,
    )
    return True


@interpreted
@pytest.mark.parametrize("name", CODECS)
def test_interpreted_kernel_decodes_as_the_cpu(name: str) -> None:
    cpu = torch.device("cpu")
    for bits in BITS:
        for param_dtype in ("float16", "float32"):
            for entropy in ("none", "huffman"):
                options = {"bits": bits, "param_dtype": param_dtype, "entropy": entropy}
                codec = make_codec(name, options)
                for cols in (1, 3, 16, 37):
                    rows = _rows(50, cols, seed=cols + bits, wide=param_dtype == "float32")
                    assert _assert_as_on_cpu(codec, rows, cpu)


def _changes(cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Live rows and their reference whose changes take every width a delta has: none, 2 to
    8 bits, and raw (constant live rows leave no error budget)."""
    g = torch.Generator().manual_seed(seed)
    reference = torch.randn(300, cols, generator=g)
    live = reference + torch.randn(300, cols, generator=g) * torch.logspace(-7, 1, 300)[:, None]
    live[::10] = 0.25
    return live, reference


def _assert_deltas_as_on_cpu(param_dtype: str, cols: int, device: torch.device) -> None:
    """A diff's changes, in three batches decoded as one, equal the CPU's bit for bit; every
    width is among them (3-bit groups decode on the CPU inside the device path)."""
    codec = DeltaCodec({"id": "adaptive", "bits": 4, "param_dtype": param_dtype})
    items = [codec.encode_delta(*_changes(cols, seed)) for seed in range(3)]
    sizes, groups = codec.width_groups(items)
    widths = {g.bits for g in groups}
    assert {2, 4, 8, RAW_BITS} <= widths and (cols < 16 or 3 in widths)  # 3 packs as 4 below
    assert sum(len(g.rows) for g in groups) < sum(sizes)  # width-0 rows too
    expected = codec.decode_many(items, cols)
    got = decode_many_on_device(codec, items, cols, device)
    assert got is not None and len(got) == 3
    for a, b in zip(got, expected, strict=True):
        assert a.device.type == device.type
        assert torch.equal(a.cpu().view(torch.int32), b.view(torch.int32)), (param_dtype, cols)
    single = decode_on_device(codec, items[1], cols, device)
    assert single is not None and torch.equal(single.cpu(), expected[1])


@interpreted
def test_interpreted_delta_changes_decode_as_the_cpu() -> None:
    for param_dtype in ("float16", "float32"):
        for cols in (3, 16, 37):
            _assert_deltas_as_on_cpu(param_dtype, cols, torch.device("cpu"))


@interpreted
def test_warm_compiles_every_width_a_delta_codec_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    """A save's codec of deltas (the default for quantizers) warms its whole rows' kernel and
    every served width of its changes, both parameter dtypes; a plain codec only its own."""
    from embckpt.codecs import device_decode

    seen: list[tuple[int, str, int]] = []

    def recorded(codec: Codec, encoded: object, cols: int, device: torch.device) -> None:
        seen.append((codec.bits, codec.get_config()["param_dtype"], cols))  # type: ignore[attr-defined]

    monkeypatch.setattr(device_decode, "decode_on_device", recorded)
    cpu = torch.device("cpu")
    device_decode.warm(make_codec("delta", {"inner": {"id": "adaptive", "bits": 4}}), [8, 8], cpu)
    dtypes = ("float16", "float32")
    assert sorted(seen) == sorted((b, d, 8) for b in (2, 4, 8) for d in dtypes)
    seen.clear()
    device_decode.warm(make_codec("symmetric", {"bits": 8}), [3, 16], cpu)
    assert sorted(seen) == sorted((8, d, c) for d in dtypes for c in (3, 16))


@interpreted
def test_decodes_into_a_run_of_a_block_and_declines_other_codecs() -> None:
    cpu = torch.device("cpu")
    codec = make_codec("adaptive", {"bits": 4})
    rows = _rows(20, 8, seed=1)
    block = torch.full((30, 8), 5.0)
    assert decode_on_device(codec, codec.encode(rows), 8, cpu, block[4:24]) is not None
    assert torch.equal(block[4:24], codec.decode(codec.encode(rows), 8))
    assert (block[:4] == 5).all() and (block[24:] == 5).all()
    declined = [make_codec(other) for other in ("raw", "log8", "kmeans")]
    declined += [make_codec(name, {"bits": 3}) for name in CODECS]
    declined += [make_codec("delta", {"inner": {"id": "kmeans", "bits": 4}})]
    for plain in declined:
        assert not serves(plain, cpu)
        assert decode_on_device(plain, plain.encode(rows), 8, cpu) is None


@interpreted
def test_restore_decoding_on_the_device_writes_the_cpu_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chain's 4-bit full (several row groups, whole runs of its block and masked rows) and
    its diffs (the chain pass: whole rows and delta changes decoded on the device), restored
    with the device path taken for CPU blocks (the interpreter), equals the plain CPU restore,
    cell for cell."""
    from test_chain_pass import ROWS, _shard, _write_chain

    from embckpt.read import cells
    from embckpt.read import chain_pass as chain_pass_module
    from embckpt.read.apply import read_into
    from embckpt.storage.chain import read_chain
    from embckpt.storage.fs import CheckpointStore

    _write_chain(tmp_path, links=3, seed=4, full_codec=make_codec("adaptive", {"bits": 4}))
    store = CheckpointStore(tmp_path)
    chain = read_chain(store, None)
    plain = _shard()
    read_into(store, chain, [plain], threads=2)
    taken, in_chain_pass = [], []

    def decodes(codec: Codec, device: torch.device) -> bool:
        taken.append(type(codec).__name__)
        return serves(codec, device)

    def counted(*args: object) -> list[torch.Tensor] | None:
        in_chain_pass.append(type(args[0]).__name__)
        return decode_many_on_device(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(cells, "device_decodes", decodes)
    monkeypatch.setattr(chain_pass_module, "decode_many_on_device", counted)
    on_device = _shard()
    read_into(store, chain, [on_device], threads=2)
    assert "AdaptiveCodec" in taken
    # The diffs' whole rows and their changes, each kind as one group along the chain (the
    # full decodes in apply.py).
    assert sorted(in_chain_pass) == ["AdaptiveCodec", "DeltaCodec"]
    assert torch.equal(on_device.weight.view(torch.int32), plain.weight.view(torch.int32))
    assert on_device.weight.shape[0] == ROWS


compiled_on_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or not is_available(torch.device("cuda")) or INTERPRETED,
    reason="needs a CUDA device and triton, with its interpreter off",
)


@pytest.mark.gpu
@compiled_on_cuda
def test_cuda_kernel_decodes_as_the_cpu() -> None:
    """Every served codec, width and parameter dtype over column counts that fill the tile
    (16, 64, 128: the case where 3-bit codes were read wrong) and ones that do not."""
    cuda = torch.device("cuda")
    checked = 0
    for name in CODECS:
        for bits in BITS:
            for param_dtype in ("float16", "float32"):
                codec = make_codec(name, {"bits": bits, "param_dtype": param_dtype})
                for cols in (1, 8, 16, 24, 37, 64, 128):
                    rows = _rows(4096, cols, seed=cols, wide=param_dtype == "float32")
                    checked += _assert_as_on_cpu(codec, rows, cuda)
    assert checked == len(CODECS) * len(BITS) * 2 * 7 - 2  # symmetric fp16 refuses 1 column


@pytest.mark.gpu
@compiled_on_cuda
def test_cuda_delta_changes_decode_as_the_cpu() -> None:
    for param_dtype in ("float16", "float32"):
        for cols in (3, 16, 37, 64, 128):
            _assert_deltas_as_on_cpu(param_dtype, cols, torch.device("cuda"))


@pytest.mark.gpu
@compiled_on_cuda
def test_restore_into_cuda_blocks_writes_the_cpu_bytes(tmp_path: Path) -> None:
    """The chain above restored into blocks on the GPU (its 4-bit rows cross as codes and
    decode there, its diffs add there) holds the CPU restore's bytes, weights and row states."""
    from test_chain_pass import STATE, _shard, _write_chain

    from embckpt.read.apply import read_into
    from embckpt.read.cells import device_decodes
    from embckpt.storage.chain import read_chain
    from embckpt.storage.fs import CheckpointStore

    _write_chain(tmp_path, links=3, seed=4, full_codec=make_codec("adaptive", {"bits": 4}))
    store = CheckpointStore(tmp_path)
    chain = read_chain(store, None)
    plain = _shard()
    read_into(store, chain, [plain], threads=2)
    on_gpu = _shard("cuda")
    assert device_decodes(make_codec("adaptive", {"bits": 4}), on_gpu.weight.device)
    read_into(store, chain, [on_gpu], threads=2)
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.weight.cpu().view(torch.int32), plain.weight.view(torch.int32))
    assert torch.equal(on_gpu.row_states[STATE].cpu(), plain.row_states[STATE])


def test_a_kernel_that_fails_turns_the_device_path_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Triton that cannot build the kernel (no GPU needed: a stand-in kernel raises) gives
    None, logged, and the device path stays off for the process: the CPU decodes."""
    from types import SimpleNamespace

    from embckpt.codecs import device_decode

    def launch(*args: object, **kwargs: object) -> None:
        raise RuntimeError("PTX assembly failed")

    kernels = SimpleNamespace(INTERPRETED=True, decode_rows={(1,): launch})
    monkeypatch.setattr(device_decode, "_kernels", lambda: kernels)
    monkeypatch.setattr(device_decode, "is_available", lambda device: True)
    monkeypatch.setattr(device_decode, "_failed", [])
    codec = make_codec("adaptive", {"bits": 4})
    cpu = torch.device("cpu")
    assert serves(codec, cpu)
    encoded = codec.encode(torch.randn(5, 8))
    assert device_decode.decode_on_device(codec, encoded, 8, cpu) is None
    assert not device_decode.serves(codec, cpu)
    assert "PTX assembly failed" in device_decode._failed[0]
