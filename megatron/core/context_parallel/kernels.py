"""Attention on one (query block, key/value block) pair that also returns the log-sum-exp (LSE).

Context parallelism splits a row's softmax over several key/value blocks; each block's partial output is
normalised by its own LSE, and ``merge`` combines them exactly. Backward of a block uses the *merged*
output and LSE (the flash-attention identity dS = P * (dP - rowsum(dO * O)) with P normalised by the
global LSE), so every block's gradient is exact without storing per-block results.

Layout: ``[b, n, s, d]`` queries, ``[b, g, s, d]`` keys/values (GQA: g divides n). Kernels:
  * flash: torch's fused attention ops, no or causal mask (CUDA: cuDNN's fused attention where it runs, the
    kernel SDPA itself picks on Hopper and about twice FlashAttention-2's speed there, else FlashAttention-2;
    fp16/bf16, head dim <= 256; CPU: its flash kernel);
  * flex: FlexAttention with a document block mask (CUDA; compiled);
  * math: explicit fp32 softmax (fp32 on CUDA, and documents on CPU: FlexAttention has no CPU backward).
"""
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core.fusions.compile import maybe_compile


@dataclass
class BlockMask:
    """Which (query, key) pairs of a block attend. ``causal``: the block is diagonal (same positions).
    With documents (``q_doc`` set): pairs attend iff same document and key position <= query position;
    ``*_doc`` are [b, s] document ids, ``*_pos`` [s] global positions."""

    causal: bool = False
    q_doc: Optional[torch.Tensor] = None
    k_doc: Optional[torch.Tensor] = None
    q_pos: Optional[torch.Tensor] = None
    k_pos: Optional[torch.Tensor] = None

    @property
    def documents(self) -> bool:
        return self.q_doc is not None

    def dense(self) -> Optional[torch.Tensor]:
        """Boolean [b|1, 1, sq, sk] mask, True = attend (math kernel only), or None for a full block."""
        if self.documents:
            same = self.q_doc[:, :, None] == self.k_doc[:, None, :]
            return (same & (self.q_pos[:, None] >= self.k_pos[None, :]))[:, None]
        return None


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.size(1) == heads else t.repeat_interleave(heads // t.size(1), dim=1)


def _fold_kv(grad: torch.Tensor, groups: int) -> torch.Tensor:
    b, n, s, d = grad.shape
    return grad if n == groups else grad.view(b, groups, n // groups, s, d).sum(2)


def _safe(lse: torch.Tensor) -> torch.Tensor:
    """LSE with -inf (fully masked rows) replaced by 0, so exp(score - lse) stays 0 instead of NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _math_scores(q, k, scale, mask: BlockMask):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [b, n, sq, sk]
    if mask.causal and not mask.documents:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    dense = mask.dense()
    if dense is not None:
        s = s.masked_fill(~dense, float("-inf"))
    return s


def math_forward(q, k, v, scale, mask: BlockMask):
    """(out [b, n, sq, d] fp32, lse [b, n, sq] fp32) by an explicit softmax."""
    n = q.size(1)
    s = _math_scores(q, _expand_kv(k, n), scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _safe(lse)[..., None])
    return torch.matmul(p, _expand_kv(v, n).float()), lse


def math_backward(dout, q, k, v, out, lse, scale, mask: BlockMask):
    n, g = q.size(1), k.size(1)
    ke, ve = _expand_kv(k, n).float(), _expand_kv(v, n).float()
    p = torch.exp(_math_scores(q, ke, scale, mask) - _safe(lse)[..., None])  # globally normalised
    dout = dout.float()
    dv = torch.matmul(p.transpose(-1, -2), dout)
    dp = torch.matmul(dout, ve.transpose(-1, -2))
    ds = p * (dp - (dout * out.float()).sum(-1, keepdim=True))
    dq = torch.matmul(ds, ke) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
    return dq, _fold_kv(dk, g), _fold_kv(dv, g)


# None: not tried yet; False: failed once on this process. "ok": cuDNN at all (else FlashAttention-2);
# "gqa": cuDNN on K/V with fewer heads than Q (else K/V are repeated to Q's heads first).
_CUDNN = {"ok": None, "gqa": None}


def _use_cudnn(q) -> bool:
    """cuDNN attention for this block: Hopper or newer, head dim <= 128, SDPA's cuDNN backend enabled, and
    not under deterministic algorithms (its backward is not guaranteed deterministic)."""
    if _CUDNN["ok"] is False or not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        return False
    return (torch.backends.cuda.cudnn_sdp_enabled() and torch.cuda.get_device_capability(q.device) >= (9, 0)
            and q.size(-1) <= 128 and not torch.are_deterministic_algorithms_enabled())


def _dropout_words(device):
    """Philox seed/offset placeholders: the kernels read them only with dropout (never here)."""
    return torch.empty(2, dtype=torch.uint64, device=device), torch.empty((), dtype=torch.uint64, device=device)


def _flash_ops(q, ke, ve, causal, scale):
    """(out, lse [b, n, s]) of torch's fused attention op for q's device (CUDA: cuDNN or FlashAttention-2;
    CPU: its flash kernel)."""
    if q.device.type == "cuda":
        if _use_cudnn(q):
            try:
                out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
                    q, ke, ve, None, True, 0.0, causal, False, scale=scale)
                _CUDNN["ok"] = True
                return out, lse.reshape(q.shape[:3])  # cuDNN's stats may carry a trailing 1
            except RuntimeError as e:
                if _CUDNN["ok"]:
                    raise  # it ran before: a real error, not an unsupported configuration
                warnings.warn(f"context parallelism: cuDNN attention unavailable ({str(e)[:120]}); "
                              "using FlashAttention-2")
                _CUDNN["ok"] = False
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, ke, ve, 0.0, causal, False,
                                                                           scale=scale)
        return out, lse
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, ke, ve, 0.0, causal, scale=scale)


def _flash_backward_ops(dout, q, ke, ve, out, lse, causal, scale):
    if q.device.type == "cuda":
        seed, offset = _dropout_words(q.device)
        if _CUDNN["ok"] and _use_cudnn(q):
            try:
                return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                    dout, q, ke, ve, out, lse[..., None].contiguous(), seed, offset, None, None, None, q.size(2),
                    ke.size(2), 0.0, causal, scale=scale)
            except RuntimeError as e:  # the LSE is the same quantity for both kernels: FlashAttention-2 goes on
                warnings.warn(f"context parallelism: cuDNN attention backward failed ({str(e)[:160]}); "
                              "using FlashAttention-2")
                _CUDNN["ok"] = False
        # No cumulative sequence lengths (None: not the varlen kernel).
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, ke, ve, out, lse, None, None, q.size(2), ke.size(2), 0.0, causal, seed, offset, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, ke, ve, out, lse, 0.0, causal, scale=scale)


_CUDNN_GQA = {"ok": None}  # whole-sequence GQA through cuDNN: None not tried yet; False refused once


def cudnn_gqa_usable(q, v) -> bool:
    """Whether `cudnn_gqa_attention` may run on these tensors: CUDA on Hopper or newer, 16-bit, head dim <= 128
    (V's equal to Q's), outside torch.compile (which traces SDPA itself), and this torch has the op. The caller
    adds its own policy (the attention backends it was given, deterministic mode)."""
    return (q.is_cuda and _CUDNN_GQA["ok"] is not False and q.dtype in (torch.bfloat16, torch.float16)
            and q.size(-1) <= 128 and v.size(-1) == q.size(-1) and not torch.compiler.is_compiling()
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")
            and torch.cuda.get_device_capability(q.device) >= (9, 0))


class _CudnnGQAAttention(torch.autograd.Function):
    """cuDNN's fused attention with K/V at their own (fewer) head count. SDPA's dispatcher only takes GQA
    through FlashAttention-2 or by repeating K/V to every query head (two [b, n, s, d] copies forward and
    a reduction of their gradients backward); cuDNN's kernel reads each K/V head once per group and
    accumulates dK/dV over the group itself."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        if dout.stride() != out.stride():  # the kernel reads dO in O's layout
            dout = torch.empty_like(out).copy_(dout)
        seed, offset = _dropout_words(q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse, seed, offset, None, None, None, q.size(2), k.size(2), 0.0, ctx.causal,
            scale=ctx.scale)
        return dq, dk, dv, None, None


def cudnn_gqa_attention(q, k, v, causal: bool, scale):
    """[b, n, s, d] attention of q [b, n, s, d] over k, v [b, g, s, d] (g divides n), or None where this cuDNN
    refuses the configuration (then never tried again)."""
    return _cudnn_attention_or_none(_CUDNN_GQA, q, k, v, causal, scale)


def _cudnn_attention_or_none(state, q, k, v, causal: bool, scale):
    """`_CudnnGQAAttention` on these tensors, or None the first time this cuDNN refuses the kind of call ``state``
    stands for (``state["ok"]`` False from then on, so the caller's fallback runs without asking again); a
    refusal after a success is a real error and raised."""
    try:
        out = _CudnnGQAAttention.apply(q, k, v, causal, scale)
    except RuntimeError:
        if state["ok"]:
            raise  # it ran before: a real error
        state["ok"] = False
        return None
    state["ok"] = True
    return out


_CUDNN_NARROW_V = {"ok": None}  # MLA's narrower value heads through cuDNN: None not tried yet; False refused once


def cudnn_narrow_v_usable(q, v) -> bool:
    """Whether `cudnn_narrow_v_attention` may run: value heads narrower than query/key heads (MLA: 192 against 128),
    both multiples of 8 and at most 256, CUDA on Hopper or newer, 16-bit, outside torch.compile. cuDNN takes the
    two head dims as they are, where SDPA's flash kernel needs one (so the value was zero-padded to the query's
    width: a sixth more attention FLOPs at DeepSeek-V3's dims, and a padded copy of V)."""
    dq, dv = q.size(-1), v.size(-1)
    return (q.is_cuda and _CUDNN_NARROW_V["ok"] is not False and q.dtype in (torch.bfloat16, torch.float16)
            and dv < dq <= 256 and dq % 8 == 0 and dv % 8 == 0 and not torch.compiler.is_compiling()
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")
            and torch.cuda.get_device_capability(q.device) >= (9, 0))


def cudnn_narrow_v_attention(q, k, v, causal: bool, scale):
    """[b, n, s, dv] attention of q, k [b, n (or g), s, dq] over v [b, n (or g), s, dv] with dv < dq, or None
    where this cuDNN refuses the configuration (then never tried again; the caller pads V)."""
    return _cudnn_attention_or_none(_CUDNN_NARROW_V, q, k, v, causal, scale)


def _native_gqa(q, k) -> bool:
    return q.size(1) != k.size(1) and q.device.type == "cuda" and _CUDNN["gqa"] is not False and _use_cudnn(q)


def flash_forward(q, k, v, scale, mask: BlockMask):
    n = q.size(1)
    if _native_gqa(q, k):
        try:
            out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, mask.causal, False, scale=scale)
            _CUDNN["gqa"] = True
            return out.float(), lse.reshape(q.shape[:3]).float()
        except RuntimeError:
            if _CUDNN["gqa"]:
                raise
            _CUDNN["gqa"] = False  # this cuDNN wants equal heads: repeat K/V below
    ke, ve = _expand_kv(k, n).contiguous(), _expand_kv(v, n).contiguous()
    out, lse = _flash_ops(q.contiguous(), ke, ve, mask.causal, scale)
    return out.float(), lse.float()


def flash_backward(dout, q, k, v, out, lse, scale, mask: BlockMask):
    n, g = q.size(1), k.size(1)
    if _CUDNN["gqa"] and _native_gqa(q, k):
        seed, offset = _dropout_words(q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout.to(q.dtype).contiguous(), q.contiguous(), k.contiguous(), v.contiguous(),
            out.to(q.dtype).contiguous(), lse.float()[..., None].contiguous(), seed, offset, None, None, None,
            q.size(2), k.size(2), 0.0, mask.causal, scale=scale)
        return dq.float(), dk.float(), dv.float()
    ke, ve = _expand_kv(k, n).contiguous(), _expand_kv(v, n).contiguous()
    dq, dk, dv = _flash_backward_ops(dout.to(q.dtype).contiguous(), q.contiguous(), ke, ve,
                                     out.to(q.dtype).contiguous(), lse.float().contiguous(), mask.causal, scale)
    return dq.float(), _fold_kv(dk.float(), g), _fold_kv(dv.float(), g)


_compiled_flex = None


def flex_attention_lse(q, k, v, block_mask, scale):
    """(out, lse) of FlexAttention, compiled once per process (eager flex materialises the scores)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention  # lazy: torch >= 2.5 only (we support 2.4)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    kwargs = dict(block_mask=block_mask, scale=scale, enable_gqa=k.size(1) != q.size(1))
    try:
        from torch.nn.attention.flex_attention import AuxRequest  # lazy: torch >= 2.9 (return_lse deprecated)
    except ImportError:
        return _compiled_flex(q, k, v, return_lse=True, **kwargs)
    out, aux = _compiled_flex(q, k, v, return_aux=AuxRequest(lse=True), **kwargs)
    return out, aux.lse


def document_block_mask(mask: BlockMask, sq: int, sk: int):
    """FlexAttention BlockMask for same-document, causal-by-position pairs (built without an s x s tensor)."""
    from torch.nn.attention.flex_attention import create_block_mask  # lazy: torch >= 2.5 only (we support 2.4)
    q_doc, k_doc, q_pos, k_pos = mask.q_doc, mask.k_doc, mask.q_pos, mask.k_pos

    def mask_mod(b, h, qi, ki):
        return (q_doc[b, qi] == k_doc[b, ki]) & (q_pos[qi] >= k_pos[ki])
    return create_block_mask(mask_mod, q_doc.size(0), None, sq, sk, device=q_doc.device, _compile=True)


def flex_forward(q, k, v, scale, mask: BlockMask):
    out, lse = flex_attention_lse(q, k, v, document_block_mask(mask, q.size(2), k.size(2)), scale)
    return out.float(), lse.float()


def flex_backward(dout, q, k, v, out, lse, scale, mask: BlockMask):
    """Recompute the block with autograd and push the merge's gradients into (out_i, lse_i):
    d out_i = w dO and d lse_i = w rowsum(dO * (out_i - out)), with w = exp(lse_i - lse)."""
    with torch.enable_grad():
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out_i, lse_i = flex_attention_lse(qg, kg, vg, document_block_mask(mask, q.size(2), k.size(2)), scale)
        w = torch.exp(lse_i.float() - _safe(lse.float()))
        g_out = (w[..., None] * dout.float()).to(out_i.dtype)
        g_lse = w * (dout.float() * (out_i.float() - out.float())).sum(-1)
        dq, dk, dv = torch.autograd.grad((out_i, lse_i), (qg, kg, vg), (g_out, g_lse.to(lse_i.dtype)))
    return dq.float(), dk.float(), dv.float()


def pick_kernel(q: torch.Tensor, mask: BlockMask):
    """(forward, backward) for this block: flash / flex on CUDA where they apply, else math."""
    if mask.documents:
        return (flex_forward, flex_backward) if q.device.type == "cuda" else (math_forward, math_backward)
    if q.device.type == "cpu" or (q.dtype in (torch.float16, torch.bfloat16) and q.size(-1) <= 256):
        return flash_forward, flash_backward
    return math_forward, math_backward


def block_forward(q, k, v, scale, mask: BlockMask):
    """(out fp32, lse fp32) of softmax(q k^T * scale + mask) v over this block only."""
    return pick_kernel(q, mask)[0](q, k, v, scale, mask)


def block_backward(dout, q, k, v, out, lse, scale, mask: BlockMask):
    """(dq, dk, dv) in fp32 of this block's share of the merged attention (out, lse are the merged ones)."""
    return pick_kernel(q, mask)[1](dout, q, k, v, out, lse, scale, mask)


@maybe_compile  # one element-wise kernel on CUDA instead of ~8 passes over the fp32 block output
def merge(out, lse, out_b, lse_b):
    """Combine two partial results of the same rows: softmax over the union of their keys."""
    new = torch.logaddexp(lse, lse_b)
    safe = _safe(new)
    return (torch.exp(lse - safe)[..., None] * out + torch.exp(lse_b - safe)[..., None] * out_b), new
