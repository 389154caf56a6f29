"""Row codecs: the ``Codec`` contract, its registry, and the built-in codecs."""

from embckpt.codecs.base import (
    Codec,
    EncodedRows,
    codec_from_config,
    make_codec,
    register,
)
from embckpt.codecs.raw import RawCodec
from embckpt.config import CheckpointConfig


def codec_for(config: CheckpointConfig) -> Codec:
    """The row codec a checkpoint configuration asks for."""
    return make_codec(config.codec, config.codec_options)


__all__ = [
    "Codec",
    "EncodedRows",
    "RawCodec",
    "codec_for",
    "codec_from_config",
    "make_codec",
    "register",
]
