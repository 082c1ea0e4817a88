"""Mamba-2's gated RMSNorm: y = rmsnorm_per_group(x * silu(z)) * weight (norm after the gate, as Megatron's
mixer uses it). Groups are contiguous channel blocks; TP ranks hold whole groups, so it is local."""
import torch
import torch.nn.functional as F

from megatron.core.ssm.utils import tp_param


class GatedRMSNorm(torch.nn.Module):
    """``weight`` [d_local] is split over TP with the channels; ``group_size`` channels share one RMS."""

    def __init__(self, config, hidden_size: int, group_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps, self.group_size = eps, group_size
        self.weight = tp_param((hidden_size,), config, torch.nn.init.ones_)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = x.float() * F.silu(z.float())
        shape = y.shape
        y = y.reshape(*shape[:-1], shape[-1] // self.group_size, self.group_size)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y.reshape(shape) * self.weight.float()).to(dtype)
