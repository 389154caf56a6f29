"""Row codecs: the ``Codec`` contract, its registry, and the built-in codecs.

- ``raw``: the row's bytes, bit-exact (the default).
- ``fp16``, ``bf16``: 16-bit floats, the cheap lossy baselines.
- ``asymmetric``: 2/3/4/8-bit codes over each row's [min, max], fp16 scale and bias (FBGEMM's
  fused row format).
- ``symmetric``: codes over [-max|x|, max|x|] with 0 exact; fp16 scale only.
- ``adaptive``: as ``asymmetric``, over a clipping range searched per row (Check-N-Run).
- ``kmeans``: codes into a codebook shared by the batch, fp16 scale and bias per row.
- ``exponent``: sign/exponent bucket symbols of a delta (LC-Checkpoint); a ``delta`` codec.

Every codec takes ``entropy`` (``none``, ``huffman``, ``zstd`` or ``lz4``), the stage that
compresses its payload bytes; see ``common.py``. :func:`codec_for` builds the codec a
``CheckpointConfig`` names.
"""

from typing import Any

from embckpt.codecs import adaptive, exponent, floats, kmeans, uniform
from embckpt.codecs.base import (
    Codec,
    EncodedRows,
    codec_from_config,
    make_codec,
    register,
)
from embckpt.codecs.raw import RawCodec
from embckpt.config import CheckpointConfig
from embckpt.errors import ConfigError

AdaptiveCodec = adaptive.AdaptiveCodec
AsymmetricCodec = uniform.AsymmetricCodec
Bf16Codec = floats.Bf16Codec
ExponentCodec = exponent.ExponentCodec
Fp16Codec = floats.Fp16Codec
KMeansCodec = kmeans.KMeansCodec
SymmetricCodec = uniform.SymmetricCodec


def codec_for(config: CheckpointConfig) -> Codec:
    """The row codec a checkpoint configuration asks for.

    ``config.codec`` names the codec; ``config.codec_options`` are its keyword options;
    ``config.bits`` and ``config.entropy`` (unless ``"auto"``) are added to them as ``bits`` and
    ``entropy``. ``entropy="auto"`` leaves the codec's own default: the stage measured best for
    it (see each codec's signature and benchmarks/results/codecs.json).

    Raises:
        ConfigError: ``bits`` or ``entropy`` conflict with the same key in ``codec_options``, or
            the codec does not take an option (e.g. ``bits`` for ``raw``) or rejects its value.
        UnknownCodecError: no codec is registered under ``config.codec``.
    """
    options: dict[str, Any] = dict(config.codec_options)
    given = {"bits": config.bits, "entropy": None if config.entropy == "auto" else config.entropy}
    for name, value in given.items():
        if value is None:
            continue
        if name in options and options[name] != value:
            raise ConfigError(
                f"codec {config.codec!r}: {name}={value!r} conflicts with "
                f"codec_options[{name!r}]={options[name]!r}"
            )
        options[name] = value
    return make_codec(config.codec, options)


__all__ = [
    "AdaptiveCodec",
    "AsymmetricCodec",
    "Bf16Codec",
    "Codec",
    "EncodedRows",
    "ExponentCodec",
    "Fp16Codec",
    "KMeansCodec",
    "RawCodec",
    "SymmetricCodec",
    "codec_for",
    "codec_from_config",
    "make_codec",
    "register",
]
