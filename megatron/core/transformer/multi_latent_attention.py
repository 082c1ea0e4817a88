"""Multi-latent attention (DeepSeek-V2/V3): keys and values come from one small shared latent per token.

    q      = W_q_up(norm(W_q_down x))                  or W_q x without --q-lora-rank   [s, b, np, qk + pe]
    c, k_pe = split(W_kv_down x)                       c: [s, b, kv_lora_rank], k_pe: [s, b, pe]
    k, v   = split(W_kv_up(norm(c)))                   [s, b, np, qk], [s, b, np, hv]
    q = [q_nope, rope(q_pe)], k = [k_nope, rope(k_pe) shared by every head]
    out = W_o softmax(q k^T * scale) v,  scale = mscale(factor, mscale_all_dim)^2 / sqrt(qk + pe)

TP, as Megatron's local spec: the down projections are column-parallel and their outputs are gathered
back to the full latent (it is small); the up projections split heads by columns; linear_proj is
row-parallel. Every TP rank builds the full rope key from the gathered latent but uses it only for its
own heads, so its gradient is summed over TP (``copy_to_tensor_model_parallel_region``).
"""
import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding, _yarn_get_mscale
from megatron.core.process_groups_config import get_pg_size
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.random import checkpoint
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module


@dataclass
class MLASelfAttentionSubmodules:
    linear_q_proj: Union[ModuleSpec, type] = None
    linear_q_down_proj: Union[ModuleSpec, type] = None
    linear_q_up_proj: Union[ModuleSpec, type] = None
    linear_kv_down_proj: Union[ModuleSpec, type] = None
    linear_kv_up_proj: Union[ModuleSpec, type] = None
    linear_qkv_down_proj: Union[ModuleSpec, type] = None  # Megatron's fused q+kv down projection: refused
    core_attention: Union[ModuleSpec, type] = None
    linear_proj: Union[ModuleSpec, type] = None
    q_layernorm: Union[ModuleSpec, type] = None
    kv_layernorm: Union[ModuleSpec, type] = None


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rope channels come as pairs (x0, x1), (x2, x3)...: evens then odds, so the half-by-half
    rotation turns each pair (Megatron's ``mla_rotary_interleaved``; the weights keep DeepSeek's row order)."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def _column_linear(spec, config, in_size, out_size, name, **tp_kwargs):
    return build_module(spec, in_size, out_size, config=config, init_method=config.init_method,
                        gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
                        tp_comm_buffer_name=name, **tp_kwargs)


