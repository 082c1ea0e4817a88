"""torch's fused AdamW step replayed from a CUDA graph (with ``--cuda-graph-impl full_iteration``).

The step itself is a few multi-tensor kernels, but launching them costs milliseconds of Python per step
(per-parameter bookkeeping in torch.optim), and the device has nothing else to do then: it waits for
the grad-norm sync before the step. Captured once, the step is one graph launch. The learning rate of
each param group and the clip factor live in device tensors refilled before each replay; one graph is
kept for "clip active" (the kernel divides grads by the factor) and one for "clip inactive".

What a graph freezes and how it is kept right: the state tensors (captured after the first eager step
created them; `invalidate()` after a checkpoint load replaces them), and each group's weight decay
(a schedule that changes it makes the step eager again, with a warning).
"""
import warnings
from typing import Dict, List, Optional

import torch


class FusedAdamStepGraphs:
    """Runs ``optimizer.step()`` (torch Adam/AdamW with ``fused=True`` on CUDA) from CUDA graphs after
    ``eager_steps`` eager steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, eager_steps: int = 1):
        if not (isinstance(optimizer, torch.optim.Adam) and optimizer.defaults.get("fused")):
            raise ValueError("step graphs need torch's fused Adam/AdamW")
        self.optimizer = optimizer
        self.eager_steps = eager_steps
        self.disabled = False
        self.invalidate()

    def invalidate(self) -> None:
        """Drop the graphs (the optimizer's state tensors were replaced); recapture after eager steps."""
        self.graphs: Dict[bool, torch.cuda.CUDAGraph] = {}
        self.steps = 0
        self.captured_weight_decay: Optional[List[float]] = None
        self.lr: Optional[List[torch.Tensor]] = None
        self.scale: Optional[torch.Tensor] = None

    def step(self, grad_scale: Optional[float] = None) -> None:
        """One optimizer step; ``grad_scale`` (> 1) divides the grads (the clip), None leaves them."""
        groups = self.optimizer.param_groups
        weight_decay = [group["weight_decay"] for group in groups]
        if self.captured_weight_decay is not None and weight_decay != self.captured_weight_decay:
            warnings.warn("--cuda-graph-impl full_iteration: weight decay changes between steps "
                          "(--weight-decay-incr-style); the optimizer step runs without a CUDA graph")
            self.disabled = True
        if self.disabled or self.steps < self.eager_steps:
            self.steps += 1
            self._eager_step(grad_scale)
            return
        device = groups[0]["params"][0].device
        if self.lr is None:
            self.lr = [torch.zeros((), dtype=torch.float32, device=device) for _ in groups]
            self.scale = torch.ones((), dtype=torch.float32, device=device)
        for group, lr in zip(groups, self.lr):
            lr.fill_(float(group["lr"]))
        clip = grad_scale is not None
        if clip:
            self.scale.fill_(grad_scale)
        if clip not in self.graphs:
            self.graphs[clip] = self._capture(clip)
            self.captured_weight_decay = weight_decay
        self.graphs[clip].replay()

    def _eager_step(self, grad_scale):
        if grad_scale is None:
            self.optimizer.step()
            return
        device = self.optimizer.param_groups[0]["params"][0].device
        self.optimizer.grad_scale = torch.tensor(grad_scale, dtype=torch.float32, device=device)
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.grad_scale

    def _capture(self, clip: bool) -> torch.cuda.CUDAGraph:
        groups = self.optimizer.param_groups
        saved_lr = [group["lr"] for group in groups]
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        torch.cuda.synchronize()
        stream.wait_stream(torch.cuda.current_stream())
        for group, lr in zip(groups, self.lr):
            group["lr"], group["capturable"] = lr, True  # the kernels read lr from the device tensor
        if clip:
            self.optimizer.grad_scale = self.scale
        try:
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                self.optimizer.step()
        finally:
            for group, lr in zip(groups, saved_lr):
                group["lr"] = lr  # the scheduler and the log keep seeing floats
            if clip:
                del self.optimizer.grad_scale
        torch.cuda.current_stream().wait_stream(stream)
        return graph
