"""The Triton kernel behind ``optimizer.fused_adamw`` (imported only on CUDA).

One pass per parameter: reads the fp32 main param, its grad and both moments, writes the param and the
moments, and also writes the 16-bit model copy (``HAS_OUT``), which otherwise costs a second pass. The
grad is divided by ``grad_scale`` as it is read (the gradient-clipping factor), never written back. The
math and its order are those of torch's fused AdamW (decoupled weight decay, bias corrections from the
device-side step count).
"""
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, step_ptr, scale_ptr, n, lr, beta1, beta2, eps,
                  weight_decay, HAS_OUT: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    step = tl.load(step_ptr).to(tl.float32)
    bias_correction1 = 1.0 - tl.exp2(step * tl.log2(beta1))
    bias_correction2 = 1.0 - tl.exp2(step * tl.log2(beta2))
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr).to(tl.float32)
    # fp32 math whatever the stored dtypes (the precision-aware optimizer keeps 16-bit moments or main params);
    # for fp32 tensors the casts are no-ops.
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = p - lr * weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    step_size = lr / bias_correction1
    denom = tl.sqrt(v) / tl.sqrt(bias_correction2) + eps
    p = p - step_size * m / denom
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
    if HAS_OUT:
        tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)


def adamw_step(param, grad, exp_avg, exp_avg_sq, out, step, grad_scale, lr, beta1, beta2, eps, weight_decay):
    """All tensors contiguous on one device; ``out`` (16-bit, param's numel) and ``grad_scale`` may be None.
    param, grad and the moments may each be fp32, bf16 or fp16: the update is computed in fp32 and each
    tensor is written back in its own dtype (rounded to nearest)."""
    n = param.numel()
    if n == 0:
        return
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, param if out is None else out, step,
        step if grad_scale is None else grad_scale, n, lr, beta1, beta2, eps, weight_decay,
        HAS_OUT=out is not None, HAS_SCALE=grad_scale is not None, BLOCK=BLOCK, num_warps=8)
