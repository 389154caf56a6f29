"""Decoding quantized rows on the GPU that holds their table.

Why: a restore into CUDA tables that decodes on the CPU copies fp32 rows to the device (4 bytes
per value); decoded where the table lives, only the fused rows cross (a 4-bit row of 64
values: 36 bytes instead of 256). The values are exactly the CPU's (``device_kernels.py``'s
``decode_rows`` computes each as ``uniform_kernels.dequantize`` does, without fused
multiply-adds), so where a row was decoded never shows in the table.

Contract: :func:`decode_on_device` returns the float32 rows on ``device``, or None where this
path does not apply: codecs other than ``asymmetric``, ``symmetric`` and ``adaptive`` (a
subclass may decode otherwise) and the ``delta`` codec of one of them (a diff's changes: each
width group decodes as that width's codec, raw fp32 changes cross as they are, 3-bit groups
decode on the CPU), 3-bit codes (``_SERVED_BITS``), Triton not importable, a
device the kernels do not run on, or a Triton that failed to build or launch the kernel
(logged once; the process then decodes on the CPU). The caller then decodes on the CPU. The
fused bytes come from the codec's own reading of the column (``_payload_bytes``: Parquet's
decompression, or Huffman coding, on the host), are copied into page-locked memory and cross
asynchronously; the call returns once the kernel is queued on the current stream, which the
caller's writes into the table follow.

Test hook: with ``TRITON_INTERPRET=1`` in the environment when the kernels are first used,
Triton's interpreter runs them on CPU tensors (see ``device_encode.py``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import torch

from embckpt.codecs.adaptive import AdaptiveCodec
from embckpt.codecs.base import Codec, EncodedRows, codec_from_config
from embckpt.codecs.delta import RAW_BITS, DeltaCodec
from embckpt.codecs.device_encode import _kernels, is_available
from embckpt.codecs.packing import packed_width
from embckpt.codecs.transfer import host_copy, to_device
from embckpt.codecs.uniform import AsymmetricCodec, SymmetricCodec
from embckpt.errors import CodecError

log = logging.getLogger(__name__)

_SERVED = (AsymmetricCodec, SymmetricCodec, AdaptiveCodec)
#: Code widths decoded on the device: those whose codes never straddle a byte. Run on an H200
#: (Triton 3.6), the compiled kernel read 3-bit codes wrong where a row's columns fill the tile
#: (16 and 64 columns: each group's 7th and 8th codes shifted as its 1st and 2nd), while the
#: interpreter and every 2-, 4- and 8-bit case matched the CPU bit for bit; 3-bit rows decode on
#: the CPU until a kernel for them has passed the ``gpu`` test.
_SERVED_BITS = (2, 4, 8)
_BLOCK = 64  # rows per program
_INTERPRETED_BLOCK = 1024  # the interpreter's cost is per operation on a whole block


_failed: list[str] = []  # why the kernel could not run here (then the CPU decodes)


def serves(codec: Codec, device: torch.device) -> bool:
    """Whether :func:`decode_on_device` decodes ``codec``'s rows on ``device``."""
    if isinstance(codec, DeltaCodec):
        served = type(codec.whole) in _SERVED
    else:
        served = type(codec) in _SERVED and getattr(codec, "bits", None) in _SERVED_BITS
    return served and not _failed and is_available(device)


def decode_many_on_device(
    codec: Codec, items: Sequence[EncodedRows], num_cols: int, device: torch.device
) -> list[torch.Tensor] | None:
    """``codec.decode_many(items, num_cols)`` computed on ``device`` (a ``delta`` codec's
    batches decoded as one: one kernel per width); None where the device path does not apply
    (module doc)."""
    if not serves(codec, device):
        return None
    if isinstance(codec, DeltaCodec):
        return _deltas_on_device(codec, items, num_cols, device)
    decoded = []
    for encoded in items:
        values = decode_on_device(codec, encoded, num_cols, device)
        if values is None:  # the kernel failed (logged): the device path is off from here
            return None
        decoded.append(values)
    return decoded


