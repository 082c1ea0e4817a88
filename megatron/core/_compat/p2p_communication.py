"""Megatron Core's ``p2p_communication.is_single_shape``: the communicator here exchanges one tensor per stage
boundary and never asks. Reached from ``megatron.core.pipeline_parallel.p2p_communication`` through its
lazy alias table.
"""
import torch


def is_single_shape(x) -> bool:
    """True for one tensor shape (a torch.Size or a sequence of ints), False for a list of shapes."""
    return isinstance(x, torch.Size) or (isinstance(x, (list, tuple)) and all(isinstance(d, int) for d in x))
