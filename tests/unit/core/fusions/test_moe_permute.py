"""--moe-permute-fusion's kernels (megatron/core/fusions/moe_permute.py): under Triton's CPU interpreter (its own
process), the fused permutation and unpermutation equal the eager sort-based ones, forward and backward, with and
without routing probabilities (moe_permute_interpreted_worker.py). Without the kernels (CPU tensors) the fused
functions are the eager ones."""

import torch

from megatron.core.transformer.moe import moe_utils
from tests.unit.core.fusions.interpreted import check_worker, needs_triton3


@needs_triton3
def test_fused_permutation_equals_eager_under_the_interpreter():
    check_worker("moe_permute_interpreted_worker.py", 2 * 4 * (4 + 6 + 6))


def test_without_kernels_the_fused_functions_are_eager():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=gen)
    routing_map = torch.zeros(5, 4, dtype=torch.bool).scatter_(1, torch.rand(5, 4, generator=gen).topk(2).indices,
                                                               True)
    rows, _, sorted_indices = moe_utils._fused_permute(x, routing_map, topk=2, num_out_tokens=10)
    ref_rows, _, ref_sorted = moe_utils._permute(x, routing_map, topk=2, num_out_tokens=10)
    assert torch.equal(rows, ref_rows) and torch.equal(sorted_indices, ref_sorted)
    assert not hasattr(sorted_indices, "token_rows")  # the eager way back is taken
    out = moe_utils._fused_unpermute(rows, sorted_indices, x.shape, topk=2)
    assert torch.allclose(out, 2 * x)


@needs_triton3
def test_moe_layer_with_both_fusion_flags_equals_eager_under_the_interpreter():
    """A whole MoE layer with --moe-permute-fusion --moe-router-fusion, kernels interpreted on CPU, against the
    same layer without them: output and every gradient to fp32 rounding, the fused functions used throughout."""
    check_worker("moe_layer_fused_interpreted_worker.py", 2 * (2 + 5))
