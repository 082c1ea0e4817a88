"""FP8 linear layers without Transformer Engine: per-tensor current scaling through torch._scaled_mm."""
from .fp8_linear import (FP8_RECIPES, Fp8LinearFunction, fp8_dtypes, fp8_linear, fp8_supported_shape,
                         quantize_tensorwise)

__all__ = ["FP8_RECIPES", "Fp8LinearFunction", "fp8_dtypes", "fp8_linear", "fp8_supported_shape",
           "quantize_tensorwise"]
