"""Model configs that build their model (Megatron 0.19's megatron.training.models)."""
from .gpt import GPTModelBuilder, GPTModelConfig, ModelConfig

__all__ = ["GPTModelConfig", "GPTModelBuilder", "ModelConfig"]
