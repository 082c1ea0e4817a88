"""parallel_state's Megatron-only setters and the process-group helper metaclass."""
import pytest


def test_expert_parallel_setters_override_and_clear():
    from megatron.core import parallel_state as ps
    ps.set_expert_model_parallel_world_size(4)
    ps.set_expert_model_parallel_rank(3)
    ps.set_expert_tensor_parallel_world_size(2)
    ps.set_expert_tensor_parallel_rank(1)
    try:
        assert (ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()) == (4, 3)
        assert (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()) == (2, 1)
    finally:
        for setter in (ps.set_expert_model_parallel_world_size, ps.set_expert_model_parallel_rank,
                       ps.set_expert_tensor_parallel_world_size, ps.set_expert_tensor_parallel_rank):
            setter(None)
    assert ps.get_expert_model_parallel_world_size() == 1 and ps.get_expert_tensor_parallel_rank() == 0


def test_process_group_helper_meta_guards_vpp_size():
    from megatron.core.process_groups_config import ProcessGroupHelperMeta

    class Holder(metaclass=ProcessGroupHelperMeta):
        pass

    Holder.other = 1
    with pytest.raises(AttributeError, match="set_virtual_pipeline_model_parallel_size"):
        Holder.virtual_pipeline_model_parallel_size = 2
