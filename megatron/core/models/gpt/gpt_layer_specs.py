"""Layer specs for GPT: which classes make up a transformer layer (local torch implementation).

The Transformer Engine specs build the same modules (our fused torch layers: same functions, different
kernels) whose state dicts keep Megatron's TE-spec key names (megatron/core/transformer/te_key_map.py)."""
import dataclasses
from typing import List, Optional

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.moe_utils import moe_layer_pattern
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    get_mtp_layer_spec_for_backend,
    get_mtp_num_layers_to_build,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.te_key_map import TRANSFORMER_ENGINE
from megatron.core.transformer.torch_norm import L2Norm, WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
    get_transformer_layer_offset,
)
from megatron.core.transformer.transformer_config import linear_attention_pattern
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_bias_dropout_add,
)
from megatron.core.utils import lazy_names

# Megatron's path for the MoE spec getter (defined in moe_module_specs.py), resolved on first use.
__getattr__ = lazy_names(__name__, {"get_moe_module_spec": "megatron.core.models.gpt.moe_module_specs"})

LNImpl = WrappedTorchNorm


def get_mlp_module_spec(use_te: bool = True, num_experts: Optional[int] = None,
                        moe_grouped_gemm: bool = False, fp8: Optional[str] = None, use_te_op_fuser: bool = False,
                        **kwargs) -> ModuleSpec:
    """Dense MLP, or an MoE layer when ``num_experts`` is set. ``use_te`` picks the same local modules
    (our fastest; no Transformer Engine here)."""
    if fp8 or use_te_op_fuser:
        raise NotImplementedError("get_mlp_module_spec(fp8/use_te_op_fuser) needs Transformer Engine")
    return get_mlp_module_spec_for_backend(LocalSpecProvider(), num_experts, moe_grouped_gemm)


def get_mlp_module_spec_for_backend(backend, num_experts: Optional[int] = None,
                                    moe_grouped_gemm: Optional[bool] = False, use_te_op_fuser: Optional[bool] = False,
                                    use_te_activation_func: bool = False,
                                    use_grouped_gemm_for_dense_mlp: bool = False) -> ModuleSpec:
    """Dense MLP from ``backend``'s linears, or its MoE layer when ``num_experts`` is set. The TE op fuser,
    TE activation and grouped GEMM for dense MLPs need Transformer Engine and are refused when set."""
    for name, value in (("use_te_op_fuser", use_te_op_fuser), ("use_te_activation_func", use_te_activation_func),
                        ("use_grouped_gemm_for_dense_mlp", use_grouped_gemm_for_dense_mlp)):
        if value:
            raise NotImplementedError(f"{name} needs Transformer Engine, which this build does not use; drop it")
    if num_experts is not None:
        return get_moe_module_spec_for_backend(backend, num_experts, moe_grouped_gemm)
    fc1 = (backend.column_parallel_layer_norm_linear() if backend.fuse_layernorm_and_linear()
           else backend.column_parallel_linear())
    return ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=backend.row_parallel_linear()))


def get_gpt_layer_local_spec(num_experts: Optional[int] = None, moe_grouped_gemm: bool = False,
                             qk_layernorm: bool = False, multi_latent_attention: bool = False,
                             fp8: Optional[str] = None, normalization: Optional[str] = None,
                             qk_l2_norm: bool = False, use_kitchen: bool = False, use_kitchen_attention: bool = False,
                             kitchen_attention_backend: str = "sdpa", moe_use_legacy_grouped_gemm: bool = False,
                             **kwargs) -> ModuleSpec:
    """Pre-norm GPT layer on plain torch + our TP layers (Megatron's 'local' spec).
    ``kitchen_attention_backend`` only matters with ``use_kitchen_attention``, which is refused."""
    if use_kitchen or use_kitchen_attention or fp8:
        raise NotImplementedError("kitchen / fp8 layer specs are not supported (FP8 is a config setting)")
    # An explicit `normalization` overrides config.normalization for this spec's norms (as Megatron).
    norm = ModuleSpec(module=LNImpl, params={"normalization": normalization}) if normalization else LNImpl
    mlp = get_mlp_module_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm)
    if multi_latent_attention:
        if qk_l2_norm:
            raise ValueError("qk_l2_norm is not supported with multi-latent attention")
        return get_mla_layer_spec(norm=norm, qk_norm=norm if qk_layernorm else None, mlp=mlp)
    qk_norm = L2Norm if qk_l2_norm else (norm if qk_layernorm else None)
    return get_local_layer_spec(AttnMaskType.causal, norm=norm, qk_norm=qk_norm, mlp=mlp)


