"""FP8 linear layers without Transformer Engine: per-tensor current scaling through torch._scaled_mm."""
import importlib

__all__ = ["FP8_RECIPES", "Fp8LinearFunction", "fp8_dtypes", "fp8_linear", "fp8_supported_shape",
           "quantize_tensorwise"]


def __getattr__(name):
    """Loaded on first use: fp8_linear's @torch.compiler.disable imports torch._dynamo, ~1.5 s of every
    process start that never runs FP8."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(__name__ + ".fp8_linear")
    # The import just bound the submodule as this package's `fp8_linear`; the function takes the name back.
    globals().update({n: getattr(module, n) for n in __all__})
    return globals()[name]
