"""Megatron's earlier path of the hybrid stack spec."""
from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec, mamba_stack_spec

__all__ = ["hybrid_stack_spec", "mamba_stack_spec"]
