"""Mamba-2 mixer (Megatron's ``MambaMixer``): in-projection to [z, x, B, C, dt], short causal depthwise
conv over [x, B, C], the SSD scan with learned A, D and dt bias, gated RMSNorm, out-projection.

TP splits the heads and the B/C groups: rank r holds heads [r H/tp, (r+1) H/tp) and their groups, so the
scan, the conv and the norm are local; in_proj is column-parallel (sections split one by one, as
Megatron lays them out) and out_proj row-parallel. Parameter names are Megatron's (``in_proj``,
``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``).
"""
import math
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F

from megatron.core.context_parallel.all_to_all import seq_gather_head_scatter, seq_scatter_head_gather
from megatron.core.process_groups_config import get_pg, get_pg_size
from megatron.core.ssm.gated_norm import GatedRMSNorm
from megatron.core.ssm.ops.kernels import ssd_scan
from megatron.core.ssm.ops.packed import causal_conv1d_documents, document_ids, document_spans, per_document
from megatron.core.ssm.ops.recurrent_step import causal_conv1d_step, conv_state_after, ssd_step
from megatron.core.ssm.utils import conv_init_fn, set_partition_sections, tp_param
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module


@dataclass
class MambaMixerSubmodules:
    in_proj: Union[ModuleSpec, type] = None
    out_proj: Union[ModuleSpec, type] = None


def _dt_bias_init(dt_min: float, dt_max: float, dt_init_floor: float):
    """dt_bias = softplus^-1(dt), dt log-uniform in [dt_min, dt_max] (floored): the step size starts there."""
    def init(t):
        dt = torch.exp(torch.rand(t.shape, dtype=torch.float32, device=t.device)
                       * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=dt_init_floor)
        return t.copy_(dt + torch.log(-torch.expm1(-dt)))
    return init


def _a_log_init(low: float, high: float):
    def init(t):
        return t.copy_(torch.log(torch.empty(t.shape, dtype=torch.float32, device=t.device).uniform_(low, high)))
    return init