class MultiLatentAttention(MegatronModule):
    """What MLA variants share: the rotary embedding, the softmax scale, core attention and linear_proj."""

    def __init__(self, config, submodules: MLASelfAttentionSubmodules, layer_number: int,
                 attn_mask_type: AttnMaskType, attention_type: str, cp_comm_type: Optional[str] = None,
                 pg_collection=None, pp_layer_offset: Optional[int] = None, name: Optional[str] = None):
        """``pp_layer_offset`` indexes Megatron's inference KV cache, which MLA does not use here (no effect);
        ``name`` is a label (Megatron hands it to Transformer Engine). ``pg_collection``: its ``tp`` group
        splits the heads and the latents' gathers (parallel_state's groups when None)."""
        super().__init__(config)
        if getattr(submodules, "linear_qkv_down_proj", None) is not None:
            raise NotImplementedError("MLASelfAttentionSubmodules.linear_qkv_down_proj (fused MLA down "
                                      "projection, mla_down_proj_fusion) is not supported; use the separate "
                                      "linear_q_down_proj / linear_kv_down_proj")
        self.pp_layer_offset, self.name = pp_layer_offset, name
        if not getattr(config, "multi_latent_attention", False) or not hasattr(config, "kv_lora_rank"):
            raise ValueError("multi-latent attention needs an MLATransformerConfig (--multi-latent-attention)")
        self.layer_number, self.attn_mask_type, self.attention_type = layer_number, attn_mask_type, attention_type
        self.pg_collection = pg_collection
        tp = self._tp = get_pg_size(pg_collection, "tp", type(self).__name__)
        # None: the mappings and linears use parallel_state's TP group (the default build, unchanged).
        self._tp_group = None if pg_collection is None else pg_collection.tp
        self._tp_kwargs = {} if pg_collection is None else {"tp_group": pg_collection.tp}
        pg_kwargs = {} if pg_collection is None else {"pg_collection": pg_collection}
        self.num_attention_heads_per_partition = config.num_attention_heads // tp
        self.q_head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        self.query_projection_size = config.v_head_dim * config.num_attention_heads
        # DeepSeek's YaRN: the logits are sharpened by mscale(factor, mscale_all_dim) on each of q and k.
        mscale = _yarn_get_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
        self.softmax_scale = mscale * mscale / math.sqrt(self.q_head_dim)
        if config.rope_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(config.qk_pos_emb_head_dim, config.rotary_percent,
                                                  rotary_base=config.rotary_base,
                                                  use_cpu_initialization=config.use_cpu_initialization)
        else:
            self.rotary_pos_emb = YarnRotaryEmbedding(
                config.qk_pos_emb_head_dim, rotary_base=config.rotary_base,
                use_cpu_initialization=config.use_cpu_initialization, scaling_factor=config.rotary_scaling_factor,
                original_max_position_embeddings=config.original_max_position_embeddings,
                beta_fast=config.beta_fast, beta_slow=config.beta_slow, mscale=config.mscale,
                mscale_all_dim=config.mscale_all_dim,
                correction_range_round_to_int=config.correction_range_round_to_int)
        self.core_attention = build_module(submodules.core_attention, config=config, layer_number=layer_number,
                                           attn_mask_type=attn_mask_type, attention_type=attention_type,
                                           softmax_scale=self.softmax_scale, k_channels=self.q_head_dim,
                                           v_channels=config.v_head_dim, **pg_kwargs)
        self.linear_proj = build_module(
            submodules.linear_proj, self.query_projection_size, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear, input_is_parallel=True,
            skip_bias_add=True, is_expert=False, tp_comm_buffer_name="proj", **self._tp_kwargs)
        self.checkpoint_core_attention = (config.recompute_granularity == "selective"
                                          and "core_attn" in (config.recompute_modules or []))

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, **kwargs):
        if inference_context is not None or packed_seq_params is not None:
            raise NotImplementedError("multi-latent attention with a KV cache or packed sequences is not supported")
        if attention_bias is not None:
            raise NotImplementedError("attention bias is not supported by multi-latent attention")
        # The layer's own rotary embedding is used; a model-level one (rotary_pos_emb) is ignored.
        q, k, v = self.get_query_key_value_tensors(hidden_states)
        if self.checkpoint_core_attention and self.training:
            ctx = checkpoint(lambda q_, k_, v_, m_: self.core_attention(q_, k_, v_, m_), False,
                             q, k, v, attention_mask)
        else:
            ctx = self.core_attention(q, k, v, attention_mask)  # [s, b, np * hv]
        return self.linear_proj(ctx)  # (output, bias)


