"""Self-attention with grouped query attention, fused QKV and optional QK-norm."""
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.process_groups_config import get_pg_size
from megatron.core.tensor_parallel.random import checkpoint
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.no_rope import layer_skips_rope
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.utils import lazy_names

# Megatron's typing Protocols for the attention spec (types only, defined in spec_protocols.py), resolved
# on first use.
__getattr__ = lazy_names(__name__, {name: "megatron.core.transformer.spec_protocols" for name in (
    "CoreAttentionBuilder", "CoreAttentionInterface", "LinearInterface", "LinearLayerBuilder", "LinearProjBuilder",
    "LinearProjInterface", "LinearQkvBuilder", "LinearQkvInterface")})


@dataclass
class SelfAttentionSubmodules:
    linear_qkv: Union[ModuleSpec, type] = None
    core_attention: Union[ModuleSpec, type] = None
    linear_proj: Union[ModuleSpec, type] = None
    q_layernorm: Union[ModuleSpec, type] = None
    k_layernorm: Union[ModuleSpec, type] = None


class Attention(MegatronModule, ABC):
    """What self- and cross-attention share (Megatron's base class): the core attention over local heads
    and the row-parallel output projection; subclasses build the query/key/value projections and
    implement `get_query_key_value_tensors`. ``pp_layer_offset`` (Megatron's per-stage KV-cache index) is
    refused: the KV cache here is indexed by the global layer number. ``name`` is a label only (Megatron
    hands it to Transformer Engine). ``pg_collection``: its ``tp`` group splits the heads (the linears get
    it as ``tp_group``) and core attention gets the collection (parallel_state's groups when None)."""

    _proj_buffer_name = "proj"

    def __init__(self, config, submodules, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 cp_comm_type: Optional[str] = None, pg_collection=None, pp_layer_offset: Optional[int] = None,
                 name: Optional[str] = None):
        super().__init__(config)
        if pp_layer_offset is not None:
            raise NotImplementedError(f"{type(self).__name__}(pp_layer_offset=...) is not supported: the KV cache "
                                      "is indexed by the global layer number")
        self.name = name
        self.layer_number, self.attn_mask_type, self.attention_type = layer_number, attn_mask_type, attention_type
        self.pg_collection = pg_collection
        tp = self._tp = get_pg_size(pg_collection, "tp", type(self).__name__)
        # The linears and core attention get the explicit groups only when given: specs may name modules
        # that take none, and the default build stays as it was.
        self._tp_kwargs = {} if pg_collection is None else {"tp_group": pg_collection.tp}
        self._pg_kwargs = {} if pg_collection is None else {"pg_collection": pg_collection}
        if config.num_attention_heads % tp or config.num_query_groups % tp:
            raise ValueError(f"num_attention_heads ({config.num_attention_heads}) and num_query_groups "
                             f"({config.num_query_groups}) must be divisible by the TP size ({tp})")
        self.hn = config.kv_channels
        self.np = config.num_attention_heads // tp  # local heads
        self.ng = config.num_query_groups // tp  # local query groups
        self.query_projection_size = config.kv_channels * config.num_attention_heads
        self.kv_projection_size = config.kv_channels * config.num_query_groups
        self._submodules, self._cp_comm_type = submodules, cp_comm_type

    def _build_core_and_proj(self):
        """Core attention and linear_proj (called by subclasses after their input projections, keeping
        the module order of the checkpoints)."""
        config, submodules = self.config, self._submodules
        self.core_attention = build_module(submodules.core_attention, config=config, layer_number=self.layer_number,
                                           attn_mask_type=self.attn_mask_type, attention_type=self.attention_type,
                                           cp_comm_type=self._cp_comm_type, **self._pg_kwargs)
        self.linear_proj = build_module(
            submodules.linear_proj, self.query_projection_size, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear, input_is_parallel=True,
            skip_bias_add=True, is_expert=False, tp_comm_buffer_name=self._proj_buffer_name, **self._tp_kwargs)
        self.checkpoint_core_attention = (config.recompute_granularity == "selective"
                                          and "core_attn" in (config.recompute_modules or []))

    @abstractmethod
    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate: bool = False):
        """(q [s, b, np, hn], k, v [sk, b, ng, hn]) from the input (and the encoder output); with
        ``output_gate``, also the output gate [s, b, np, hn]."""

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, **kwargs):
        gated = self.attention_type == "self" and self.config.attention_output_gate
        sink = getattr(self.core_attention, "softmax_offset", None)  # --softmax-type: the heads' sink logits
        no_rope = layer_skips_rope(getattr(self.config, "no_rope_freq", None), self.layer_number)
        if no_rope:
            rotary_pos_emb = None  # --no-rope-freq: a NoPE layer (in generation the context rotates: told below)
        if (inference_context is not None and key_value_states is None and hasattr(self, "linear_qkv")
                and not no_rope
                and sink is None
                and getattr(self, "q_layernorm", None) is None and getattr(self, "k_layernorm", None) is None
                and not gated and hasattr(inference_context, "attention_from_qkv")):  # generation: fused layout
            mixed, _ = self.linear_qkv(hidden_states)  # [s, b, ng * (np/ng + 2) * hn]
            return self.linear_proj(inference_context.attention_from_qkv(
                self.layer_number, mixed, self.ng, self.hn, self.core_attention.softmax_scale))
        gate = None
        if gated:
            q, k, v, gate = self.get_query_key_value_tensors(hidden_states, key_value_states, output_gate=True)
        else:
            q, k, v = self.get_query_key_value_tensors(hidden_states, key_value_states)
        if rotary_pos_emb is not None:
            q_emb, k_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            q = apply_rotary_pos_emb(q, q_emb, config=self.config)
            k = apply_rotary_pos_emb(k, k_emb, config=self.config)
        if inference_context is not None:  # generation: the context owns the KV cache (core/inference)
            ctx = inference_context.attention(self.layer_number, q, k, v, self.core_attention.softmax_scale,
                                              **({} if sink is None else {"sink": sink}),
                                              **({"rope": False} if no_rope else {}))
        elif self.checkpoint_core_attention and self.training:
            ctx = checkpoint(lambda q_, k_, v_, m_: self.core_attention(
                q_, k_, v_, m_, packed_seq_params=packed_seq_params), False, q, k, v, attention_mask)
        else:
            ctx = self.core_attention(q, k, v, attention_mask, attention_bias=attention_bias,
                                      packed_seq_params=packed_seq_params)  # [s, b, np * hn]
        if gate is not None:  # --attention-output-gate (Qwen3-Next): ctx * sigmoid(gate), per head channel
            ctx = (ctx.float() * torch.sigmoid(gate.reshape(ctx.shape).float())).to(ctx.dtype)
        return self.linear_proj(ctx)  # (output, bias)