def get_mla_layer_spec(norm=LNImpl, qk_norm=None, mlp: Optional[ModuleSpec] = None) -> ModuleSpec:
    """Pre-norm causal layer with multi-latent attention; ``qk_norm`` (--qk-layernorm) normalizes the query
    and key/value latents (DeepSeek's q_a_layernorm / kv_a_layernorm), as in Megatron's local spec."""
    spec = get_local_layer_spec(AttnMaskType.causal, norm=norm, mlp=mlp)
    latent_norm = qk_norm if qk_norm is not None else IdentityOp
    spec.submodules.self_attention = ModuleSpec(
        module=MLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear, linear_q_down_proj=ColumnParallelLinear,
            linear_q_up_proj=ColumnParallelLinear, linear_kv_down_proj=ColumnParallelLinear,
            linear_kv_up_proj=ColumnParallelLinear, core_attention=DotProductAttention,
            linear_proj=RowParallelLinear, q_layernorm=latent_norm, kv_layernorm=latent_norm))
    return spec


def get_local_layer_spec(attn_mask_type: AttnMaskType, norm=LNImpl, qk_norm=None,
                         mlp: Optional[ModuleSpec] = None, cross_attention: Optional[ModuleSpec] = None) -> ModuleSpec:
    """Pre-norm local layer: self-attention [-> cross-attention] -> MLP, each behind ``norm``.
    GPT, BERT and T5 differ only in the mask type, the optional qk norm and cross-attention."""
    cross = {}
    if cross_attention is not None:
        cross = dict(pre_cross_attn_layernorm=norm, cross_attention=cross_attention,
                     cross_attn_bda=get_bias_dropout_add)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": attn_mask_type},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear, core_attention=DotProductAttention,
                    linear_proj=RowParallelLinear, q_layernorm=qk_norm, k_layernorm=qk_norm)),
            self_attn_bda=get_bias_dropout_add,
            **cross,
            pre_mlp_layernorm=norm,
            mlp=mlp if mlp is not None else get_mlp_module_spec(),
            mlp_bda=get_bias_dropout_add,
        ),
    )


# Megatron's other spec entry points. There is no Transformer Engine here: the TE variants return our
# fastest spec, which is the local one (fused kernels are chosen by config flags, not by the spec).
def get_gpt_layer_local_submodules(num_experts: Optional[int] = None, moe_grouped_gemm: Optional[bool] = False,
                                   qk_layernorm: Optional[bool] = False,
                                   multi_latent_attention: Optional[bool] = False, fp8: Optional[str] = None,
                                   normalization: Optional[str] = None, qk_l2_norm: Optional[bool] = False,
                                   use_kitchen: bool = False, use_kitchen_attention: bool = False,
                                   kitchen_attention_backend: str = "sdpa") -> TransformerLayerSubmodules:
    """The submodules of get_gpt_layer_local_spec."""
    if use_kitchen_attention:
        raise NotImplementedError("use_kitchen_attention (NVIDIA Kitchen) is not supported; drop it")
    return get_gpt_layer_local_spec(num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention, fp8,
                                    normalization=normalization, qk_l2_norm=qk_l2_norm,
                                    use_kitchen=use_kitchen).submodules


