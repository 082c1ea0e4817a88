"""Layer specs for T5: encoder layers (padding mask) and decoder layers (causal self-attention, then
cross-attention to the encoder output), local torch implementation."""
from megatron.core.models.bert.bert_layer_specs import get_bert_layer_local_spec
from megatron.core.models.gpt.gpt_layer_specs import LNImpl, get_local_layer_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import CrossAttention, CrossAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.utils import lazy_names

# Megatron's Transformer Engine spec names (each the local spec here), resolved on first use.
__getattr__ = lazy_names(__name__, {name: "megatron.core._compat.t5_spec" for name in (
    "encoder_model_with_transformer_engine_default_spec", "decoder_model_with_transformer_engine_default_spec",
    "get_t5_encoder_with_transformer_engine_block_spec", "get_t5_decoder_with_transformer_engine_block_spec")})


def encoder_model_with_local_spec() -> ModuleSpec:
    """Bidirectional encoder layer (same as BERT's)."""
    return get_bert_layer_local_spec()


def decoder_model_with_local_spec() -> ModuleSpec:
    """Causal self-attention -> cross-attention over the encoder output -> MLP, each pre-norm."""
    cross_attention = ModuleSpec(
        module=CrossAttention,
        params={"attn_mask_type": AttnMaskType.padding},
        submodules=CrossAttentionSubmodules(
            linear_q=ColumnParallelLinear, linear_kv=ColumnParallelLinear,
            core_attention=DotProductAttention, linear_proj=RowParallelLinear))
    return get_local_layer_spec(AttnMaskType.causal, cross_attention=cross_attention)


def get_t5_encoder_with_local_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    return TransformerBlockSubmodules(layer_specs=[encoder_model_with_local_spec()] * num_layers,
                                      layer_norm=LNImpl)


def get_t5_decoder_with_local_block_spec(num_layers: int) -> TransformerBlockSubmodules:
    return TransformerBlockSubmodules(layer_specs=[decoder_model_with_local_spec()] * num_layers,
                                      layer_norm=LNImpl)
