"""Megatron Core's ``param_and_grad_buffer.BufferType``: the buffers here are told apart by attribute, not by
this enum. Reached from ``megatron.core.distributed.param_and_grad_buffer`` through its lazy alias table.
"""
import enum


class BufferType(enum.Enum):
    """The two flat buffers of a bucket: params (distributed optimizer only) and grads."""
    PARAM = 1
    GRAD = 2
