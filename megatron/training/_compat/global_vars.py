"""Megatron-LM's other ``megatron.training.global_vars`` names, for scripts written against Megatron-LM.

Nothing here calls them: the optional integration this application does not ship (one-logger) answers
None, as Megatron's does when it is off; the rest are older names of working functions.
"""
from megatron.core import num_microbatches_calculator as mbc
from megatron.training.global_vars import destroy_global_vars


def get_one_logger():
    return None


def unset_global_variables():
    """Megatron's other name for destroy_global_vars."""
    destroy_global_vars()


def get_num_microbatches():
    return mbc.get_num_microbatches()


def get_current_global_batch_size():
    return mbc.get_current_global_batch_size()
