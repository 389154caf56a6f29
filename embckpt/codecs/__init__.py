"""Row codecs: the ``Codec`` contract, its registry, and the built-in codecs."""

from embckpt.codecs.base import (
    Codec,
    EncodedRows,
    codec_from_config,
    make_codec,
    register,
)
from embckpt.codecs.raw import RawCodec

__all__ = ["Codec", "EncodedRows", "RawCodec", "codec_from_config", "make_codec", "register"]
