"""Cross-attention (T5 decoder): queries from the decoder stream, keys/values from the encoder output."""
from dataclasses import dataclass
from typing import Optional, Union

from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module


@dataclass
class CrossAttentionSubmodules:
    linear_q: Union[ModuleSpec, type] = None
    linear_kv: Union[ModuleSpec, type] = None
    core_attention: Union[ModuleSpec, type] = None
    linear_proj: Union[ModuleSpec, type] = None


class CrossAttention(MegatronModule):
    """x -> Q (column-parallel); context -> KV (column-parallel); core attention; proj (row-parallel).

    linear_kv's output is laid out per head, [np, 2 * hn] (each head's key then its value), so a TP
    split of whole heads keeps the layout. No GQA here, as in Megatron.
    """

    def __init__(self, config, submodules: CrossAttentionSubmodules, layer_number: int,
                 attn_mask_type: AttnMaskType = AttnMaskType.padding, cp_comm_type=None, pg_collection=None,
                 name: Optional[str] = None, **kwargs):
        super().__init__(config)
        self.name = name  # a label only (Megatron hands it to Transformer Engine)
        if config.num_query_groups != config.num_attention_heads:
            raise ValueError("cross attention does not support grouped-query attention; drop "
                             "--group-query-attention for encoder-decoder models")
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if config.num_attention_heads % tp:
            raise ValueError(f"num_attention_heads ({config.num_attention_heads}) must be divisible by the "
                             f"TP size ({tp})")
        self.layer_number = layer_number
        self.hn = config.kv_channels
        self.np = config.num_attention_heads // tp
        proj_size = config.kv_channels * config.num_attention_heads
        bias = config.add_bias_linear or config.add_qkv_bias
        self.linear_q = build_module(
            submodules.linear_q, config.hidden_size, proj_size, config=config, init_method=config.init_method,
            gather_output=False, bias=bias, skip_bias_add=False, is_expert=False)
        self.linear_kv = build_module(
            submodules.linear_kv, config.hidden_size, 2 * proj_size, config=config,
            init_method=config.init_method, gather_output=False, bias=bias, skip_bias_add=False, is_expert=False)
        self.core_attention = build_module(submodules.core_attention, config=config, layer_number=layer_number,
                                           attn_mask_type=attn_mask_type, attention_type="cross")
        self.linear_proj = build_module(
            submodules.linear_proj, proj_size, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear, input_is_parallel=True,
            skip_bias_add=True, is_expert=False)

    def get_query_key_value_tensors(self, hidden_states, key_value_states):
        q, _ = self.linear_q(hidden_states)  # [sq, b, np * hn]
        sq, b = q.shape[:2]
        q = q.view(sq, b, self.np, self.hn)  # [sq, b, np, hn]
        kv, _ = self.linear_kv(key_value_states)  # [sk, b, np * 2 * hn]
        sk = kv.shape[0]
        kv = kv.view(sk, b, self.np, 2 * self.hn)  # [sk, b, np, 2 * hn]
        k, v = kv.split(self.hn, dim=3)  # [sk, b, np, hn] each
        return q, k, v

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, attention_bias=None, packed_seq_params=None, **kwargs):
        if key_value_states is None:
            raise ValueError("CrossAttention needs key_value_states (the encoder output)")
        if inference_context is not None or rotary_pos_emb is not None:
            raise NotImplementedError("cross attention with a KV cache or rotary embeddings is not supported")
        q, k, v = self.get_query_key_value_tensors(hidden_states, key_value_states)
        ctx = self.core_attention(q, k, v, attention_mask, attention_bias=attention_bias,
                                  packed_seq_params=packed_seq_params)  # [sq, b, np * hn]
        return self.linear_proj(ctx)  # (output, bias)
