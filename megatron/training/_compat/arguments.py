"""Megatron-LM's other ``megatron.training.arguments`` names, for scripts written against it.

Our entry points go through ``initialize_megatron``, which parses, validates and prints the flags itself;
parse_and_validate_args is the same sequence without the print, for Megatron 0.19's config-container
scripts. add_megatron_arguments serves tools that build their own parser.
"""
from megatron.training.arguments import build_parser, parse_args
from megatron.training.global_vars import set_global_variables
from megatron.training.initialize import load_and_validate_args


def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False, args_defaults={}):
    """Parse the flags, restore checkpoint args when asked, validate, and set the global args."""
    args = parse_args(extra_args_provider, ignore_unknown_args)
    load_and_validate_args(args, args_defaults)
    set_global_variables(args)
    return args


def add_megatron_arguments(parser):
    """Add every Megatron flag this application knows to `parser` (for tools with their own parser)."""
    full = build_parser()
    full._actions = [a for a in full._actions if "-h" not in a.option_strings]  # `parser` has its own help
    for group in full._action_groups:
        group._group_actions = [a for a in group._group_actions if "-h" not in a.option_strings]
    parser._add_container_actions(full)  # what argparse's `parents=` does
    return parser
