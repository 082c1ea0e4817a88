"""AdamW that also writes the 16-bit model params, in one Triton kernel per parameter (CUDA).

torch's fused AdamW updates the fp32 main params and moments; a second multi-tensor pass then copies the
main params into the bf16 model params, and with gradient clipping a third one scales the grads first.
Here one kernel reads grad, param and moments once (dividing the grad by the clip factor as it reads it)
and writes param, moments and the 16-bit copy: on H200 the optimizer of the fine-grained MoE benchmark
(4.8 B params) spends ~58 ms a step in those three passes, ~35 ms of bytes in one.

The state stays torch's (``exp_avg``, ``exp_avg_sq``, a device ``step`` per param), so checkpoints,
``state_dict`` and a fall back to ``torch.optim.AdamW.step`` are unchanged. Used only where it computes
what torch's fused AdamW would: CUDA fp32 main params and grads, no amsgrad / maximize / capturable /
differentiable, float lr, no loss scaler (fp16 keeps torch's path).

Tensors under ``SMALL_NUMEL`` elements (biases, norms, small projections) take torch's multi-tensor fused
AdamW and one multi-tensor copy instead: for them a launch per tensor costs more host time than the copy
pass it saves in bytes (ViT-L has ~300 parameters, ~200 of them biases and norms; its step was host-bound).
"""
from typing import Dict, Optional

import torch

from megatron.core.fusions.triton_loader import triton_loader


def _load():
    from megatron.core.fusions._triton_adamw import adamw_step  # lazy: imports triton (CUDA only, optional)
    return adamw_step


_kernel = triton_loader(_load)

# At 4M fp32 elements the copy pass the Triton kernel saves is ~6 us of H200 bandwidth, about one launch.
SMALL_NUMEL = 1 << 22


def _plain_cuda_fp32(t: Optional[torch.Tensor]) -> bool:
    return (t is not None and t.is_cuda and t.dtype == torch.float32 and t.is_contiguous()
            and not hasattr(t, "to_local"))


def triton_adamw_applies(inner: torch.optim.Optimizer) -> bool:
    """True when `triton_adamw_step` computes exactly what ``inner.step()`` would."""
    if not isinstance(inner, torch.optim.AdamW) or not inner.defaults.get("fused"):
        return False
    for group in inner.param_groups:
        if (group.get("amsgrad") or group.get("maximize") or group.get("capturable")
                or group.get("differentiable") or isinstance(group.get("lr"), torch.Tensor)):
            return False
        for p in group["params"]:
            if not _plain_cuda_fp32(p) or (p.grad is not None and
                                            (not _plain_cuda_fp32(p.grad) or p.grad.shape != p.shape)):
                return False
            step = inner.state[p].get("step") if inner.state.get(p) else None
            if step is not None and not step.is_cuda:
                return False
    return bool(_kernel())


def _init_state(inner, p):
    state = inner.state[p]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


@torch.no_grad()
def triton_adamw_step(inner: torch.optim.Optimizer, model_copies: Dict[torch.Tensor, Optional[torch.Tensor]],
                      grad_scale: Optional[torch.Tensor] = None):
    """One AdamW step of ``inner``'s params that have a grad; ``model_copies[main]``, a contiguous 16-bit
    tensor of main's numel (or None), receives the updated param. ``grad_scale``: grads are divided by it."""
    kernel = _kernel()
    work = []
    for group in inner.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                work.append((group, p, _init_state(inner, p)))
    if not work:
        return
    torch._foreach_add_([state["step"] for _, _, state in work], 1.0)
    small = {}  # id(group) -> (group, [(param, state)])
    for group, p, state in work:
        if p.numel() < SMALL_NUMEL:
            small.setdefault(id(group), (group, []))[1].append((p, state))
            continue
        beta1, beta2 = group["betas"]
        out = model_copies.get(p)
        kernel(p, p.grad, state["exp_avg"], state["exp_avg_sq"], out, state["step"], grad_scale,
               float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]))
    for group, items in small.values():
        _multi_tensor_step(group, items, model_copies, grad_scale)


def _multi_tensor_step(group, items, model_copies, grad_scale):
    """torch's fused AdamW over ``items`` (steps already counted), then their 16-bit copies in one pass.
    With ``grad_scale`` torch's kernel also writes the divided grads back (the Triton one leaves them)."""
    params = [p for p, _ in items]
    beta1, beta2 = group["betas"]
    torch._fused_adamw_(params, [p.grad for p in params], [s["exp_avg"] for _, s in items],
                        [s["exp_avg_sq"] for _, s in items], [], [s["step"] for _, s in items],
                        lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                        weight_decay=float(group["weight_decay"]), eps=float(group["eps"]), amsgrad=False,
                        maximize=False, grad_scale=grad_scale, found_inf=None)
    pairs = [(model_copies[p], p) for p in params if model_copies.get(p) is not None]
    if pairs:
        torch._foreach_copy_([out.view(p.shape) for out, p in pairs], [p.detach() for _, p in pairs])