def get_gpt_layer_with_transformer_engine_submodules(
        num_experts: Optional[int] = None, moe_grouped_gemm: Optional[bool] = False,
        qk_layernorm: Optional[bool] = False, multi_latent_attention: Optional[bool] = False,
        fp8: Optional[str] = None, qk_l2_norm: Optional[bool] = False, use_te_op_fuser: Optional[bool] = False,
        use_kitchen: bool = False, use_te_activation_func: bool = False, use_kitchen_attention: bool = False,
        kitchen_attention_backend: str = "sdpa", mla_down_proj_fusion: bool = False,
        use_grouped_gemm_for_dense_mlp: bool = False) -> TransformerLayerSubmodules:
    """Without Transformer Engine: the submodules of our fastest spec, the local one, with Megatron's TE-spec
    checkpoint key names (``linear_qkv.layer_norm_weight``, ``weight0..N`` grouped experts, ``_extra_state``).

    TE-only switches (op fuser, TE activation, MLA down-projection fusion, grouped GEMM for dense
    MLPs) are refused when set; `fp8` is ignored as in Megatron (FP8 is a config setting)."""
    te_only = dict(use_te_op_fuser=use_te_op_fuser, use_te_activation_func=use_te_activation_func,
                   mla_down_proj_fusion=mla_down_proj_fusion,
                   use_grouped_gemm_for_dense_mlp=use_grouped_gemm_for_dense_mlp)
    for name, value in te_only.items():
        if value:
            raise NotImplementedError(f"{name} needs Transformer Engine, which this build does not use; drop it")
    return _with_te_key_names(get_gpt_layer_local_submodules(
        num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention, qk_l2_norm=qk_l2_norm,
        use_kitchen=use_kitchen, use_kitchen_attention=use_kitchen_attention,
        kitchen_attention_backend=kitchen_attention_backend))


def _with_te_key_names(submodules: TransformerLayerSubmodules) -> TransformerLayerSubmodules:
    """The same layer, its state dict under Megatron's TE-spec key names."""
    return dataclasses.replace(submodules, checkpoint_key_names=TRANSFORMER_ENGINE)


def get_gpt_layer_with_transformer_engine_spec(
        num_experts: Optional[int] = None, moe_grouped_gemm: Optional[bool] = False,
        qk_layernorm: Optional[bool] = False, multi_latent_attention: Optional[bool] = False,
        fp8: Optional[str] = None, qk_l2_norm: Optional[bool] = False, use_te_op_fuser: Optional[bool] = False,
        use_kitchen: bool = False, use_te_activation_func: bool = False, use_kitchen_attention: bool = False,
        kitchen_attention_backend: str = "sdpa", mla_down_proj_fusion: bool = False,
        use_grouped_gemm_for_dense_mlp: bool = False) -> ModuleSpec:
    """Our fastest GPT layer spec (the local modules: no Transformer Engine here) under Megatron's TE name
    and with its TE-spec checkpoint key names, so that model providers written for Megatron run unchanged."""
    return ModuleSpec(module=TransformerLayer, submodules=get_gpt_layer_with_transformer_engine_submodules(
        num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention, fp8, qk_l2_norm, use_te_op_fuser,
        use_kitchen, use_te_activation_func, use_kitchen_attention, kitchen_attention_backend,
        mla_down_proj_fusion, use_grouped_gemm_for_dense_mlp))


