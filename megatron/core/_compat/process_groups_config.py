"""Megatron Core's ``process_groups_config.ProcessGroupHelperMeta``, a metaclass no class here uses. Reached
from ``megatron.core.process_groups_config`` through its lazy alias table.
"""


class ProcessGroupHelperMeta(type):
    """A metaclass whose classes refuse a direct class-level assignment of
    virtual_pipeline_model_parallel_size (it must go through a setter), as Megatron's."""

    def __setattr__(cls, name, value):
        if name == "virtual_pipeline_model_parallel_size":
            raise AttributeError(f"Cannot set '{name}' directly. Use set_virtual_pipeline_model_parallel_size() "
                                 "method instead.")
        super().__setattr__(name, value)
