"""Command-line flags with Megatron-LM's names and defaults, their validation, and config builders.

    args = parse_args(extra_args_provider, ignore_unknown_args)
    validate_args(args, args_defaults)   # raises ArgumentError with a one-line message
"""
import argparse
import os

from megatron.core.utils import lazy_names

from . import fast_path
from .autoresume_args import add_autoresume_args
from .configs import core_transformer_config_from_args, ddp_config_from_args, optimizer_config_from_args
from .context_parallel_args import add_context_parallel_args
from .diagnostics_args import add_diagnostics_args
from .dropin_args import add_dropin_args
from .fim_args import add_fim_args
from .health_args import add_health_args
from .hybrid_args import add_hybrid_args
from .inference_args import add_inference_args
from .megatron_flags import add_megatron_flags
from .mla_args import add_mla_args
from .model_args import (
    add_initialization_args,
    add_mixed_precision_args,
    add_network_size_args,
    add_regularization_args,
)
from .modelopt_args import add_modelopt_args
from .moe_args import add_moe_args
from .mup_args import add_mup_args
from .optimizer_args import add_muon_args
from .parallel_data_args import add_data_args, add_distributed_args, add_tokenizer_args
from .precision_aware_args import add_precision_aware_args
from .profiling_args import add_profiling_args
from .qk_clip_args import add_qk_clip_args
from .sft_args import add_sft_args
from .spec_args import add_spec_args
from .tp_overlap_args import add_tp_overlap_args
from .training_args import (
    add_checkpointing_args,
    add_learning_rate_args,
    add_logging_args,
    add_training_args,
    add_validation_args,
)
from .types import la_freq_type, moe_freq_type, no_rope_freq_type, tuple_type
from .validation import ArgumentError, blend_prefixes, validate_args
from .validation_set_args import add_validation_set_args
from .window_args import add_window_args
from .yaml_args import load_yaml_config

__all__ = ["parse_args", "validate_args", "ArgumentError", "print_args", "build_parser",
           "core_transformer_config_from_args", "ddp_config_from_args", "optimizer_config_from_args",
           "blend_prefixes", "add_megatron_arguments", "parse_and_validate_args", "moe_freq_type",
           "no_rope_freq_type", "la_freq_type", "tuple_type"]


# Megatron-only names: resolved on first use from the compat room (megatron/training/_compat/arguments.py).
__getattr__ = lazy_names(__name__, {name: "megatron.training._compat.arguments"
                                    for name in ("parse_and_validate_args", "add_megatron_arguments")})


def build_parser(extra_args_provider=None):
    # A short usage line: argparse prints it before every parse error, and the parser knows 800+ flags.
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False,
                                     usage="%(prog)s [Megatron-LM flags] (--help lists them)")
    for add in (add_network_size_args, add_regularization_args, add_training_args, add_initialization_args,
                add_learning_rate_args, add_checkpointing_args, add_mixed_precision_args, add_distributed_args,
                add_validation_args, add_data_args, add_tokenizer_args, add_logging_args, add_window_args,
                add_moe_args,
                add_mup_args,
                add_context_parallel_args,
                add_inference_args,
                add_mla_args,
                add_modelopt_args,
                add_hybrid_args,
                add_muon_args,
                add_precision_aware_args,
                add_qk_clip_args,
                add_dropin_args,
                add_diagnostics_args,
                add_profiling_args,
                add_autoresume_args,
                add_sft_args,
                add_spec_args,
                add_tp_overlap_args,
                add_validation_set_args,
                add_fim_args,
                add_health_args):
        parser = add(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return add_megatron_flags(parser)  # last: every Megatron flag the adders above did not define


def parse_args(extra_args_provider=None, ignore_unknown_args=False, argv=None):
    """Parse flags; rank and world size come from the launcher's environment (torchrun or SLURM)."""
    parser = build_parser(extra_args_provider)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args(argv)
    else:
        args = parser.parse_args(argv)
    if args.yaml_cfg is not None:
        load_yaml_config(args, parser)
    args.rank = int(os.getenv("RANK", os.getenv("SLURM_PROCID", "0")))
    args.world_size = int(os.getenv("WORLD_SIZE", os.getenv("SLURM_NTASKS", "1")))
    return args


def print_args(title, args):
    """Rank-0 dump of every argument, sorted case-insensitively, dots to column 48 (Megatron's format)."""
    print(f"------------------------ {title} ------------------------", flush=True)
    lines = [f"  {name} {'.' * (48 - len(name))} {value}" for name, value in vars(args).items()]
    for line in sorted(lines, key=lambda s: s.lower()):
        print(line, flush=True)
    print(f"-------------------- end of {title} ---------------------", flush=True)
