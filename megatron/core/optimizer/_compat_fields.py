"""OptimizerConfig fields of Megatron Core 0.19.2 without a counterpart here, at Megatron's defaults
(accepted there, refused elsewhere: see megatron/core/_compat_fields.py)."""
from dataclasses import dataclass
from typing import Optional


@dataclass
class OptimizerConfigCompat:
    """OptimizerConfig fields of Megatron Core 0.19.2 that have no counterpart here."""

    fp8_recipe: Optional[str] = None
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    store_param_remainders: bool = True
    decoupled_weight_decay: bool = True
    soap_shampoo_beta: float = 0.95
    soap_precondition_frequency: int = 1
    soap_use_kl_shampoo: bool = True
    adaptive_muon_moment2_method: str = 'adamuon'
    adaptive_muon_beta2: float = 0.95
    adaptive_muon_eps: float = 1e-08
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 0.0
    use_torch_optimizer_for_cpu_offload: bool = False
    overlap_cpu_optimizer_d2h_h2d: bool = False
    pin_cpu_grads: bool = True
    pin_cpu_params: bool = True
    grad_norm_skip_threshold: float = float('inf')
    config_logger_dir: str = ''
    optimizer_cuda_graph: bool = False
