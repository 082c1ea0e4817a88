"""Self-attention with grouped query attention, fused QKV and optional QK-norm."""
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.tensor_parallel.random import checkpoint
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.spec_protocols import (  # noqa: F401  (Megatron's typing Protocols)
    CoreAttentionBuilder, CoreAttentionInterface, LinearInterface, LinearLayerBuilder, LinearProjBuilder,
    LinearProjInterface, LinearQkvBuilder, LinearQkvInterface)


@dataclass
class SelfAttentionSubmodules:
    linear_qkv: Union[ModuleSpec, type] = None
    core_attention: Union[ModuleSpec, type] = None
    linear_proj: Union[ModuleSpec, type] = None
    q_layernorm: Union[ModuleSpec, type] = None
    k_layernorm: Union[ModuleSpec, type] = None


class SelfAttention(MegatronModule):
    """x -> QKV (column-parallel) -> RoPE -> core attention per local head -> proj (row-parallel).

    The fused QKV output is laid out per query group, [ng, (np/ng + 2) * hn]: each group's queries,
    then its key, then its value. TP splits whole groups, so a rank's slice is the same layout.
    """

    def __init__(self, config, submodules: SelfAttentionSubmodules, layer_number: int,
                 attn_mask_type: AttnMaskType = AttnMaskType.padding, cp_comm_type: Optional[str] = None,
                 pg_collection=None, pp_layer_offset: Optional[int] = None, name: Optional[str] = None, **kwargs):
        super().__init__(config)
        if pp_layer_offset is not None:
            raise NotImplementedError("SelfAttention(pp_layer_offset=...) (MTP layer offsets) is not supported")
        self.name = name  # a label only (Megatron hands it to Transformer Engine)
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if config.num_attention_heads % tp or config.num_query_groups % tp:
            raise ValueError(f"num_attention_heads ({config.num_attention_heads}) and num_query_groups "
                             f"({config.num_query_groups}) must be divisible by the TP size ({tp})")
        self.hn = config.kv_channels
        self.np = config.num_attention_heads // tp  # local heads
        self.ng = config.num_query_groups // tp  # local query groups
        self.query_projection_size = config.kv_channels * config.num_attention_heads
        self.kv_projection_size = config.kv_channels * config.num_query_groups

        self.linear_qkv = build_module(
            submodules.linear_qkv, config.hidden_size, self.query_projection_size + 2 * self.kv_projection_size,
            config=config, init_method=config.init_method, gather_output=False,
            bias=config.add_bias_linear or config.add_qkv_bias, skip_bias_add=False, is_expert=False,
            tp_comm_buffer_name="qkv")
        self.core_attention = build_module(submodules.core_attention, config=config, layer_number=layer_number,
                                           attn_mask_type=attn_mask_type, attention_type="self",
                                           cp_comm_type=cp_comm_type)
        self.linear_proj = build_module(
            submodules.linear_proj, self.query_projection_size, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear, input_is_parallel=True,
            skip_bias_add=True, is_expert=False, tp_comm_buffer_name="proj")
        self.q_layernorm = self._build_qk_norm(submodules.q_layernorm)
        self.k_layernorm = self._build_qk_norm(submodules.k_layernorm)
        self.checkpoint_core_attention = (config.recompute_granularity == "selective"
                                          and "core_attn" in (config.recompute_modules or []))

    def _build_qk_norm(self, spec):
        if spec is None:
            return None
        norm = build_module(spec, config=self.config, hidden_size=self.hn, eps=self.config.layernorm_epsilon)
        # Each TP rank normalises different heads, so these grads are partial sums over TP
        # (with or without SP): flag them for the TP all-reduce in finalize_model_grads.
        for p in norm.parameters():
            p.sequence_parallel = parallel_state.get_tensor_model_parallel_world_size() > 1
        return norm

    def get_query_key_value_tensors(self, hidden_states):
        mixed, _ = self.linear_qkv(hidden_states)  # [s, b, ng * (np/ng + 2) * hn]
        s, b = mixed.shape[:2]
        per_group = self.np // self.ng
        mixed = mixed.view(s, b, self.ng, (per_group + 2) * self.hn)  # [s, b, ng, (np/ng + 2) * hn]
        q, k, v = torch.split(mixed, [per_group * self.hn, self.hn, self.hn], dim=3)
        q = q.reshape(s, b, self.np, self.hn)  # [s, b, np, hn]
        if self.q_layernorm is not None:
            q = self.q_layernorm(q)
        if self.k_layernorm is not None:
            k = self.k_layernorm(k)  # [s, b, ng, hn]
        return q, k, v

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, **kwargs):
        if inference_context is not None and self.q_layernorm is None and self.k_layernorm is None \
                and hasattr(inference_context, "attention_from_qkv"):  # generation: the fused layout as is
            mixed, _ = self.linear_qkv(hidden_states)  # [s, b, ng * (np/ng + 2) * hn]
            return self.linear_proj(inference_context.attention_from_qkv(
                self.layer_number, mixed, self.ng, self.hn, self.core_attention.softmax_scale))
        q, k, v = self.get_query_key_value_tensors(hidden_states)
        if rotary_pos_emb is not None:
            q_emb, k_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            q = apply_rotary_pos_emb(q, q_emb, config=self.config)
            k = apply_rotary_pos_emb(k, k_emb, config=self.config)
        if inference_context is not None:  # generation: the context owns the KV cache (core/inference)
            ctx = inference_context.attention(self.layer_number, q, k, v, self.core_attention.softmax_scale)
        elif self.checkpoint_core_attention and self.training:
            ctx = checkpoint(lambda q_, k_, v_, m_: self.core_attention(
                q_, k_, v_, m_, packed_seq_params=packed_seq_params), False, q, k, v, attention_mask)
        else:
            ctx = self.core_attention(q, k, v, attention_mask, attention_bias=attention_bias,
                                      packed_seq_params=packed_seq_params)  # [s, b, np * hn]
        return self.linear_proj(ctx)  # (output, bias)


# Megatron also exposes the cross-attention classes from this module.
from megatron.core.transformer.cross_attention import CrossAttention, CrossAttentionSubmodules  # noqa: E402,F401