def _deltas_on_device(
    codec: DeltaCodec, items: Sequence[EncodedRows], num_cols: int, device: torch.device
) -> list[torch.Tensor]:
    """A diff's changes decoded on ``device``, as ``DeltaCodec.decode_many`` decodes them on
    the CPU: zero for width-0 rows, each width group decoded by that width's codec (on the
    CPU for 3-bit groups, whose floats cross), raw changes copied as they are."""
    sizes, groups = codec.width_groups(items)
    out = torch.zeros((sum(sizes), num_cols), dtype=torch.float32, device=device)
    for group in groups:
        values = None
        if group.bits != RAW_BITS:
            width = codec.width_codec(group.bits)
            values = decode_on_device(width, group.inner(), num_cols, device)
        if values is None:  # raw changes, and 3-bit ones: from the CPU
            values = to_device(codec.decode_group(group, num_cols), device)
        out.index_copy_(0, to_device(group.rows, device), values)
    return list(torch.split(out, sizes))


def decode_on_device(
    codec: Codec,
    encoded: EncodedRows,
    num_cols: int,
    device: torch.device,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``codec.decode(encoded, num_cols)`` computed on ``device`` (float32 [n, num_cols]), into
    ``out`` if given (float32 rows of ``device`` with unit column stride: a run of a table's
    rows); None where the device path does not apply (module doc).

    Raises:
        CodecError: the payload does not match the codec's metadata.
    """
    kernels = _kernels()
    if kernels is None or not serves(codec, device):
        return None
    if isinstance(codec, DeltaCodec):
        (values,) = _deltas_on_device(codec, [encoded], num_cols, device)
        return values if out is None else out.copy_(values)
    assert isinstance(codec, AsymmetricCodec | SymmetricCodec)  # _SERVED
    dtype = encoded.metadata.get("param_dtype", "float16")
    if dtype not in ("float16", "float32"):
        raise CodecError(f"unknown param_dtype {dtype!r}")
    half = dtype == "float16"
    width = packed_width(num_cols, codec.bits)
    fused = codec._payload_bytes(encoded, width + codec._param_bytes(half))
    n = fused.shape[0]
    if out is None:
        out = torch.empty((n, num_cols), dtype=torch.float32, device=device)
    elif out.shape != (n, num_cols) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise CodecError(f"{n} rows of {num_cols} cannot decode into {tuple(out.shape)}")
    if n == 0:
        return out
    codes = host_copy(fused, device).to(device, non_blocking=True)
    block = _INTERPRETED_BLOCK if kernels.INTERPRETED else _BLOCK
    try:
        kernels.decode_rows[(-(-n // block),)](
            codes,
            out,
            n,
            codes.stride(0),
            out.stride(0),
            COLS=num_cols,
            COLS_P2=max(1, 1 << (num_cols - 1).bit_length()),
            BITS=codec.bits,
            WIDTH=width,
            HALF=half,
            BIAS_STORED=codec.bias_stored,
            BLOCK=block,
            enable_fp_fusion=False,
        )
    except Exception as exc:  # a Triton that cannot build the kernel: the CPU decodes
        _failed.append(f"{type(exc).__name__}: {exc}")
        log.warning("decoding on %s is off, the CPU decodes: %s", device, _failed[-1][:300])
        return None
    return out


def warm(codec: Codec, widths: Sequence[int], device: torch.device) -> None:
    """Compiles the decode kernels rows of ``codec`` with ``widths`` columns take on
    ``device`` (both parameter dtypes; for a ``delta`` codec its whole rows' and every code
    width of its changes), so that a restore does not compile them mid-way."""
    if not serves(codec, device):
        return
    base, bits = codec, [getattr(codec, "bits", 0)]
    if isinstance(codec, DeltaCodec):
        base, bits = codec.whole, list(_SERVED_BITS)
    generator = torch.Generator().manual_seed(0)  # the job's own RNG is left alone
    for dtype, width in itertools.product(("float16", "float32"), bits):
        variant = codec_from_config({**base.get_config(), "param_dtype": dtype, "bits": width})
        for cols in sorted(set(widths)):
            rows = torch.randn(8, cols, generator=generator)
            decode_on_device(variant, variant.encode(rows), cols, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
