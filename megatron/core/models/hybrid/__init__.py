"""Hybrid models: Mamba-2, Gated DeltaNet, attention, MLP and MoE layers stacked by a pattern string."""
from megatron.core.models.hybrid.hybrid_model import HybridModel

__all__ = ["HybridModel"]
