"""Layer spec for BERT's encoder: the local (torch) transformer layer with a padding attention mask."""
from megatron.core.models.gpt.gpt_layer_specs import LNImpl, get_mlp_module_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_bias_dropout_add,
)


def get_bert_layer_local_spec() -> ModuleSpec:
    """Pre-norm encoder layer; every token attends to every real (non-pad) token."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=LNImpl,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.padding},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear, core_attention=DotProductAttention,
                    linear_proj=RowParallelLinear)),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=LNImpl,
            mlp=get_mlp_module_spec(),
            mlp_bda=get_bias_dropout_add,
        ),
    )


# Megatron Core exposes the spec as a module-level object as well.
bert_layer_local_spec = get_bert_layer_local_spec()