def get_gpt_decoder_layer_specs(config, use_transformer_engine: bool = False, normalization: Optional[str] = None,
                                qk_l2_norm: Optional[bool] = False, vp_stage: Optional[int] = None,
                                pp_rank: Optional[int] = None) -> List[ModuleSpec]:
    """One layer spec per decoder layer (all num_layers of them): MoE where ``config.moe_layer_freq`` says so
    (an int N: every N-th layer from layer 0; a list: 1 = MoE, 0 = dense, e.g. DeepSeek's first dense
    layers), dense elsewhere."""
    mla = getattr(config, "multi_latent_attention", False)
    names = _with_te_key_names if use_transformer_engine else (lambda submodules: submodules)
    dense = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=normalization,
                                     qk_l2_norm=qk_l2_norm, multi_latent_attention=mla)
    dense.submodules = names(dense.submodules)
    if config.num_moe_experts is None:
        return _with_linear_attention([dense] * config.num_layers, config)
    moe = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                                   qk_layernorm=config.qk_layernorm, normalization=normalization,
                                   qk_l2_norm=qk_l2_norm, multi_latent_attention=mla)
    moe.submodules = names(moe.submodules)
    specs = [moe if p else dense for p in moe_layer_pattern(config.moe_layer_freq, config.num_layers)]
    return _with_linear_attention(specs, config)


def _with_linear_attention(specs: List[ModuleSpec], config) -> List[ModuleSpec]:
    """``config.experimental_attention_variant`` "gated_delta_net": the layers --linear-attention-freq marks get a
    Gated DeltaNet in their self-attention place (the hybrid stack's G layer, behind the same input norm), their
    MLP or MoE unchanged (Qwen3-Next's layout)."""
    if getattr(config, "experimental_attention_variant", None) is None:
        return specs
    pattern = linear_attention_pattern(config.linear_attention_freq, config.num_layers)
    out = []
    for spec, linear in zip(specs, pattern):
        if linear:
            gdn = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
                in_proj=ColumnParallelLinear, out_norm=spec.submodules.input_layernorm, out_proj=RowParallelLinear))
            spec = ModuleSpec(module=spec.module, params=dict(spec.params),
                              submodules=dataclasses.replace(spec.submodules, self_attention=gdn))
        out.append(spec)
    return out


def get_gpt_decoder_block_spec(config, use_transformer_engine: bool = False, normalization: Optional[str] = None,
                               qk_l2_norm: Optional[bool] = False, vp_stage: Optional[int] = None,
                               pp_rank: Optional[int] = None) -> TransformerBlockSubmodules:
    """The layer specs of this pipeline stage (and virtual stage) plus the final norm."""
    specs = get_gpt_decoder_layer_specs(config, use_transformer_engine, normalization, qk_l2_norm)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    norm = ModuleSpec(module=LNImpl, params={"normalization": normalization}) if normalization else LNImpl
    return TransformerBlockSubmodules(layer_specs=specs[offset:offset + count], layer_norm=norm)


def get_gpt_mtp_block_spec(config, spec, use_transformer_engine: bool = False, vp_stage: Optional[int] = None,
                           pp_rank: Optional[int] = None) -> Optional[ModuleSpec]:
    """The multi-token prediction block (``use_transformer_engine`` picks the same local modules, our
    fastest); None where this stage builds no MTP layer."""
    return get_gpt_mtp_block_spec_for_backend(config, spec, LocalSpecProvider(), vp_stage=vp_stage,
                                              pp_rank=pp_rank)


def get_gpt_mtp_block_spec_for_backend(config, spec, backend, vp_stage: Optional[int] = None,
                                       pp_rank: Optional[int] = None) -> Optional[ModuleSpec]:
    """``config.mtp_num_layers`` depths, each around the transformer layer spec ``spec`` (the last layer's
    spec when ``spec`` is a block spec), on the last pipeline stage; None elsewhere or without MTP."""
    if not config.mtp_num_layers or get_mtp_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank) == 0:
        return None
    if isinstance(spec, ModuleSpec) and isinstance(spec.submodules, TransformerBlockSubmodules):
        spec = spec.submodules
    if isinstance(spec, TransformerBlockSubmodules):
        spec = spec.layer_specs[-1]
    layer = get_mtp_layer_spec_for_backend(spec, backend)
    return ModuleSpec(module=MultiTokenPredictionBlock,
                      submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * config.mtp_num_layers))
