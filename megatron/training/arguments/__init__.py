"""Command-line flags with Megatron-LM's names and defaults, their validation, and config builders.

    args = parse_args(extra_args_provider, ignore_unknown_args)
    validate_args(args, args_defaults)   # raises ArgumentError with a one-line message
"""
import argparse
import os

from .diagnostics_args import add_diagnostics_args
from .configs import core_transformer_config_from_args, ddp_config_from_args, optimizer_config_from_args
from .model_args import (add_initialization_args, add_mixed_precision_args, add_network_size_args,
                         add_regularization_args)
from .parallel_data_args import add_data_args, add_distributed_args, add_tokenizer_args
from .training_args import (add_checkpointing_args, add_learning_rate_args, add_logging_args, add_training_args,
                            add_validation_args)
from .unsupported import add_unsupported_args
from . import fast_path
from .validation import ArgumentError, blend_prefixes, validate_args

__all__ = ["parse_args", "validate_args", "ArgumentError", "print_args", "build_parser",
           "core_transformer_config_from_args", "ddp_config_from_args", "optimizer_config_from_args",
           "blend_prefixes"]


def build_parser(extra_args_provider=None):
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    for add in (add_network_size_args, add_regularization_args, add_training_args, add_initialization_args,
                add_learning_rate_args, add_checkpointing_args, add_mixed_precision_args, add_distributed_args,
                add_validation_args, add_data_args, add_tokenizer_args, add_logging_args, add_unsupported_args,
                add_diagnostics_args):
        parser = add(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def parse_args(extra_args_provider=None, ignore_unknown_args=False, argv=None):
    """Parse flags; rank and world size come from the launcher's environment (torchrun or SLURM)."""
    parser = build_parser(extra_args_provider)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args(argv)
    else:
        args = parser.parse_args(argv)
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
