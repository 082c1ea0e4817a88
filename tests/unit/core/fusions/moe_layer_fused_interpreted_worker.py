"""Run by test_moe_permute.py with TRITON_INTERPRET=1: a whole MoE layer (router, all-to-all dispatcher at EP=1,
grouped experts, shared expert, the balancing loss) with --moe-permute-fusion and --moe-router-fusion, the kernels
running on CPU tensors under the interpreter, against the same layer without them: output, input gradient and
every parameter's gradient (fp32). Also asserts the fused functions were the ones used (no fallback to eager) and
that the dispatcher handed the permutation's token map to the unpermutation. Prints "name error tolerance"."""
import copy

import torch

from megatron.core.fusions import moe_permute, moe_router
from megatron.core.models.gpt.gpt_layer_specs import get_moe_module_spec
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.spec_utils import build_module
from tests.fixtures.tiny_gpt import tiny_config

moe_permute.available = lambda tokens, num_experts=1: True  # the interpreter runs the kernels on CPU tensors
moe_router.available = lambda *args, **kwargs: True


def run(layer, x):
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    out.square().sum().backward()
    return out, x.grad, {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def main():
    torch.manual_seed(0)
    for score, kwargs in (("softmax", {}), ("sigmoid", dict(moe_router_score_function="sigmoid",
                                                           moe_router_enable_expert_bias=True,
                                                           moe_router_topk_scaling_factor=2.0))):
        config = tiny_config(hidden_size=32, num_moe_experts=8, moe_router_topk=2, gated_linear_unit=True,
                             moe_ffn_hidden_size=16, activation_func=torch.nn.functional.silu, add_bias_linear=False,
                             moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="aux_loss",
                             moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True,
                             moe_shared_expert_intermediate_size=16, **kwargs)
        eager = build_module(get_moe_module_spec(num_experts=8, moe_grouped_gemm=True), config=config)
        fused_config = copy.copy(config)
        fused_config.moe_permute_fusion = fused_config.moe_router_fusion = True
        fused = build_module(get_moe_module_spec(num_experts=8, moe_grouped_gemm=True), config=fused_config)
        fused.load_state_dict(eager.state_dict())
        x = torch.randn(6, 3, 32)
        want, got = run(eager, x), run(fused, x)
        assert hasattr(fused.token_dispatcher.sorted_indices, "token_rows"), "the fused permutation did not run"
        for fn, way in ((moe_utils.fused_permute_fns()[0], moe_utils._fused_permute),
                        (moe_utils.fused_permute_fns()[1], moe_utils._fused_unpermute),
                        (moe_utils.fused_router_fns()[0], moe_utils._fused_topk_routing),
                        (moe_utils.fused_router_fns()[1], moe_utils._fused_aux_scores)):
            assert fn.state["fn"] is way, f"{way.__name__} fell back to the eager function"
        print(f"{score}-out {(got[0] - want[0]).abs().max().item() / want[0].abs().max().item():.3e} 1e-5")
        print(f"{score}-dx {(got[1] - want[1]).abs().max().item() / want[1].abs().max().item():.3e} 1e-5")
        assert got[2].keys() == want[2].keys()
        for name, ref in want[2].items():
            err = (got[2][name] - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
            print(f"{score}-grad-{name} {err:.3e} 1e-5")


if __name__ == "__main__":
    main()
