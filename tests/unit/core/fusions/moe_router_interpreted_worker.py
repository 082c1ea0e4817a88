"""Run by test_moe_router.py with TRITON_INTERPRET=1 (set before Triton loads): the fused router
(`moe_utils._fused_topk_routing` / `_fused_aux_scores`, the kernels of `megatron/core/fusions/moe_router.py`) on CPU
against the eager `topk_routing_with_score_function` / `compute_routing_scores_for_aux_loss`, forward and
backward: softmax after and before the selection, sigmoid with DeepSeek-V3's expert bias, group limit and scaling,
sqrt(softplus) with very negative logits, k = 1, expert counts that are not powers of two; fp32 and bf16 logits
(distinct values, so no tie leaves the selection open). Prints "name error tolerance" per compared tensor."""
import torch

from megatron.core.fusions import moe_router
from megatron.core.transformer.moe import moe_utils

moe_router.available = lambda *args, **kwargs: True  # the interpreter runs the kernels on CPU tensors

CASES = {  # name: (experts, k, keyword arguments of the routing)
    "softmax": (8, 2, {}),
    "softmax_pre_scaled": (16, 4, dict(use_pre_softmax=True, scaling_factor=2.5)),
    "sigmoid_bias_groups": (64, 8, dict(score_function="sigmoid", num_groups=8, group_topk=4, scaling_factor=2.5,
                                        expert_bias=True)),
    "sigmoid_top1": (5, 1, dict(score_function="sigmoid")),
    "sqrtsoftplus_bias": (12, 3, dict(score_function="sqrtsoftplus", expert_bias=True)),
}


def logits_for(tokens, experts, dtype, gen, shift=0.0):
    """Distinct values per row, exact in bf16: a permutation of (i - E/2) / 16."""
    rows = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)]).float()
    return ((rows - experts / 2) / 16 + shift).to(dtype)


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def main():
    gen = torch.Generator().manual_seed(0)
    # The group limit must matter on these logits, or the case would not test it.
    x = logits_for(11, 64, torch.float32, torch.Generator().manual_seed(1))
    limited = moe_utils.topk_routing_with_score_function(x, 8, score_function="sigmoid", num_groups=8, group_topk=4)
    free = moe_utils.topk_routing_with_score_function(x, 8, score_function="sigmoid")
    assert not torch.equal(limited[1], free[1])
    # Maps must be equal; values agree to fp32 rounding, and in bf16 to a few units in the last place.
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for name, (experts, k, kwargs) in CASES.items():
            kwargs = dict(kwargs)
            if kwargs.pop("expert_bias", False):
                kwargs["expert_bias"] = torch.randn(experts, generator=gen) * 0.01
            shift = -30.0 if name.startswith("sqrtsoftplus") else 0.0
            x = logits_for(11, experts, dtype, gen, shift)
            dprobs = torch.randn(11, experts, generator=gen).to(dtype)
            got, ref = {}, {}
            for out, fn in ((got, moe_utils._fused_topk_routing), (ref, moe_utils.topk_routing_with_score_function)):
                logits = x.clone().requires_grad_(True)
                probs, routing_map = fn(logits, k, **kwargs)
                (probs.float() * dprobs.float()).sum().backward()
                out.update(probs=probs, map=routing_map, dlogits=logits.grad)
            score = kwargs.get("score_function", "softmax")
            for out, fn in ((got, moe_utils._fused_aux_scores), (ref, moe_utils.compute_routing_scores_for_aux_loss)):
                logits = x.clone().requires_grad_(True)
                routing_map, scores = fn(logits, k, score)
                (scores * dprobs.float()).sum().backward()
                out.update(aux_map=routing_map, aux_scores=scores, aux_dlogits=logits.grad)
            case = f"{str(dtype).split('.')[-1]}-{name}"
            for key, value in ref.items():
                assert got[key].dtype == value.dtype and got[key].shape == value.shape, (case, key)
                if value.dtype == torch.bool:
                    print(f"{case}-{key} {float((got[key] != value).sum()):.3e} 0")
                else:
                    print(f"{case}-{key} {rel(got[key], value):.3e} {tol}")


if __name__ == "__main__":
    main()
