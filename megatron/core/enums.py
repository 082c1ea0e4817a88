"""Enums shared by models and schedules."""
import enum


class ModelType(enum.Enum):
    encoder_or_decoder = 1
    encoder_and_decoder = 2


class Fp8Recipe(str, enum.Enum):
    delayed = "delayed"
    tensorwise = "tensorwise"
    mxfp8 = "mxfp8"
    blockwise = "blockwise"
    custom = "custom"  # user quantizer factories (Transformer Engine); TransformerConfig refuses it


class Fp4Recipe(str, enum.Enum):
    """FP4 recipes (Transformer Engine only): TransformerConfig refuses any fp4 setting here."""
    nvfp4 = "nvfp4"
    custom = "custom"
