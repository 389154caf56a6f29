"""Row codecs: the ``Codec`` contract, its registry, and the built-in codecs.

- ``raw``: the row's bytes, bit-exact (the default).
- ``fp16``, ``bf16``: 16-bit floats, the cheap lossy baselines.
- ``asymmetric``: 2/3/4/8-bit codes over each row's [min, max], fp16 scale and bias (FBGEMM's
  fused row format).
- ``symmetric``: codes over [-max|x|, max|x|] with 0 exact; fp16 scale only.
- ``adaptive``: as ``asymmetric``, over a clipping range searched per row (Check-N-Run).
- ``kmeans``: codes into a codebook shared by the batch, fp16 scale and bias per row.
- ``exponent``: sign/exponent bucket symbols of a delta (LC-Checkpoint); a ``delta`` codec.
- ``log8``: one byte per value on a log2 grid, for optimizer state (``optimizer_codec``).
- ``delta``: a quantizer's diffs as per-row-width changes within the whole-row error budget.

Every codec takes ``entropy`` (``none``, ``huffman``, ``zstd`` or ``lz4``), the stage that
compresses its payload bytes; see ``common.py``. ``embckpt.config.codec_for`` builds the codec
a ``CheckpointConfig`` names (codecs know nothing of the configuration).
"""

from embckpt.codecs import adaptive, delta, exponent, floats, kmeans, log8, uniform
from embckpt.codecs.base import (
    Codec,
    EncodedRows,
    codec_from_config,
    make_codec,
    register,
)
from embckpt.codecs.raw import RawCodec

AdaptiveCodec = adaptive.AdaptiveCodec
AsymmetricCodec = uniform.AsymmetricCodec
DeltaCodec = delta.DeltaCodec
Bf16Codec = floats.Bf16Codec
ExponentCodec = exponent.ExponentCodec
Fp16Codec = floats.Fp16Codec
KMeansCodec = kmeans.KMeansCodec
Log8Codec = log8.Log8Codec
SymmetricCodec = uniform.SymmetricCodec


__all__ = [
    "AdaptiveCodec",
    "AsymmetricCodec",
    "Bf16Codec",
    "Codec",
    "DeltaCodec",
    "EncodedRows",
    "ExponentCodec",
    "Fp16Codec",
    "KMeansCodec",
    "Log8Codec",
    "RawCodec",
    "SymmetricCodec",
    "codec_from_config",
    "make_codec",
    "register",
]
