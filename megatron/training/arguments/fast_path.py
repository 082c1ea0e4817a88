"""Checks of the GPU fast-path flags: --transformer-impl, --use-flash-attn, --fp8-*.

Transformer Engine layers are not integrated, so an explicit --transformer-impl transformer_engine is
refused (never silently replaced by local layers). --use-flash-attn selects torch SDPA's flash kernel.
"""
import importlib.util

from megatron.core.fp8 import FP8_RECIPES


class TransformerEngineNotIntegrated(NotImplementedError):
    """Transformer Engine is installed, but this build has no TE layer implementation."""


def transformer_engine_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def validate_fast_path_args(args, require):
    """``require(cond, message)`` raises the argument error of validate_args."""
    if args.transformer_impl == "transformer_engine":
        require(transformer_engine_installed(),
                "--transformer-impl transformer_engine: Transformer Engine is not installed "
                "(pip install --no-build-isolation transformer_engine[pytorch]); or drop the flag / pass "
                "--transformer-impl local to use this project's torch layers")
        raise TransformerEngineNotIntegrated(
            "--transformer-impl transformer_engine: Transformer Engine layers are not integrated in this "
            "project yet; pass --transformer-impl local (the default)")
    if args.use_flash_attn:
        require(args.attention_backend in ("auto", "flash"),
                f"--use-flash-attn conflicts with --attention-backend {args.attention_backend}; pass one of them")
        args.attention_backend = "flash"
    if args.fp8 is not None:
        require(args.fp8_recipe in FP8_RECIPES,
                f"--fp8-recipe {args.fp8_recipe} is not supported without Transformer Engine; use "
                "--fp8-recipe tensorwise")
        require(args.fp8_amax_history_len == 1 and args.fp8_amax_compute_algo == "most_recent",
                "--fp8-amax-history-len / --fp8-amax-compute-algo belong to the delayed FP8 recipe, which is "
                "not supported; drop them")
        require(args.fp8_margin >= 0, f"--fp8-margin ({args.fp8_margin}) must be >= 0")
