"""--moe-router-fusion's kernels (megatron/core/fusions/moe_router.py): under Triton's CPU interpreter (its own
process), the fused routing and balancing-loss scores equal the eager functions, forward and backward, for every
score function, the expert bias, the group limit and the scaling (moe_router_interpreted_worker.py); and they
compile for Hopper without a GPU. Without the kernels (CPU tensors) the fused functions are the eager ones."""

import pytest
import torch

from megatron.core.transformer.moe import moe_utils
from tests.unit.core.fusions.interpreted import check_worker, needs_triton3


@needs_triton3
def test_fused_router_equals_eager_under_the_interpreter():
    check_worker("moe_router_interpreted_worker.py", 2 * 5 * 6)


@pytest.mark.parametrize("logits", ["*fp32", "*bf16"])
@pytest.mark.parametrize("experts,k,score,pre,groups", [(128, 8, 0, False, 0), (64, 2, 0, True, 0),
                                                        (256, 8, 1, False, 8), (32, 4, 2, False, 0)])
def test_kernels_compile_for_hopper(logits, experts, k, score, pre, groups):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megatron.core.fusions import _triton_moe_router as kernels
    e_pad = triton.next_power_of_2(experts)
    warps = kernels._warps(experts)
    sources = [
        (kernels._route_fwd_kernel, {"logits_ptr": logits, "bias_ptr": "*fp32", "probs_ptr": logits, "map_ptr": "*u8",
                                     "E": "i32", "scaling": "fp32", "K": "constexpr", "SCORE": "constexpr",
                                     "PRE": "constexpr", "HAS_BIAS": "constexpr", "HAS_SCALE": "constexpr",
                                     "GROUPS": "constexpr", "G_PAD": "constexpr", "GROUP_TOPK": "constexpr",
                                     "E_PAD": "constexpr"},
         dict(K=k, SCORE=score, PRE=pre, HAS_BIAS=score > 0, HAS_SCALE=True, GROUPS=groups,
              G_PAD=triton.next_power_of_2(max(groups, 1)), GROUP_TOPK=4 if groups else 1, E_PAD=e_pad)),
        (kernels._route_bwd_kernel, {"logits_ptr": logits, "map_ptr": "*u8", "dprobs_ptr": logits,
                                     "dlogits_ptr": logits, "E": "i32", "scaling": "fp32", "K": "constexpr",
                                     "SCORE": "constexpr", "PRE": "constexpr", "HAS_SCALE": "constexpr",
                                     "E_PAD": "constexpr"},
         dict(K=k, SCORE=score, PRE=pre, HAS_SCALE=True, E_PAD=e_pad)),
        (kernels._aux_fwd_kernel, {"logits_ptr": logits, "scores_ptr": "*fp32", "map_ptr": "*u8", "E": "i32",
                                   "K": "constexpr", "SCORE": "constexpr", "E_PAD": "constexpr"},
         dict(K=k, SCORE=score, E_PAD=e_pad)),
        (kernels._aux_bwd_kernel, {"logits_ptr": logits, "dscores_ptr": "*fp32", "dlogits_ptr": logits, "E": "i32",
                                   "SCORE": "constexpr", "E_PAD": "constexpr"}, dict(SCORE=score, E_PAD=e_pad)),
    ]
    for fn, signature, constexprs in sources:
        try:
            kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                    target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        except (RuntimeError, FileNotFoundError, ImportError) as e:  # a Triton build without the CUDA backend
            pytest.skip(f"Triton cannot compile for CUDA here: {e}")
        assert ".entry" in kernel.asm["ptx"], fn.__name__


def test_without_kernels_the_fused_functions_are_eager():
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    for got, ref in zip(moe_utils._fused_topk_routing(logits, 2, score_function="sigmoid"),
                        moe_utils.topk_routing_with_score_function(logits, 2, score_function="sigmoid")):
        assert torch.equal(got, ref)
    for got, ref in zip(moe_utils._fused_aux_scores(logits, 2, "softmax"),
                        moe_utils.compute_routing_scores_for_aux_loss(logits, 2, "softmax")):
        assert torch.equal(got, ref)
