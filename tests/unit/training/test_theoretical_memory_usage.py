"""The memory estimate divides activations and logits by the context-parallel size."""
from tests.unit.training.arguments.test_arguments import _args

NO_DROPOUT = "--attention-dropout 0 "


def test_memory_estimate_divides_activations_by_cp():
    from megatron.training.theoretical_memory_usage import compute_activation_memory, compute_logits_memory
    one = _args(NO_DROPOUT, world_size=2)
    two = _args(NO_DROPOUT + "--context-parallel-size 2", world_size=2)
    assert compute_activation_memory(two) == compute_activation_memory(one) / 2
    assert compute_logits_memory(two) == compute_logits_memory(one) / 2