class SelfAttention(Attention):
    """x -> QKV (column-parallel) -> RoPE -> core attention per local head -> proj (row-parallel).

    The fused QKV output is laid out per query group, [ng, (np/ng + 2) * hn]: each group's queries,
    then its key, then its value. TP splits whole groups, so a rank's slice is the same layout. With
    ``config.attention_output_gate`` (Megatron's layout) each group holds [queries, their gates, key, value].
    """

    def __init__(self, config, submodules: SelfAttentionSubmodules, layer_number: int,
                 attn_mask_type: AttnMaskType = AttnMaskType.padding, cp_comm_type: Optional[str] = None,
                 pg_collection=None, pp_layer_offset: Optional[int] = None, name: Optional[str] = None, **kwargs):
        super().__init__(config, submodules, layer_number, attn_mask_type, "self", cp_comm_type, pg_collection,
                         pp_layer_offset, name)
        gate_size = self.query_projection_size if config.attention_output_gate else 0
        self.linear_qkv = build_module(
            submodules.linear_qkv, config.hidden_size,
            self.query_projection_size + gate_size + 2 * self.kv_projection_size,
            config=config, init_method=config.init_method, gather_output=False,
            bias=config.add_bias_linear or config.add_qkv_bias, skip_bias_add=False, is_expert=False,
            tp_comm_buffer_name="qkv", **self._tp_kwargs)
        self._build_core_and_proj()
        self.q_layernorm = self._build_qk_norm(submodules.q_layernorm)
        self.k_layernorm = self._build_qk_norm(submodules.k_layernorm)

    def _build_qk_norm(self, spec):
        if spec is None:
            return None
        norm = build_module(spec, config=self.config, hidden_size=self.hn, eps=self.config.layernorm_epsilon)
        # Each TP rank normalises different heads, so these grads are partial sums over TP
        # (with or without SP): flag them for the TP all-reduce in finalize_model_grads.
        for p in norm.parameters():
            p.sequence_parallel = self._tp > 1
        return norm

    def qk_clip_row_scale(self) -> torch.Tensor:
        """QK-clip's factor for each row of linear_qkv.weight, fp32 [rows] (Megatron's formula, per query group):
        eta = threshold / max logit of the group's heads where that exceeds the threshold, else 1; the group's
        query rows get eta^alpha, its key rows eta^(1 - alpha), gate and value rows 1. The logits q.k of a head
        then shrink by eta, to at most the threshold."""
        cfg = self.config
        max_logits = self.core_attention.current_max_attn_logits  # [np], this rank's heads
        assert max_logits.shape == (self.np,), f"current_max_attn_logits has shape {tuple(max_logits.shape)}"
        grouped = max_logits.view(self.ng, -1).amax(dim=1)  # [ng]
        eta = torch.where(grouped > cfg.qk_clip_threshold, cfg.qk_clip_threshold / grouped,
                          torch.ones_like(grouped))[:, None]  # [ng, 1]
        per_group, hn = self.np // self.ng, self.hn
        ones = torch.ones(self.ng, hn, dtype=torch.float32, device=eta.device)
        parts = [(eta ** cfg.qk_clip_alpha).expand(self.ng, per_group * hn)]
        if cfg.attention_output_gate:
            parts.append(ones.repeat(1, per_group))
        parts += [(eta ** (1.0 - cfg.qk_clip_alpha)).expand(self.ng, hn), ones]
        return torch.cat(parts, dim=1).reshape(-1)  # the fused layout: [ng, (queries, gates, key, value) rows]

    @torch.no_grad()
    def clip_qk(self, main_params=()):
        """QK-clip (Megatron's method): rescale linear_qkv.weight by `qk_clip_row_scale` and reset the recorded
        max. ``main_params``: the optimizer's fp32 copies of that weight as (tensor, start, end), each holding
        [start, end) of weight.view(-1) (a whole copy, or a distributed optimizer's shard); they are rescaled
        alike so that the next step starts from the clipped weight. Rows with factor 1 are unchanged."""
        if not self.config.qk_clip:
            raise ValueError("clip_qk needs config.qk_clip (--qk-clip)")
        if self.core_attention.current_max_attn_logits is None:
            raise ValueError("clip_qk: no max attention logit recorded (no training forward since the last clip)")
        scale = self.qk_clip_row_scale()
        weight = self.linear_qkv.weight
        for main, start, end in main_params:
            _scale_rows_of_range(main.detach().view(-1), start, weight.shape[1], scale.to(main.device))
        weight.detach().mul_(scale.to(weight.device)[:, None])  # computed in fp32, stored in the weight's dtype
        self.core_attention.current_max_attn_logits = None

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate: bool = False):
        mixed, _ = self.linear_qkv(hidden_states)  # [s, b, ng * ((1 + gated) np/ng + 2) * hn]
        s, b = mixed.shape[:2]
        per_group = self.np // self.ng
        gate_size = per_group * self.hn if self.config.attention_output_gate else 0
        mixed = mixed.view(s, b, self.ng, -1)  # [s, b, ng, ((1 + gated) np/ng + 2) * hn]
        q, gate, k, v = torch.split(mixed, [per_group * self.hn, gate_size, self.hn, self.hn], dim=3)
        q = q.reshape(s, b, self.np, self.hn)  # [s, b, np, hn]
        if self.q_layernorm is not None:
            q = self.q_layernorm(q)
        if self.k_layernorm is not None:
            k = self.k_layernorm(k)  # [s, b, ng, hn]
        if output_gate:
            return q, k, v, gate.reshape(s, b, self.np, self.hn)
        return q, k, v


