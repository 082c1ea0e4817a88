"""Megatron Core's Transformer Engine T5 spec getters: without TE each returns the local spec of the same
layer or block. Reached from ``megatron.core.models.T5.t5_spec`` through its lazy alias table.
"""
from megatron.core.models.T5.t5_spec import (
    decoder_model_with_local_spec,
    encoder_model_with_local_spec,
    get_t5_decoder_with_local_block_spec,
    get_t5_encoder_with_local_block_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules


def encoder_model_with_transformer_engine_default_spec() -> ModuleSpec:
    """Our fastest T5 encoder layer (the local one), under Megatron's TE name."""
    return encoder_model_with_local_spec()


def decoder_model_with_transformer_engine_default_spec() -> ModuleSpec:
    """Our fastest T5 decoder layer (the local one), under Megatron's TE name."""
    return decoder_model_with_local_spec()


def get_t5_encoder_with_transformer_engine_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """Our fastest T5 encoder block (the local one), under Megatron's TE name."""
    return get_t5_encoder_with_local_block_spec(num_layers)


def get_t5_decoder_with_transformer_engine_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    """Our fastest T5 decoder block (the local one), under Megatron's TE name."""
    return get_t5_decoder_with_local_block_spec(num_layers)
