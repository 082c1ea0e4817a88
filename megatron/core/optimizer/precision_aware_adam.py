"""AdamW whose moments, main params and grads may be 16-bit (Megatron's --use-precision-aware-optimizer).

Adam's two moments are 8 of the 16 bytes the distributed optimizer holds per parameter shard element (fp32 main
param, exp_avg, exp_avg_sq, and the fp32 grad buffer beside them); keeping them in bf16
(``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``) halves that, a bf16 grad buffer (``--main-grads-dtype bf16``) halves
the gradients, and fp16 main params (``--main-params-dtype fp16``) the master weights. The update itself is the
fp32 AdamW step: every tensor is read into fp32, updated, and written back rounded to its own dtype (to nearest),
as Transformer Engine's FusedAdam does for Megatron. With every dtype fp32 the step is torch's AdamW, bit for bit.

On CUDA one Triton kernel per parameter reads and writes each tensor once in its own dtype (`_triton_adamw`); on
the CPU the same arithmetic runs as torch's single-tensor AdamW on fp32 copies.
"""
import math

import torch

from megatron.core.fusions.triton_loader import triton_loader
from megatron.core.optimizer.closure import closure_loss

# fp16 (and fp8) moments would need a scale per tensor: Adam's squared gradients underflow fp16.
MOMENT_DTYPES = (torch.float32, torch.bfloat16)


def _load():
    from megatron.core.fusions._triton_adamw import adamw_step  # lazy: imports triton (CUDA only, optional)
    return adamw_step


_kernel = triton_loader(_load)


class PrecisionAwareAdamW(torch.optim.AdamW):
    """torch's AdamW (decoupled weight decay; no amsgrad, maximize or capturable) with ``exp_avg`` kept in
    ``exp_avg_dtype`` and ``exp_avg_sq`` in ``exp_avg_sq_dtype``. Params (the main params) and their grads may be
    fp32, bf16 or fp16; the step runs in fp32."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 exp_avg_dtype: torch.dtype = torch.float32, exp_avg_sq_dtype: torch.dtype = torch.float32):
        for name, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dtype not in MOMENT_DTYPES:
                raise ValueError(f"PrecisionAwareAdamW: {name} {dtype} is not one of fp32, bf16")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
        self.moment_dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}

    def init_state(self, p):
        """Zero moments in their dtypes and a step count (on the param's device: the CUDA kernel reads it there)."""
        state = self.state[p]
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if p.is_cuda else "cpu")
        for key, dtype in self.moment_dtypes.items():
            state[key] = torch.zeros(p.shape, dtype=dtype, device=p.device)
        return state

    def load_state_dict(self, state_dict):
        """torch casts loaded state to each param's dtype; the moments go back to their own dtypes."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key, dtype in self.moment_dtypes.items():
                if key in state and state[key].dtype != dtype:
                    state[key] = state[key].to(dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        if getattr(self, "grad_scale", None) is not None:
            raise RuntimeError("PrecisionAwareAdamW does not take a grad_scale (the clip is applied to the grads)")
        work = [(group, p, grad, self.state[p] if self.state[p] else self.init_state(p))
                for group in self.param_groups for p in group["params"] if (grad := _grad(p)) is not None]
        if not work:
            return loss
        kernel = _kernel() if work[0][1].is_cuda else None
        if kernel is not None:
            torch._foreach_add_([state["step"] for *_, state in work], 1.0)
        for group, p, grad, state in work:
            beta1, beta2 = group["betas"]
            lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
            if kernel is not None and p.is_contiguous() and grad.is_contiguous():
                kernel(p, grad, state["exp_avg"], state["exp_avg_sq"], None, state["step"], None, lr, float(beta1),
                       float(beta2), eps, wd)
                continue
            if kernel is None:
                state["step"] += 1
            _reference_step(p, grad, state["exp_avg"], state["exp_avg_sq"], float(state["step"]), lr, beta1, beta2,
                            eps, wd)
        return loss


def _grad(p):
    """The main param's gradient: ``decoupled_grad`` (a grad whose dtype differs from the param's, set by the
    distributed optimizer) when present, else ``.grad``."""
    grad = getattr(p, "decoupled_grad", None)
    return grad if grad is not None else p.grad


def _reference_step(p, grad, exp_avg, exp_avg_sq, step: float, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float):
    """torch's single-tensor AdamW on fp32 copies of every 16-bit tensor, each written back in its own dtype."""
    p32, m, v = (t if t.dtype == torch.float32 else t.float() for t in (p, exp_avg, exp_avg_sq))
    g = grad if grad.dtype == torch.float32 else grad.float()
    p32.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    denom = (v.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    p32.addcdiv_(m, denom, value=-lr / bias_correction1)
    for target, value in ((p, p32), (exp_avg, m), (exp_avg_sq, v)):
        if target is not value:
            target.copy_(value)
