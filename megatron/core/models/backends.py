"""Backend spec providers: which classes fill a layer spec (Megatron's BackendSpecProvider protocol).

There is one backend here, the local one (our tensor-parallel linears, torch norms, SDPA core attention,
grouped-GEMM experts without Transformer Engine); ``get_backend("transformer_engine")`` returns it too, as
the `*_with_transformer_engine_*` spec functions do: it is our fastest.
"""
from abc import abstractmethod
from typing import Optional, Protocol

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, SequentialMLP, TEGroupedMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm


class BackendSpecProvider(Protocol):
    """The modules a backend offers for spec building."""

    @abstractmethod
    def column_parallel_linear(self) -> type: ...

    @abstractmethod
    def row_parallel_linear(self) -> type: ...

    @abstractmethod
    def fuse_layernorm_and_linear(self) -> bool: ...

    @abstractmethod
    def column_parallel_layer_norm_linear(self) -> Optional[type]: ...

    @abstractmethod
    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False): ...

    @abstractmethod
    def core_attention(self) -> type: ...

    @abstractmethod
    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool): ...

    @abstractmethod
    def activation_func(self): ...


class LocalSpecProvider(BackendSpecProvider):
    """Our modules. The norm class follows config.normalization (LayerNorm or RMSNorm) at build time."""

    def column_parallel_linear(self) -> type:
        return ColumnParallelLinear

    def row_parallel_linear(self) -> type:
        return RowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return False

    def column_parallel_layer_norm_linear(self) -> Optional[type]:
        return None

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        return WrappedTorchNorm

    def core_attention(self) -> type:
        return DotProductAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool):
        """Experts: all local experts in two grouped GEMMs when asked (Megatron's local backend always
        loops; ours has a grouped GEMM without Transformer Engine), else a loop of MLPs."""
        if moe_use_grouped_gemm:
            return ModuleSpec(module=TEGroupedMLP, submodules=GroupedMLPSubmodules(
                linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
        return ModuleSpec(module=SequentialMLP, submodules=MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))

    def activation_func(self):
        return None  # the activation comes from config.activation_func


def get_backend(transformer_impl: str) -> BackendSpecProvider:
    """'local' and 'transformer_engine' (our fastest, without Transformer Engine) give LocalSpecProvider."""
    if transformer_impl in ("local", "transformer_engine"):
        return LocalSpecProvider()
    if transformer_impl == "inference_optimized":
        raise NotImplementedError("transformer_impl 'inference_optimized' (Megatron's inference layers) is not "
                                  "supported; use 'local' or 'transformer_engine'")
    raise ValueError(f"Invalid transformer_impl {transformer_impl!r}; use 'local' or 'transformer_engine'")