class MambaMixer(MegatronModule):
    """[s, b, h] -> ([s, b, h], bias). Shapes from the config: ``mamba_state_dim`` (n), ``mamba_head_dim``
    (p), ``mamba_num_groups`` (G) and ``mamba_num_heads`` (H; default expand * hidden / p)."""

    def __init__(self, config, submodules: MambaMixerSubmodules, d_model: int, d_conv: int = 4, conv_init=None,
                 expand: int = 2, A_init_range=(1, 16), D_has_hdim: bool = False, rmsnorm: bool = True,
                 norm_before_gate: bool = False, dt_min: float = 0.001, dt_max: float = 0.1, dt_init="random",
                 dt_scale: float = 1.0, dt_init_floor: float = 1e-4, bias: bool = False, conv_bias: bool = True,
                 chunk_size: int = 128, layer_number=None, pg_collection=None, pp_layer_offset: int = 0,
                 name=None):
        super().__init__(config)
        if bias or not conv_bias or norm_before_gate or not rmsnorm or dt_init != "random" or dt_scale != 1.0:
            raise NotImplementedError("MambaMixer supports Megatron's defaults only: bias=False, conv_bias=True, "
                                      "rmsnorm=True, norm_before_gate=False, dt_init='random', dt_scale=1.0")
        self.layer_number, self.chunk_size, self.d_conv = layer_number, chunk_size, d_conv
        self.d_state, self.headdim = config.mamba_state_dim, config.mamba_head_dim
        self.ngroups = config.mamba_num_groups
        self.nheads = config.mamba_num_heads or (expand * d_model) // self.headdim
        self.d_inner = self.nheads * self.headdim
        tp = get_pg_size(pg_collection, "tp", "MambaMixer")
        self.cp = get_pg_size(pg_collection, "cp", "MambaMixer")
        check_mamba_shapes(self.nheads, self.ngroups, tp, self.cp)
        self.cp_group = get_pg(pg_collection, "cp", "MambaMixer") if self.cp > 1 else None
        self.nheads_local, self.ngroups_local = self.nheads // tp, self.ngroups // tp
        self.d_inner_local = self.d_inner // tp
        gn_local = self.ngroups_local * self.d_state
        tp_kwargs = {} if pg_collection is None else {"tp_group": pg_collection.tp}
        self.in_proj = build_module(
            submodules.in_proj, d_model, 2 * self.d_inner + 2 * self.ngroups * self.d_state + self.nheads,
            config=config, init_method=config.init_method, gather_output=False, bias=bias, skip_bias_add=False,
            is_expert=False, tp_comm_buffer_name="fc1", **tp_kwargs)
        set_partition_sections(self.in_proj.weight, [("z", self.d_inner_local), ("x", self.d_inner_local),
                                                     ("B", gn_local), ("C", gn_local), ("dt", self.nheads_local)])
        conv_dim = self.d_inner_local + 2 * gn_local  # [x, B, C]
        conv_sections = [("x", self.d_inner_local), ("B", gn_local), ("C", gn_local)]
        self.conv1d = torch.nn.Conv1d(conv_dim, conv_dim, d_conv, groups=conv_dim, padding=d_conv - 1, bias=True,
                                      device="meta")
        init_conv = conv_init_fn(d_conv, conv_init)
        self.conv1d.weight = tp_param((conv_dim, 1, d_conv), config, init_conv, sections=conv_sections)
        self.conv1d.bias = tp_param((conv_dim,), config, init_conv, sections=conv_sections)
        self.dt_bias = tp_param((self.nheads_local,), config, _dt_bias_init(dt_min, dt_max, dt_init_floor))
        self.A_log = tp_param((self.nheads_local,), config, _a_log_init(*A_init_range), dtype=torch.float32)
        self.D = tp_param((self.d_inner_local if D_has_hdim else self.nheads_local,), config, torch.nn.init.ones_,
                          dtype=torch.float32)
        self.norm = GatedRMSNorm(config, self.d_inner_local, self.d_inner_local // self.ngroups_local, eps=1e-5)
        self.out_proj = build_module(
            submodules.out_proj, self.d_inner, d_model, config=config, init_method=config.output_layer_init_method,
            bias=bias, input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_comm_buffer_name="fc2",
            **tp_kwargs)

    def forward(self, hidden_states, inference_context=None, packed_seq_params=None, **kwargs):
        zxbcdt, _ = self.in_proj(hidden_states)  # [s, b, proj/tp] (sequence gathered under SP)
        if packed_seq_params is not None:
            if self.cp > 1 or inference_context is not None:
                raise NotImplementedError("packed sequences through Mamba layers need --context-parallel-size 1 "
                                          "and training (not generation)")
            return self._forward_packed(zxbcdt, packed_seq_params)
        if self.cp > 1:
            if inference_context is not None:
                raise NotImplementedError("Mamba layers generate with --context-parallel-size 1 only")
            return self._forward_context_parallel(zxbcdt)
        s, b, _ = zxbcdt.shape
        zxbcdt = zxbcdt.transpose(0, 1)  # [b, s, proj/tp]
        gn = self.ngroups_local * self.d_state
        z, xbc, dt = torch.split(zxbcdt, [self.d_inner_local, self.d_inner_local + 2 * gn, self.nheads_local], -1)
        A = -torch.exp(self.A_log.float())
        if inference_context is not None and inference_context.is_decode_only():
            y = self._decode_step(xbc, dt, A, inference_context)
        else:
            states = None if inference_context is None else self._states(inference_context, xbc)
            if states is not None:  # prefill: the conv state is the prompt's last inputs
                states[0][inference_context.slot_ids] = conv_state_after(
                    xbc, inference_context.prefill_lengths, self.d_conv).to(states[0].dtype)
            xbc = F.silu(self.conv1d(xbc.transpose(1, 2))[..., :s]).transpose(1, 2)  # causal: drop the right pad
            x, B, C = torch.split(xbc, [self.d_inner_local, gn, gn], dim=-1)
            x = x.reshape(b, s, self.nheads_local, self.headdim)
            B = B.reshape(b, s, self.ngroups_local, self.d_state)
            C = C.reshape(b, s, self.ngroups_local, self.d_state)
            dt = F.softplus(dt.float() + self.dt_bias.float())  # [b, s, h/tp]
            if states is None:
                y = ssd_scan(x, dt, A, B, C, self.chunk_size, D=self.D)  # [b, s, h/tp, p]
            else:
                lengths = inference_context.prefill_lengths
                if lengths is not None:  # dt = 0 past a row's prompt: no decay, no input; its state stops there
                    dt = dt * (torch.arange(s, device=dt.device)[None, :] < lengths[:, None])[..., None]
                y, final = ssd_scan(x, dt, A, B, C, self.chunk_size, D=self.D, return_final_states=True)
                states[1][inference_context.slot_ids] = final.float()
        y = y.reshape(b, s, self.d_inner_local).transpose(0, 1)  # [s, b, d_inner/tp]
        y = self.norm(y, z.transpose(0, 1))
        return self.out_proj(y)

    def _forward_packed(self, zxbcdt, packed_seq_params):
        """Several documents per row: the conv masks its taps at document boundaries and the scan runs once per
        document, so every document starts from a zero state (ops/packed.py)."""
        s, b, _ = zxbcdt.shape
        doc = document_ids(packed_seq_params, b, s)
        zxbcdt = zxbcdt.transpose(0, 1)  # [b, s, proj/tp]
        gn = self.ngroups_local * self.d_state
        z, xbc, dt = torch.split(zxbcdt, [self.d_inner_local, self.d_inner_local + 2 * gn, self.nheads_local], -1)
        xbc = F.silu(causal_conv1d_documents(xbc, self.conv1d.weight, self.conv1d.bias, doc))
        x, B, C = torch.split(xbc, [self.d_inner_local, gn, gn], dim=-1)
        x = x.reshape(b, s, self.nheads_local, self.headdim)
        B = B.reshape(b, s, self.ngroups_local, self.d_state)
        C = C.reshape(b, s, self.ngroups_local, self.d_state)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        A = -torch.exp(self.A_log.float())
        y = per_document(lambda *t: ssd_scan(*t[:2], A, *t[2:], self.chunk_size, D=self.D), document_spans(doc),
                         x, dt, B, C)
        y = y.reshape(b, s, self.d_inner_local).transpose(0, 1)
        return self.out_proj(self.norm(y, z.transpose(0, 1)))

    def _forward_context_parallel(self, zxbcdt):
        """CP > 1 (Megatron's all-to-all Mamba context parallelism): the scan needs the whole sequence, so an
        all-to-all trades this rank's two sequence chunks of every group for the whole sequence of 1/CP of the
        groups (with their heads' x and dt and the groups' B and C); conv and scan run on those, a second
        all-to-all trades back, and the gated norm and out_proj run on the local chunks. Each rank uses the
        conv, dt_bias, A_log and D entries of its groups; gradients reach the full parameters."""
        s, b, _ = zxbcdt.shape  # s: this rank's two chunks
        g, cp, ds, p = self.ngroups_local, self.cp, self.d_state, self.headdim
        hpg = self.nheads_local // g  # heads per group
        gn = g * ds
        z, x, B, C, dt = torch.split(zxbcdt, [self.d_inner_local, self.d_inner_local, gn, gn, self.nheads_local], -1)
        per_group = torch.cat([x.reshape(s, b, g, hpg * p), B.reshape(s, b, g, ds), C.reshape(s, b, g, ds),
                               dt.reshape(s, b, g, hpg)], dim=-1)  # [s, b, g, w]
        full = seq_gather_head_scatter(per_group, self.cp_group)  # [S, b, g/cp, w], natural order
        S, gl = full.shape[0], g // cp
        x, B, C, dt = torch.split(full, [hpg * p, ds, ds, hpg], dim=-1)
        g0 = torch.distributed.get_rank(self.cp_group) * gl  # this rank's first group
        heads = slice(g0 * hpg, (g0 + gl) * hpg)
        channels = torch.cat([torch.arange(g0 * hpg * p, (g0 + gl) * hpg * p),  # x of the groups' heads
                              self.d_inner_local + torch.arange(g0 * ds, (g0 + gl) * ds),  # B
                              self.d_inner_local + gn + torch.arange(g0 * ds, (g0 + gl) * ds)]).to(x.device)
        xbc = torch.cat([x.reshape(S, b, gl * hpg * p), B.reshape(S, b, gl * ds), C.reshape(S, b, gl * ds)], -1)
        weight, bias = self.conv1d.weight.index_select(0, channels), self.conv1d.bias.index_select(0, channels)
        xbc = F.conv1d(xbc.permute(1, 2, 0), weight, bias, padding=self.d_conv - 1, groups=channels.numel())
        xbc = F.silu(xbc[..., :S]).transpose(1, 2)  # [b, S, channels]
        x, B, C = torch.split(xbc, [gl * hpg * p, gl * ds, gl * ds], dim=-1)
        x = x.reshape(b, S, gl * hpg, p)
        B, C = B.reshape(b, S, gl, ds), C.reshape(b, S, gl, ds)
        dt = F.softplus(dt.reshape(S, b, gl * hpg).transpose(0, 1).float() + self.dt_bias[heads].float())
        A = -torch.exp(self.A_log[heads].float())
        D = self.D[heads] if self.D.numel() == self.nheads_local else self.D[heads.start * p:heads.stop * p]
        y = ssd_scan(x, dt, A, B, C, self.chunk_size, D=D)  # [b, S, heads/cp, p]
        y = y.transpose(0, 1).reshape(S, b, gl, hpg * p)
        y = seq_scatter_head_gather(y, self.cp_group).reshape(s, b, self.d_inner_local)  # [s, b, d_inner/tp]
        return self.out_proj(self.norm(y, z))

    def _states(self, inference_context, xbc):
        """(conv state [slots, c, d_conv - 1], SSM state [slots, h/tp, p, n] fp32) of this layer."""
        return inference_context.recurrent_state(self.layer_number, [
            ((xbc.shape[-1], self.d_conv - 1), xbc.dtype, xbc.device),
            ((self.nheads_local, self.headdim, self.d_state), torch.float32, xbc.device)])

    def _decode_step(self, xbc, dt, A, inference_context):
        """One token per slot 0..b-1 (xbc [b, 1, c], dt [b, 1, h/tp]) from the states; returns y [b, 1, h/tp, p]."""
        b, gn = xbc.shape[0], self.ngroups_local * self.d_state
        conv_state, ssm_state = self._states(inference_context, xbc)
        xbc = F.silu(causal_conv1d_step(conv_state[:b], xbc[:, 0], self.conv1d.weight, self.conv1d.bias))
        x, B, C = torch.split(xbc.to(dt.dtype), [self.d_inner_local, gn, gn], dim=-1)
        dt = F.softplus(dt[:, 0].float() + self.dt_bias.float())  # [b, h/tp]
        y = ssd_step(ssm_state[:b], x.reshape(b, self.nheads_local, self.headdim), dt, A,
                     B.reshape(b, self.ngroups_local, self.d_state), C.reshape(b, self.ngroups_local, self.d_state),
                     self.D)
        return y.to(x.dtype)[:, None]


def check_mamba_shapes(nheads: int, ngroups: int, tp: int, cp: int = 1) -> None:
    """One-line errors for Mamba head/group counts that TP, CP or the grouping cannot split."""
    if nheads % ngroups:
        raise ValueError(f"Mamba heads ({nheads}) must be divisible by --mamba-num-groups ({ngroups})")
    if nheads % tp:
        raise ValueError(f"Mamba heads ({nheads}, --mamba-num-heads or 2 * --hidden-size / --mamba-head-dim) "
                         f"must be divisible by --tensor-model-parallel-size ({tp})")
    if ngroups % tp:
        raise ValueError(f"--mamba-num-groups ({ngroups}) must be divisible by --tensor-model-parallel-size ({tp})")
    if (ngroups // tp) % cp:
        raise ValueError(f"--mamba-num-groups ({ngroups}) must be divisible by --tensor-model-parallel-size x "
                         f"--context-parallel-size ({tp} x {cp}): context parallelism gives each rank whole groups")
