"""Megatron-LM's ``megatron.training.arguments.parse_and_validate_args``, for scripts written against it.

Our entry points go through ``initialize_megatron``, which parses, validates and prints the flags itself;
this is the same sequence without the print, for Megatron 0.19's config-container scripts.
"""
from megatron.training.arguments import parse_args
from megatron.training.global_vars import set_global_variables
from megatron.training.initialize import load_and_validate_args


def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False, args_defaults={}):
    """Parse the flags, restore checkpoint args when asked, validate, and set the global args."""
    args = parse_args(extra_args_provider, ignore_unknown_args)
    load_and_validate_args(args, args_defaults)
    set_global_variables(args)
    return args
