"""A hybrid stack's MLP-only layer (Megatron's ``MLPLayer``): x + mlp(norm(x)), a TransformerLayer
without attention."""
from megatron.core.transformer.transformer_layer import TransformerLayer


class MLPLayer(TransformerLayer):
    """Built from a spec whose ``mlp`` is set and whose attention submodules stay identity."""
