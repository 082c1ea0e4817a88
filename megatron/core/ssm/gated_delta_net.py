"""Gated DeltaNet mixer (Megatron's ``GatedDeltaNet``, Qwen3-Next's linear attention): in-projection to
[q, k, v, z, beta, alpha], short causal depthwise conv + SiLU over [q, k, v], L2-normalised q/k, the gated
delta rule with per-head decay exp(-exp(A_log) softplus(alpha + dt_bias)) and write strength
sigmoid(beta), a per-head RMSNorm gated by silu(z), out-projection.

TP splits key and value heads (rank r holds its slice of each section of in_proj and of the conv);
out_proj is row-parallel. Used as ``self_attention`` of a TransformerLayer, so it takes attention's call.
"""
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F

from megatron.core.context_parallel.all_to_all import seq_gather_head_scatter, seq_scatter_head_gather
from megatron.core.process_groups_config import get_pg, get_pg_size
from megatron.core.ssm.mamba_mixer import _a_log_init
from megatron.core.ssm.ops.kernels import gated_delta_rule
from megatron.core.ssm.ops.packed import causal_conv1d_documents, document_ids, document_spans, per_document
from megatron.core.ssm.ops.recurrent_step import causal_conv1d_step, conv_state_after, gated_delta_step
from megatron.core.ssm.utils import conv_init_fn, set_partition_sections, tp_param
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module


