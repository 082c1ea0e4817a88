"""Hybrid models: Mamba-2, Gated DeltaNet, attention, MLP and MoE layers stacked by a pattern string."""
from megatron.core.utils import lazy_names

# HybridModel is resolved on first use: hybrid_model imports the MTP block, which imports this package's
# HybridStack (hybrid_block), so importing it here, when the package runs, would close an import cycle.
__getattr__ = lazy_names(__name__, {"HybridModel": "megatron.core.models.hybrid.hybrid_model"})

__all__ = ["HybridModel"]
