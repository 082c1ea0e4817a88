"""MoE layer specs: router, experts from a backend, and shared experts (built only when the config sets
moe_shared_expert_intermediate_size; their sigmoid gate follows config.moe_shared_expert_gate)."""
from typing import Optional

from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec


def get_moe_module_spec(use_te: Optional[bool] = True, num_experts: Optional[int] = None,
                        moe_grouped_gemm: Optional[bool] = False) -> ModuleSpec:
    """The MoE layer spec. ``use_te`` picks the same (local) modules: no Transformer Engine here."""
    return get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts, moe_grouped_gemm)


def get_moe_module_spec_for_backend(backend: BackendSpecProvider, num_experts: Optional[int] = None,
                                    moe_grouped_gemm: Optional[bool] = False,
                                    use_te_activation_func: bool = False) -> ModuleSpec:
    """The MoE layer spec with ``backend``'s linears and experts."""
    if num_experts is None:
        raise ValueError("get_moe_module_spec: num_experts is required")
    if use_te_activation_func:
        raise NotImplementedError("use_te_activation_func needs Transformer Engine, which this build does not "
                                  "use; drop it")
    shared = ModuleSpec(module=SharedExpertMLP, submodules=MLPSubmodules(
        linear_fc1=backend.column_parallel_linear(), linear_fc2=backend.row_parallel_linear()))
    return ModuleSpec(module=MoELayer, submodules=MoESubmodules(
        experts=backend.grouped_mlp_modules(bool(moe_grouped_gemm)), shared_experts=shared))
