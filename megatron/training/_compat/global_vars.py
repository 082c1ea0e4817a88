"""Megatron-LM's other ``megatron.training.global_vars`` names, for scripts written against Megatron-LM.

Nothing here calls them: the optional integrations this application does not ship (one-logger, the
energy monitor) answer None, as Megatron's do when they are off; the rest are older names of working
functions.
"""
from megatron.core import num_microbatches_calculator as mbc
from megatron.training.global_vars import destroy_global_vars


def get_one_logger():
    return None


def get_energy_monitor():
    return None


def unset_global_variables():
    """Megatron's other name for destroy_global_vars."""
    destroy_global_vars()


def get_num_microbatches():
    return mbc.get_num_microbatches()


def get_current_global_batch_size():
    return mbc.get_current_global_batch_size()
