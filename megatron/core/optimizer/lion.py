"""Lion (EvoLved Sign Momentum; Chen et al. 2023), Megatron's ``--optimizer lion``.

Per step: decoupled weight decay ``p *= 1 - lr * wd``; the update direction is the sign of an interpolation of
the momentum and the gradient, ``p -= lr * sign(beta1 * m + (1 - beta1) * g)``; then the momentum follows the
gradient more slowly, ``m = beta2 * m + (1 - beta2) * g``. One state tensor per parameter (``exp_avg``, Megatron's
name, so checkpoints carry over) against Adam's two. The update has unit magnitude per element: Lion takes a
learning rate 3-10x smaller than AdamW's and a weight decay as much larger.
"""
import torch

from megatron.core.optimizer.closure import closure_loss


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-4, betas=(0.95, 0.98), weight_decay: float = 0.0):
        if lr < 0 or not all(0.0 <= b < 1.0 for b in betas) or weight_decay < 0:
            raise ValueError(f"Lion: lr ({lr}) and weight_decay ({weight_decay}) must be >= 0 and each beta in "
                             f"[0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def init_state(self, p):
        """The momentum, zero (its state before the first step)."""
        self.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return self.state[p]

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd = float(group["lr"]), float(group["weight_decay"])
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad if p.grad.dtype == p.dtype else p.grad.to(p.dtype) for p in params]
            moms = [(self.state[p] or self.init_state(p))["exp_avg"] for p in params]
            if wd != 0:
                torch._foreach_mul_(params, 1 - lr * wd)
            direction = torch._foreach_lerp(moms, grads, 1 - beta1)  # beta1 * m + (1 - beta1) * g
            torch._foreach_sign_(direction)
            torch._foreach_add_(params, direction, alpha=-lr)
            torch._foreach_lerp_(moms, grads, 1 - beta2)
        return loss
