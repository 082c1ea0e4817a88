"""Megatron's older spelling of the hybrid model: MambaModel and mamba_stack_spec."""
from megatron.core.models.mamba.mamba_model import MambaModel

__all__ = ["MambaModel"]