class MLASelfAttention(MultiLatentAttention):
    """MLA over ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism), returns ``(out, bias)``."""

    def __init__(self, config, submodules: MLASelfAttentionSubmodules, layer_number: int,
                 attn_mask_type: AttnMaskType = AttnMaskType.padding, cp_comm_type: Optional[str] = None,
                 pg_collection=None, pp_layer_offset: Optional[int] = None, name: Optional[str] = None, **kwargs):
        super().__init__(config, submodules, layer_number, attn_mask_type, "self", cp_comm_type, pg_collection,
                         pp_layer_offset, name)
        c, heads = config, config.num_attention_heads
        if c.q_lora_rank is None:
            self.linear_q_proj = _column_linear(submodules.linear_q_proj, c, c.hidden_size, heads * self.q_head_dim,
                                                "q_proj", **self._tp_kwargs)
        else:
            self.linear_q_down_proj = _column_linear(submodules.linear_q_down_proj, c, c.hidden_size,
                                                     c.q_lora_rank, "q_down_proj", **self._tp_kwargs)
            self.linear_q_up_proj = _column_linear(submodules.linear_q_up_proj, c, c.q_lora_rank,
                                                   heads * self.q_head_dim, "q_up_proj", **self._tp_kwargs)
            self.q_layernorm = self._build_norm(submodules.q_layernorm, c.q_lora_rank)
        self.linear_kv_down_proj = _column_linear(submodules.linear_kv_down_proj, c, c.hidden_size,
                                                  c.kv_lora_rank + c.qk_pos_emb_head_dim, "kv_down_proj",
                                                  **self._tp_kwargs)
        self.linear_kv_up_proj = _column_linear(submodules.linear_kv_up_proj, c, c.kv_lora_rank,
                                                heads * (c.qk_head_dim + c.v_head_dim), "kv_up_proj",
                                                **self._tp_kwargs)
        self.kv_layernorm = self._build_norm(submodules.kv_layernorm, c.kv_lora_rank)

    def _build_norm(self, spec, size):
        # The latents are replicated over TP (sequence-split under SP), so the norm is a plain norm whose
        # params carry `sequence_parallel` from the config like every other replicated norm.
        spec = IdentityOp if spec is None else spec
        return build_module(spec, config=self.config, hidden_size=size, eps=self.config.layernorm_epsilon)

    def _full_latent(self, x):
        """Column-parallel down-projection output [s, b, r/tp] -> the full latent [s, b, r], back on
        [s/tp, b, r] under sequence parallelism (where the next norm and column-parallel layer expect it)."""
        x = gather_from_tensor_model_parallel_region(x, group=self._tp_group)
        return scatter_to_sequence_parallel_region(x, group=self._tp_group) if self.config.sequence_parallel else x

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, position_ids=None,
                                    packed_seq_params=None, inference_context=None):
        c = self.config
        seq_len = self.rotary_pos_emb.get_rotary_seq_len(None, None, hidden_states, c,
                                                         tp_size=None if self.pg_collection is None else self._tp)
        emb = self.rotary_pos_emb(seq_len)
        emb, mscale = emb if isinstance(emb, tuple) else (emb, 1.0)  # [s, 1, 1, pe], YaRN concentration

        if c.q_lora_rank is None:
            q, _ = self.linear_q_proj(hidden_states)  # [s, b, np * (qk + pe)]
        else:
            q_latent = self._full_latent(self.linear_q_down_proj(hidden_states)[0])  # [s(/tp), b, q_lora_rank]
            q, _ = self.linear_q_up_proj(self.q_layernorm(q_latent))
        kv_latent, _ = self.linear_kv_down_proj(hidden_states)  # [s, b, (kv_lora_rank + pe) / tp]
        kv_latent = gather_from_tensor_model_parallel_region(kv_latent, group=self._tp_group)  # [s, b, r + pe]
        kv_latent, k_pe = torch.split(kv_latent, [c.kv_lora_rank, c.qk_pos_emb_head_dim], dim=-1)
        # Used by this rank's heads only: sum its grads over TP.
        k_pe = copy_to_tensor_model_parallel_region(k_pe, group=self._tp_group)
        if c.sequence_parallel:
            kv_latent = scatter_to_sequence_parallel_region(kv_latent, group=self._tp_group)  # [s/tp, b, r]
        kv, _ = self.linear_kv_up_proj(self.kv_layernorm(kv_latent))  # [s, b, np * (qk + hv)]

        s, b = q.shape[:2]
        n = self.num_attention_heads_per_partition
        q = q.view(s, b, n, self.q_head_dim)
        q_nope, q_pe = torch.split(q, [c.qk_head_dim, c.qk_pos_emb_head_dim], dim=-1)
        kv = kv.view(s, b, n, c.qk_head_dim + c.v_head_dim)
        k_nope, v = torch.split(kv, [c.qk_head_dim, c.v_head_dim], dim=-1)
        q_pe = apply_rotary_pos_emb(_deinterleave(q_pe), emb, config=c, mscale=mscale)
        k_pe = apply_rotary_pos_emb(_deinterleave(k_pe.unsqueeze(2)), emb, config=c, mscale=mscale)  # [s, b, 1, pe]
        query = torch.cat([q_nope, q_pe], dim=-1)  # [s, b, np, qk + pe]
        key = torch.cat([k_nope, k_pe.expand(-1, -1, n, -1)], dim=-1)
        return query, key, v.contiguous()