def _scale_rows_of_range(flat, start, cols, scale):
    """flat holds elements [start, start + numel) of a row-major [rows, cols] matrix: multiply each element by
    ``scale`` of its row, in place (a partial first row, whole rows, a partial last row; no index tensor)."""
    n, row, done = flat.numel(), start // cols, 0
    head = min(n, (cols - start % cols) % cols)
    if head:
        flat[:head].mul_(scale[row])
        row, done = row + 1, head
    full = (n - done) // cols
    if full:
        flat[done:done + full * cols].view(full, cols).mul_(scale[row:row + full, None])
        row, done = row + full, done + full * cols
    if done < n:
        flat[done:].mul_(scale[row])


@dataclass
class CrossAttentionSubmodules:
    linear_q: Union[ModuleSpec, type] = None
    linear_kv: Union[ModuleSpec, type] = None
    core_attention: Union[ModuleSpec, type] = None
    linear_proj: Union[ModuleSpec, type] = None


class CrossAttention(Attention):
    """Cross-attention (T5 decoder): x -> Q (column-parallel); the encoder output -> KV (column-parallel);
    core attention; proj (row-parallel).

    linear_kv's output is laid out per head, [np, 2 * hn] (each head's key then its value), so a TP
    split of whole heads keeps the layout. No GQA here, as in Megatron.
    """

    _proj_buffer_name = None

    def __init__(self, config, submodules: CrossAttentionSubmodules, layer_number: int,
                 attn_mask_type: AttnMaskType = AttnMaskType.padding, cp_comm_type=None, pg_collection=None,
                 name: Optional[str] = None, **kwargs):
        if config.num_query_groups != config.num_attention_heads:
            raise ValueError("cross attention does not support grouped-query attention; drop "
                             "--group-query-attention for encoder-decoder models")
        super().__init__(config, submodules, layer_number, attn_mask_type, "cross", cp_comm_type, pg_collection,
                         name=name)
        bias = config.add_bias_linear or config.add_qkv_bias
        self.linear_q = build_module(
            submodules.linear_q, config.hidden_size, self.query_projection_size, config=config,
            init_method=config.init_method, gather_output=False, bias=bias, skip_bias_add=False, is_expert=False,
            **self._tp_kwargs)
        self.linear_kv = build_module(
            submodules.linear_kv, config.hidden_size, 2 * self.query_projection_size, config=config,
            init_method=config.init_method, gather_output=False, bias=bias, skip_bias_add=False, is_expert=False,
            **self._tp_kwargs)
        self._build_core_and_proj()

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None):
        q, _ = self.linear_q(hidden_states)  # [sq, b, np * hn]
        sq, b = q.shape[:2]
        q = q.view(sq, b, self.np, self.hn)  # [sq, b, np, hn]
        kv, _ = self.linear_kv(key_value_states)  # [sk, b, np * 2 * hn]
        kv = kv.view(kv.shape[0], b, self.np, 2 * self.hn)  # [sk, b, np, 2 * hn]
        k, v = kv.split(self.hn, dim=3)  # [sk, b, np, hn] each
        return q, k, v

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, attention_bias=None, packed_seq_params=None, **kwargs):
        if key_value_states is None:
            raise ValueError("CrossAttention needs key_value_states (the encoder output)")
        if inference_context is not None or rotary_pos_emb is not None:
            raise NotImplementedError("cross attention with a KV cache or rotary embeddings is not supported")
        return super().forward(hidden_states, attention_mask, key_value_states, attention_bias=attention_bias,
                               packed_seq_params=packed_seq_params)
