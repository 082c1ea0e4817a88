"""--delay-wgrad-compute: the experts' weight gradients computed after their input gradients.

The grouped expert GEMMs' backward returns only the input gradient (dgrad) and parks the weight-gradient
GEMMs in a ``DelayedWgrad`` store. The token dispatcher's backward all-to-all (the one that returns the
dgrad to the ranks that routed the tokens) launches asynchronously, runs the parked wgrad GEMMs while the
exchange is in flight, then waits: the wgrad hides the dispatch all-to-all of the backward.
Weights whose gradient is parked carry ``param.delay_wgrad = True``: autograd reaches them with no
gradient (DDP's hook skips them), and the store adds the gradient later and runs the grad hooks itself.
"""
from typing import Callable, List

import torch


def accumulate_param_grad(param: torch.Tensor, grad: torch.Tensor):
    """``param.grad += grad`` as autograd's AccumulateGrad would, then its post-accumulate-grad hooks
    (DDP's: move into ``main_grad``, mark the bucket ready)."""
    grad = grad.to(param.dtype)
    param.grad = grad if param.grad is None else param.grad + grad
    hooks = getattr(param, "_post_accumulate_grad_hooks", None) or {}
    for hook in list(hooks.values()):
        hook(param)


class DelayedWgrad:
    """Weight-gradient work parked by one layer's experts during backward, run by ``flush``.

    Each entry is a closure that computes its weight gradients and hands them to
    `accumulate_param_grad`. One store per MoE layer; entries of one micro-batch's backward are flushed
    before the next backward of that layer starts (the dispatcher's backward all-to-all runs after the
    experts' backward of the same micro-batch)."""

    def __init__(self):
        self._pending: List[Callable[[], None]] = []

    def defer(self, fn: Callable[[], None]):
        self._pending.append(fn)

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def flush(self):
        pending, self._pending = self._pending, []
        for fn in pending:
            fn()
