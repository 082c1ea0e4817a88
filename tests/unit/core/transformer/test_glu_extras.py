"""gpt-oss's gated activation: --quick-geglu (x * sigmoid(1.702 x) on the gate), --glu-linear-offset (up + offset)
and --activation-func-clamp-value (gate <= c, |up| <= c): the dense MLP and both kinds of experts equal the formula
computed from their own weights, the fused SwiGLU kernels step aside, and the flags reach the config."""
import pytest
import torch

from megatron.core.activations import glu, quick_gelu
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec, get_moe_module_spec
from megatron.core.transformer.spec_utils import build_module
from tests.fixtures.tiny_gpt import tiny_config
from tests.unit.training.arguments.test_arguments import _args

H, F, E = 16, 24, 4
GPT_OSS = dict(gated_linear_unit=True, activation_func=quick_gelu, glu_linear_offset=1.0,
               activation_func_clamp_value=0.5, add_bias_linear=False, hidden_size=H, ffn_hidden_size=F)


def _reference(x, w1, w2, offset=1.0, clamp=0.5, act=quick_gelu):
    h = x @ w1.t()
    gate, up = h.chunk(2, dim=-1)
    gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
    return (act(gate) * (up + offset)) @ w2.t()


def test_glu_formula():
    x = torch.randn(5, 2 * F) * 3
    gate, up = x.chunk(2, dim=-1)
    want = quick_gelu(gate.clamp(max=2.0)) * (up.clamp(-2.0, 2.0) + 1.0)
    torch.testing.assert_close(glu(x, quick_gelu, 1.0, 2.0), want)
    torch.testing.assert_close(glu(x, quick_gelu), quick_gelu(gate) * up)


@pytest.mark.parametrize("fusion", [False, True])
def test_dense_mlp_follows_the_formula(fusion):
    torch.manual_seed(0)
    cfg = tiny_config(bias_activation_fusion=fusion, **GPT_OSS)
    mlp = build_module(get_mlp_module_spec(use_te=False), config=cfg)
    assert mlp.fused_activation is None  # the fused kernels compute no offset or clamp
    x = torch.randn(6, 2, H) * 4  # past the clamp
    torch.testing.assert_close(mlp(x)[0], _reference(x, mlp.linear_fc1.weight, mlp.linear_fc2.weight))


@pytest.mark.parametrize("grouped", [True, False])
def test_experts_follow_the_formula(grouped):
    """Top-1 routing, the prob applied after the activation: each token's output is its prob times the formula with
    its expert's weights."""
    torch.manual_seed(1)
    cfg = tiny_config(num_moe_experts=E, moe_router_topk=1, moe_grouped_gemm=grouped, moe_aux_loss_coeff=0.0,
                      bias_activation_fusion=True, **GPT_OSS)
    layer = build_module(get_moe_module_spec(num_experts=E, moe_grouped_gemm=grouped), config=cfg)
    x = torch.randn(7, 1, H) * 4
    y = layer(x)[0].view(-1, H)
    dense_probs, routing_map = layer.router(x)  # [tokens, E] each
    probs, top = dense_probs.view(-1, E).max(dim=-1)
    assert routing_map.view(-1, E).sum(dim=-1).eq(1).all()
    for t in range(x.shape[0]):
        e = int(top[t])
        if grouped:
            w1, w2 = layer.experts.weight1[e], layer.experts.weight2[e]
        else:
            w1, w2 = layer.experts.local_experts[e].linear_fc1.weight, layer.experts.local_experts[e].linear_fc2.weight
        torch.testing.assert_close(y[t], probs[t] * _reference(x.view(-1, H)[t], w1, w2), rtol=1e-5, atol=1e-6)


def test_config_refuses_extras_without_a_gated_unit():
    with pytest.raises(ValueError, match="--glu-linear-offset"):
        tiny_config(glu_linear_offset=1.0)
    with pytest.raises(ValueError, match="must be > 0"):
        tiny_config(gated_linear_unit=True, activation_func_clamp_value=0.0)


def test_flags_reach_the_config():
    from megatron.training.arguments.configs import core_transformer_config_from_args
    args = _args("--quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0")
    cfg = core_transformer_config_from_args(args)
    assert cfg.gated_linear_unit and cfg.activation_func is quick_gelu
    assert cfg.glu_linear_offset == 1.0 and cfg.activation_func_clamp_value == 7.0
