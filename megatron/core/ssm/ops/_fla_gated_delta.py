"""fla's chunked gated delta rule with one backward step in PyTorch (imported only where fla is installed).

flash-linear-attention 0.6.0's forward and backward Triton kernels, composed as its ``chunk_gated_delta_rule`` composes
them, except ``chunk_bwd_dqkwg`` (dq, dk, dw, dg), which Triton 3.4.0 - 3.7.0 compiles wrongly on Hopper (fla issue
#640): that step runs as ``gated_delta_dqkwg.chunk_bwd_dqkwg_torch``. Written against fla 0.6.0's internal functions;
``unsupported_reason`` refuses any other version or signature so a changed fla falls back to the eager scan.
"""
import inspect

import torch
from fla import __version__ as fla_version
from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
from fla.ops.common.chunk_o import chunk_bwd_dv_local
from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd
from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd, recompute_w_u_fwd
from fla.ops.utils import chunk_local_cumsum
from fla.utils import autocast_custom_bwd, autocast_custom_fwd, input_guard

from megatron.core.ssm.ops.gated_delta_dqkwg import chunk_bwd_dqkwg_torch

FLA_VERSION = "0.6.0"
# the keyword arguments passed to each fla function below; a release that renames one is refused up front
_CALLED_WITH = {
    chunk_gated_delta_rule_fwd: ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
                                 "state_v_first", "chunk_size"),
    recompute_w_u_fwd: ("k", "v", "beta", "A", "g"),
    chunk_gated_delta_rule_fwd_h: ("k", "w", "u", "g", "initial_state", "output_final_state", "state_v_first",
                                   "chunk_size"),
    chunk_bwd_dv_local: ("q", "k", "g", "do", "scale", "chunk_size"),
    chunk_gated_delta_rule_bwd_dhu: ("q", "k", "w", "g", "h0", "dht", "do", "dv", "scale", "state_v_first",
                                     "chunk_size"),
    prepare_wy_repr_bwd: ("k", "v", "beta", "g", "A", "dw", "du"),
    chunk_local_cumsum: ("g", "chunk_size", "reverse"),
}
CHUNK = 64  # fla's default chunk for the gated delta rule


def unsupported_reason() -> str:
    """Why the installed fla does not match the one this composition was written against, or ""."""
    if fla_version != FLA_VERSION:
        return f"flash-linear-attention {fla_version} is installed, the PyTorch backward step matches {FLA_VERSION}"
    for fn, names in _CALLED_WITH.items():
        missing = set(names) - set(inspect.signature(fn).parameters)
        if missing:
            return f"fla's {fn.__name__} has no argument {sorted(missing)[0]}"
    return ""


class _ChunkGatedDeltaRule(torch.autograd.Function):
    """fla's forward; fla's backward with the dq/dk/dw/dg step in PyTorch. Inputs as fla's (no cu_seqlens)."""

    @staticmethod
    @input_guard
    @autocast_custom_fwd
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state):
        g_dtype = g.dtype
        # g comes back as the chunk-local cumsum of g / ln 2 (fla's kernels use exp2); A: the WY inverse per chunk
        g, o, A, final_state, initial_state, _ = chunk_gated_delta_rule_fwd(
            q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, state_v_first=False, chunk_size=CHUNK)
        ctx.save_for_backward(q, k, v, g, beta, A, initial_state)
        ctx.scale, ctx.g_dtype = scale, g_dtype
        return o.to(q.dtype), final_state

    @staticmethod
    @input_guard
    @autocast_custom_bwd
    def backward(ctx, do, dht):
        q, k, v, g, beta, A, initial_state = ctx.saved_tensors
        # the order of fla 0.6.0's chunk_gated_delta_rule_bwd: recompute w, u and the per-chunk states h,
        # then dh (state gradients, chunk by chunk backwards), then dq/dk/dw/dg (here in PyTorch), then the WY part
        w, u = recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=g)
        h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g, initial_state=initial_state,
                                                   output_final_state=False, state_v_first=False, chunk_size=CHUNK)
        dv = chunk_bwd_dv_local(q=q, k=k, g=g, do=do, scale=ctx.scale, chunk_size=CHUNK)
        dh, dh0, dv = chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, g=g, h0=initial_state, dht=dht, do=do, dv=dv,
                                                     scale=ctx.scale, state_v_first=False, chunk_size=CHUNK)
        dq, dk, dw, dg = chunk_bwd_dqkwg_torch(q, k, v_new, w, g, h, dv, do, dh, ctx.scale, chunk_size=CHUNK)
        dk2, dv, db, dg2 = prepare_wy_repr_bwd(k=k, v=v, beta=beta, g=g, A=A, dw=dw, du=dv)
        dk = dk + dk2
        dg = chunk_local_cumsum(dg + dg2, chunk_size=CHUNK, reverse=True)
        return dq.to(q), dk.to(k), dv.to(v), dg.to(ctx.g_dtype), db.to(beta), None, dh0, None


@torch.compiler.disable
def chunk_gated_delta_rule_torch_dqkwg(q, k, v, g, beta, scale=None, initial_state=None,
                                       output_final_state: bool = False):
    """Drop-in for fla's ``chunk_gated_delta_rule`` (same shapes: q, k [B, T, H, K], v [B, T, HV, V], g, beta
    [B, T, HV], states [B, HV, K, V]) whose backward is right on Hopper with Triton 3.4.0 - 3.7.0."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    return _ChunkGatedDeltaRule.apply(q, k, v, g, beta, scale, initial_state, output_final_state)
