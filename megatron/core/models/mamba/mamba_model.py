"""MambaModel: Megatron's earlier name of HybridModel (same layers, same checkpoints); it also takes the
stack spec under its old keyword, ``mamba_stack_spec``."""
from megatron.core.models.hybrid.hybrid_model import HybridModel


class MambaModel(HybridModel):
    """HybridModel accepting ``mamba_stack_spec=`` for ``hybrid_stack_spec``."""

    def __init__(self, *args, mamba_stack_spec=None, **kwargs):
        if mamba_stack_spec is not None:
            if "hybrid_stack_spec" in kwargs or len(args) >= 2:
                raise ValueError("MambaModel: pass the stack spec once (mamba_stack_spec or hybrid_stack_spec)")
            kwargs["hybrid_stack_spec"] = mamba_stack_spec
        super().__init__(*args, **kwargs)
