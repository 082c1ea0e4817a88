"""Layer specs of hybrid models, built from this project's torch layers. The state dicts use Megatron's
hybrid (Transformer Engine) spec key names: each pre-norm appears fused into the next linear
(``mixer.in_proj.layer_norm_weight``, ``self_attention.linear_qkv.layer_norm_weight``, ...)."""
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.te_key_map import TRANSFORMER_ENGINE
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
    get_bias_dropout_add,
)


def get_hybrid_stack_spec(moe_grouped_gemm: bool = False, qk_layernorm: bool = False,
                          checkpoint_key_names: str = TRANSFORMER_ENGINE) -> ModuleSpec:
    """The HybridStack spec: Mamba-2 (M), Gated DeltaNet (G), attention (*), multi-latent attention (+), MLP (-)
    and MoE (E) layers.
    ``checkpoint_key_names="local"`` keeps separate norm names (``norm.weight``, ``input_layernorm.weight``)."""
    norm = WrappedTorchNorm
    keys = {"checkpoint_key_names": checkpoint_key_names}
    mamba = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=norm, mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
            in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
        mamba_bda=get_bias_dropout_add, **keys))
    gdn = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm, self_attention=ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add, **keys))
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm, self_attention=ModuleSpec(
            module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=ColumnParallelLinear, core_attention=DotProductAttention, linear_proj=RowParallelLinear,
                q_layernorm=norm if qk_layernorm else None, k_layernorm=norm if qk_layernorm else None)),
        self_attn_bda=get_bias_dropout_add, **keys))
    # Multi-latent attention (+): needs an MLATransformerConfig (--multi-latent-attention and its sizes); the
    # layer keeps its own rotary embedding. No query / key-value latent norms, as in Megatron's hybrid spec
    # (its checkpoints then load here unchanged).
    mla = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm, self_attention=ModuleSpec(
            module=MLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
            submodules=MLASelfAttentionSubmodules(
                linear_q_proj=ColumnParallelLinear, linear_q_down_proj=ColumnParallelLinear,
                linear_q_up_proj=ColumnParallelLinear, linear_kv_down_proj=ColumnParallelLinear,
                linear_kv_up_proj=ColumnParallelLinear, core_attention=DotProductAttention,
                linear_proj=RowParallelLinear, q_layernorm=IdentityOp, kv_layernorm=IdentityOp)),
        self_attn_bda=get_bias_dropout_add, **keys))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=norm, mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add, **keys))
    moe = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=norm, mlp=get_moe_module_spec_for_backend(LocalSpecProvider(), 8, moe_grouped_gemm),
        mlp_bda=get_bias_dropout_add, **keys))
    # One MTP depth: its layer is a HybridStack of the pattern's MTP part, built from these same submodules.
    mtp = ModuleSpec(module=MultiTokenPredictionBlock, submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[
        ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
            enorm=norm, hnorm=norm, eh_proj=ColumnParallelLinear, mtp_model_layer=None, layer_norm=norm))]))
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        mamba_layer=mamba, gdn_layer=gdn, attention_layer=attention, mla_layer=mla, mlp_layer=mlp, moe_layer=moe,
        mtp_block_spec=mtp))


# Megatron's module-level spec names; Megatron's hybrid stack builds its experts as one grouped GEMM.
hybrid_stack_spec = get_hybrid_stack_spec(moe_grouped_gemm=True)
mamba_stack_spec = hybrid_stack_spec
