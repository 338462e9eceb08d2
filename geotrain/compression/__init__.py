"""Tensor codecs for activations and gradients on the wire; pure torch and numpy."""

from geotrain.compression.base import (
    CODEC_IDS,
    Codec,
    CodecError,
    CodecId,
    FeedbackState,
    codec_from_payload,
    get_codec,
    new_tensor,
)
from geotrain.compression.codecs import (
    Bf16Codec,
    Fp16Codec,
    Int4Codec,
    Int8Codec,
    NoneCodec,
    PowerSgdCodec,
    TopKCodec,
)

__all__ = [
    "CODEC_IDS",
    "Bf16Codec",
    "Codec",
    "CodecError",
    "CodecId",
    "FeedbackState",
    "Fp16Codec",
    "Int4Codec",
    "Int8Codec",
    "NoneCodec",
    "PowerSgdCodec",
    "TopKCodec",
    "codec_from_payload",
    "get_codec",
    "new_tensor",
]
