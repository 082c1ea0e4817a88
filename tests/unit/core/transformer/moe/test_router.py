"""The router: the expert bias stays fp32 and moves toward balance; Sinkhorn routing spreads skewed
logits."""
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_moe_module_spec
from megatron.core.transformer.spec_utils import build_module
from tests.fixtures.tiny_gpt import tiny_config

T, E, H = 24, 8, 32


def _config(**kw):
    base = dict(hidden_size=H, num_moe_experts=E, moe_router_topk=2, gated_linear_unit=True,
                activation_func=torch.nn.functional.silu, add_bias_linear=False, moe_aux_loss_coeff=0.0)
    base.update(kw)
    return tiny_config(**base)


def test_expert_bias_stays_fp32_and_moves_toward_balance():
    from megatron.core.transformer.moe.router import finalize_router_state
    config = _config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_bias_update_rate=0.01)
    layer = build_module(get_moe_module_spec(num_experts=E), config=config).bfloat16()
    assert layer.router.expert_bias.dtype == torch.float32
    layer(torch.randn(6, 4, H, dtype=torch.bfloat16))
    counts = layer.router.local_tokens_per_expert.clone()
    assert counts.sum() == 6 * 4 * 2
    finalize_router_state([layer], config)
    expected = torch.sign(counts.mean() - counts) * 0.01
    assert torch.equal(layer.router.expert_bias, expected) and layer.router.local_tokens_per_expert.sum() == 0


def test_sinkhorn_routing_balances_skewed_logits():
    """Sinkhorn selection spreads tokens that plain top-1 would send to one expert."""
    config = _config(moe_router_topk=1, moe_router_load_balancing_type="sinkhorn")
    layer = build_module(get_moe_module_spec(num_experts=E), config=config)
    logits = torch.randn(64, E) * 0.1
    logits[:, 0] += 3.0  # every token prefers expert 0
    probs, routing_map = layer.router.routing(logits)
    assert routing_map.sum(1).eq(1).all() and routing_map.sum(0).max() <= 16
    torch.testing.assert_close(probs[routing_map], torch.sigmoid(logits)[routing_map])
