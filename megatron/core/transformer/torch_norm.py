"""LayerNorm / RMSNorm in plain torch, chosen by ``config.normalization``.

With ``layernorm_zero_centered_gamma`` the weight is stored as gamma - 1 (initialised to 0) and
applied as (1 + w), which keeps weight decay pulling gamma towards 1. Under sequence parallelism the
norm params see only a sequence chunk per rank, so they carry ``sequence_parallel`` for a TP grad sum.
"""
import torch
import torch.nn.functional as F

from megatron.core.transformer.spec_protocols import LayerNormBuilder, LayerNormInterface  # noqa: F401  (typing)
from megatron.core.utils import get_device


class _Norm(torch.nn.Module):
    def __init__(self, config, hidden_size: int, eps: float, bias: bool):
        super().__init__()
        self.config, self.eps = config, eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        dev = torch.device("cpu") if config.use_cpu_initialization else None
        dev = dev or get_device()
        gamma_init = torch.nn.init.zeros_ if self.zero_centered_gamma else torch.nn.init.ones_
        self.weight = torch.nn.Parameter(gamma_init(torch.empty(hidden_size, dtype=config.params_dtype, device=dev)))
        self.weight.init_fn = gamma_init
        params = [self.weight]
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype, device=dev))
            self.bias.init_fn = torch.nn.init.zeros_
            params.append(self.bias)
        for p in params:
            p.sequence_parallel = config.sequence_parallel

    def _gamma(self):
        return self.weight + 1 if self.zero_centered_gamma else self.weight


class LayerNorm(_Norm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(config, hidden_size, eps, bias=True)

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self._gamma(), self.bias, self.eps)


class RMSNorm(_Norm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(config, hidden_size, eps, bias=False)

    def forward(self, x):
        # y = x / sqrt(mean(x^2) + eps) * gamma, computed in fp32 for stability. On CUDA torch's fused
        # kernel does it in one pass (the eager chain below costs ~6 element-wise kernels per norm).
        gamma = self._gamma()
        if x.is_cuda and x.dtype == gamma.dtype and not torch.compiler.is_compiling():
            return F.rms_norm(x, (x.shape[-1],), gamma, self.eps)
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * gamma


class L2Norm(torch.nn.Module):
    """x / sqrt(mean(x^2) + eps) over the last dim, in fp32, without a learned scale: the query/key norm of
    --qk-l2-norm (Llama 4). ``hidden_size`` is kept for the spec interface only."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


class WrappedTorchNorm:
    """Factory: ``WrappedTorchNorm(config, hidden_size, eps)`` builds the norm named by the config."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = None):
        kind = normalization or config.normalization
        if kind == "LayerNorm":
            return LayerNorm(config, hidden_size, eps)
        if kind == "RMSNorm":
            return RMSNorm(config, hidden_size, eps)
        raise ValueError(f"normalization '{kind}' unknown; use LayerNorm or RMSNorm")