@dataclass
class GatedDeltaNetSubmodules:
    in_proj: Union[ModuleSpec, type] = IdentityOp
    out_norm: Union[ModuleSpec, type] = IdentityOp
    out_proj: Union[ModuleSpec, type] = IdentityOp


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the head dim, in fp32 (fla's l2norm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


class GatedDeltaNet(MegatronModule):
    """[s, b, h] -> ([s, b, h], bias). Shapes: ``linear_num_key_heads`` x ``linear_key_head_dim`` for q and
    k, ``linear_num_value_heads`` x ``linear_value_head_dim`` for v; conv width ``linear_conv_kernel_dim``."""

    def __init__(self, config, submodules: GatedDeltaNetSubmodules, layer_number: int = None, bias: bool = False,
                 conv_bias: bool = False, conv_init=None, use_qk_l2norm: bool = True, A_init_range=(1, 16),
                 pg_collection=None, *, name=None, cp_comm_type=None, pp_layer_offset: int = 0, **kwargs):
        super().__init__(config)
        self.layer_number, self.use_qk_l2norm = layer_number, use_qk_l2norm
        self.key_head_dim, self.value_head_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.num_key_heads, self.num_value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.conv_kernel_dim = config.linear_conv_kernel_dim
        tp = get_pg_size(pg_collection, "tp", "GatedDeltaNet")
        self.cp = get_pg_size(pg_collection, "cp", "GatedDeltaNet")
        check_gdn_shapes(self.num_key_heads, self.num_value_heads, tp, self.cp)
        self.cp_group = get_pg(pg_collection, "cp", "GatedDeltaNet") if self.cp > 1 else None
        self.nk_local, self.nv_local = self.num_key_heads // tp, self.num_value_heads // tp
        self.qk_local, self.v_local = self.nk_local * self.key_head_dim, self.nv_local * self.value_head_dim
        qk_dim, v_dim = self.num_key_heads * self.key_head_dim, self.num_value_heads * self.value_head_dim
        tp_kwargs = {} if pg_collection is None else {"tp_group": pg_collection.tp}
        self.in_proj = build_module(
            submodules.in_proj, config.hidden_size, 2 * qk_dim + 2 * v_dim + 2 * self.num_value_heads,
            config=config, init_method=config.init_method, gather_output=False, bias=bias, skip_bias_add=False,
            is_expert=False, tp_comm_buffer_name="fc1", **tp_kwargs)
        set_partition_sections(self.in_proj.weight, [
            ("query", self.qk_local), ("key", self.qk_local), ("value", self.v_local), ("z", self.v_local),
            ("beta", self.nv_local), ("alpha", self.nv_local)])
        conv_dim = 2 * self.qk_local + self.v_local
        sections = [("query", self.qk_local), ("key", self.qk_local), ("value", self.v_local)]
        init_conv = conv_init_fn(self.conv_kernel_dim, conv_init)
        self.conv1d = torch.nn.Conv1d(conv_dim, conv_dim, self.conv_kernel_dim, groups=conv_dim,
                                      padding=self.conv_kernel_dim - 1, bias=conv_bias, device="meta")
        self.conv1d.weight = tp_param((conv_dim, 1, self.conv_kernel_dim), config, init_conv, sections=sections)
        if conv_bias:
            self.conv1d.bias = tp_param((conv_dim,), config, init_conv, sections=sections)
        self.dt_bias = tp_param((self.nv_local,), config, torch.nn.init.ones_)
        self.A_log = tp_param((self.nv_local,), config, _a_log_init(*A_init_range))
        self.out_norm = build_module(submodules.out_norm, config=config, hidden_size=self.value_head_dim,
                                     eps=config.layernorm_epsilon)
        for p in self.out_norm.parameters():  # replicated over TP but applied to TP-split heads: TP grad sum
            p.sequence_parallel = True
        self.out_proj = build_module(
            submodules.out_proj, v_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=bias, input_is_parallel=True, skip_bias_add=True,
            is_expert=False, tp_comm_buffer_name="fc2", **tp_kwargs)

    def forward(self, hidden_states, attention_mask=None, inference_context=None, packed_seq_params=None,
                **kwargs):
        proj, _ = self.in_proj(hidden_states)  # [s, b, proj/tp]
        if packed_seq_params is not None and (self.cp > 1 or inference_context is not None):
            raise NotImplementedError("packed sequences through Gated DeltaNet layers need --context-parallel-size "
                                      "1 and training (not generation)")
        if self.cp > 1:
            if inference_context is not None:
                raise NotImplementedError("Gated DeltaNet layers generate with --context-parallel-size 1 only")
            return self.out_proj(self._forward_context_parallel(proj, hidden_states.dtype))
        s, b, _ = proj.shape
        proj = proj.transpose(0, 1)  # [b, s, proj/tp]
        qkv, z, beta, alpha = torch.split(
            proj, [2 * self.qk_local + self.v_local, self.v_local, self.nv_local, self.nv_local], dim=-1)
        states = None if inference_context is None else inference_context.recurrent_state(self.layer_number, [
            ((qkv.shape[-1], self.conv_kernel_dim - 1), qkv.dtype, qkv.device),
            ((self.nv_local, self.key_head_dim, self.value_head_dim), torch.float32, qkv.device)])
        decode = states is not None and inference_context.is_decode_only()
        if decode:
            qkv = F.silu(causal_conv1d_step(states[0][:b], qkv[:, 0], self.conv1d.weight, self.conv1d.bias))[:, None]
        else:
            if states is not None:  # prefill: the conv state is the prompt's last inputs
                states[0][inference_context.slot_ids] = conv_state_after(
                    qkv, inference_context.prefill_lengths, self.conv_kernel_dim).to(states[0].dtype)
            if packed_seq_params is not None:  # the conv never reads back into the previous document
                doc = document_ids(packed_seq_params, b, s)
                qkv = F.silu(causal_conv1d_documents(qkv, self.conv1d.weight, self.conv1d.bias, doc))
            else:
                qkv = _causal_conv_silu(qkv, self.conv1d.weight, self.conv1d.bias)
        q, k, v, g, beta = self._scan_inputs(qkv.to(proj.dtype), beta, alpha)
        if decode:
            o = gated_delta_step(states[1][:b], q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])[:, None]
        elif packed_seq_params is not None:  # each document from a zero state
            o = per_document(lambda *t: _scan(*t)[0], document_spans(doc), q, k, v, g, beta)
        elif states is None:
            o, _ = _scan(q, k, v, g, beta)
        else:
            lengths = inference_context.prefill_lengths
            if lengths is not None:  # g = beta = 0 past a row's prompt: no decay, no write; its state stops there
                valid = torch.arange(s, device=g.device)[None, :] < lengths[:, None]
                g, beta = g * valid[..., None], beta * valid[..., None]
            o, final = _scan(q, k, v, g, beta, output_final_state=True)
            states[1][inference_context.slot_ids] = final.float()
        return self.out_proj(self._gated_norm(o, z, hidden_states.dtype))

    def _forward_context_parallel(self, proj, dtype):
        """CP > 1 (as Megatron's): an all-to-all trades this rank's two sequence chunks of every key head (with
        its value heads' v, beta and alpha) for the whole sequence of 1/CP of the key heads; the conv and the
        gated delta rule run there with this rank's conv, dt_bias and A_log entries; a second all-to-all
        trades the outputs back, and the gated norm runs on the local chunks. Returns [s, b, v/tp]."""
        s, b, _ = proj.shape
        nk, cp, dk, dv = self.nk_local, self.cp, self.key_head_dim, self.value_head_dim
        r = self.nv_local // nk  # value heads per key head
        q, k, v, z, beta, alpha = torch.split(
            proj, [self.qk_local, self.qk_local, self.v_local, self.v_local, self.nv_local, self.nv_local], dim=-1)
        per_head = torch.cat([q.reshape(s, b, nk, dk), k.reshape(s, b, nk, dk), v.reshape(s, b, nk, r * dv),
                              beta.reshape(s, b, nk, r), alpha.reshape(s, b, nk, r)], dim=-1)
        full = seq_gather_head_scatter(per_head, self.cp_group)  # [S, b, nk/cp, w], natural order
        S, kl = full.shape[0], nk // cp
        q, k, v, beta, alpha = torch.split(full, [dk, dk, r * dv, r, r], dim=-1)
        h0 = torch.distributed.get_rank(self.cp_group) * kl  # this rank's first key head
        channels = torch.cat([torch.arange(h0 * dk, (h0 + kl) * dk),  # query
                              self.qk_local + torch.arange(h0 * dk, (h0 + kl) * dk),  # key
                              2 * self.qk_local + torch.arange(h0 * r * dv, (h0 + kl) * r * dv)]).to(proj.device)
        qkv = torch.cat([q.reshape(S, b, kl * dk), k.reshape(S, b, kl * dk), v.reshape(S, b, kl * r * dv)], -1)
        bias = None if self.conv1d.bias is None else self.conv1d.bias.index_select(0, channels)
        qkv = _causal_conv_silu(qkv.transpose(0, 1), self.conv1d.weight.index_select(0, channels), bias)
        heads = slice(h0 * r, (h0 + kl) * r)  # this rank's value heads
        beta, alpha = beta.reshape(S, b, kl * r).transpose(0, 1), alpha.reshape(S, b, kl * r).transpose(0, 1)
        q, k, v, g, beta = self._scan_inputs(qkv.to(proj.dtype), beta, alpha, heads)  # [b, S, nv/cp, ...]
        o, _ = _scan(q, k, v, g, beta)
        o = o.transpose(0, 1).reshape(S, b, kl, r * dv)  # [S, b, nk/cp, r dv]
        o = seq_scatter_head_gather(o, self.cp_group).reshape(s, b, self.nv_local, dv).transpose(0, 1)
        return self._gated_norm(o, z.transpose(0, 1), dtype)

    def _scan_inputs(self, qkv, beta, alpha, heads=slice(None)):
        """The gated delta rule's inputs for kh key heads and their value heads ``heads`` (of this rank's nv/tp):
        from the conv output ``qkv`` [b, S, kh dk | kh dk | kh r dv] and the raw ``beta``, ``alpha`` [b, S, kh r],
        q and k [b, S, kh r, dk] (L2-normalised, repeated for each key head's r value heads), v [b, S, kh r, dv],
        the decay g = -exp(A_log) softplus(alpha + dt_bias) <= 0 and the write strength sigmoid(beta), fp32."""
        b, S, _ = qkv.shape
        dk, dv, nv = self.key_head_dim, self.value_head_dim, alpha.shape[-1]
        kh = nv // (self.nv_local // self.nk_local)
        q, k, v = torch.split(qkv, [kh * dk, kh * dk, nv * dv], dim=-1)
        q, k, v = q.reshape(b, S, kh, dk), k.reshape(b, S, kh, dk), v.reshape(b, S, nv, dv)
        if self.use_qk_l2norm:
            q, k = _l2norm(q), _l2norm(k)
        if nv != kh:  # value heads share key heads in consecutive groups
            q, k = q.repeat_interleave(nv // kh, dim=2), k.repeat_interleave(nv // kh, dim=2)
        g = -self.A_log[heads].float().exp() * F.softplus(alpha.float() + self.dt_bias[heads].float())
        return q, k, v, g, beta.float().sigmoid()

    def _gated_norm(self, o, z, dtype):
        """The per-head norm of the scan output ``o`` [b, s, nv/tp, dv], gated by silu(z) (``z`` [b, s, v/tp]);
        returns [s, b, v/tp] in ``dtype``."""
        b, s = z.shape[:2]
        y = self.out_norm(o.to(dtype)) * F.silu(z.reshape(b, s, self.nv_local, self.value_head_dim).float())
        return y.to(dtype).reshape(b, s, self.v_local).transpose(0, 1)


def _causal_conv_silu(x, weight, bias):
    """silu of the causal depthwise conv of ``x`` [b, S, channels] with taps ``weight`` [channels, 1, width]
    (and ``bias``): the left-padded conv1d cut to the first S outputs. Returns [b, S, channels]."""
    S = x.shape[1]
    y = F.conv1d(x.transpose(1, 2), weight, bias, padding=weight.shape[-1] - 1, groups=weight.shape[0])
    return F.silu(y[..., :S]).transpose(1, 2)


def _scan(q, k, v, g, beta, output_final_state=False):
    """The chunked gated delta rule over [b, S, heads, d] q, k, v and [b, S, heads] g, beta (cast to q's
    dtype), from a zero state: (o [b, S, heads, dv], the final state or None)."""
    return gated_delta_rule(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                            beta.to(q.dtype).contiguous(), output_final_state=output_final_state)


def check_gdn_shapes(num_key_heads: int, num_value_heads: int, tp: int, cp: int = 1) -> None:
    """One-line errors for Gated DeltaNet head counts that TP, CP or the key/value grouping cannot split."""
    if num_value_heads % num_key_heads:
        raise ValueError(f"--linear-num-value-heads ({num_value_heads}) must be a multiple of "
                         f"--linear-num-key-heads ({num_key_heads})")
    if num_key_heads % tp or num_value_heads % tp:
        raise ValueError(f"--linear-num-key-heads ({num_key_heads}) and --linear-num-value-heads "
                         f"({num_value_heads}) must be divisible by --tensor-model-parallel-size ({tp})")
    if (num_key_heads // tp) % cp:
        raise ValueError(f"--linear-num-key-heads ({num_key_heads}) must be divisible by --tensor-model-parallel-size "
                         f"x --context-parallel-size ({tp} x {cp}): context parallelism gives each rank whole key "
                         "heads")
