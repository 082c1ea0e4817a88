"""--use-fused-weighted-squared-relu: relu(x)^2 * prob in fp32 equals an fp64 reference (value and both
gradients), and an MoE layer with the flag (grouped and sequential experts) equals the layer without it, with the
fused function taking the activation."""
import pytest
import torch

from megatron.core.activations import squared_relu
from megatron.core.fusions import weighted_squared_relu as wsr
from megatron.core.models.gpt.gpt_layer_specs import get_moe_module_spec
from megatron.core.transformer.spec_utils import build_module
from tests.fixtures.tiny_gpt import tiny_config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_fp64_reference(dtype):
    torch.manual_seed(0)
    x = torch.randn(40, 24).to(dtype).requires_grad_()
    p = torch.rand(40, requires_grad=True)
    g = torch.randn(40, 24).to(dtype)
    y = wsr.weighted_squared_relu(x, p)
    y.backward(g)
    x64, p64 = x.detach().double().requires_grad_(), p.detach().double().requires_grad_()
    ref = torch.relu(x64) ** 2 * p64[:, None]
    ref.backward(g.double())
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    assert y.dtype == dtype and x.grad.dtype == dtype and p.grad.dtype == p.dtype
    torch.testing.assert_close(y.double(), ref, **tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    torch.testing.assert_close(p.grad.double(), p64.grad, rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 5e-2)


@pytest.mark.parametrize("grouped", [True, False])
def test_moe_layer_with_the_flag_equals_the_layer_without(grouped, monkeypatch):
    calls = []
    real = wsr.weighted_squared_relu

    def spy(x, p):
        calls.append(x.shape)
        return real(x, p)
    from megatron.core.transformer import mlp
    from megatron.core.transformer.moe import experts
    monkeypatch.setattr(experts, "weighted_squared_relu", spy)
    monkeypatch.setattr(mlp, "weighted_squared_relu", spy)
    out, weights = [], None
    for flag in (False, True):
        cfg = tiny_config(hidden_size=32, num_moe_experts=4, moe_router_topk=2, gated_linear_unit=False,
                          activation_func=squared_relu, add_bias_linear=False, moe_aux_loss_coeff=0.0,
                          moe_grouped_gemm=grouped, use_fused_weighted_squared_relu=flag)
        layer = build_module(get_moe_module_spec(num_experts=4, moe_grouped_gemm=grouped), config=cfg)
        if weights is None:  # the same weights for both (an RNG tracker left by another test draws its own)
            weights = layer.state_dict()
        layer.load_state_dict(weights)
        torch.manual_seed(6)
        x = torch.randn(8, 2, 32, requires_grad=True)
        y = layer(x)[0]
        y.backward(torch.ones_like(y))
        out.append((y, x.grad, [p.grad for p in layer.parameters()]))
    assert calls, "the fused activation was not used"
    (y0, gx0, gp0), (y1, gx1, gp1) = out
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx1, gx0, rtol=1e-6, atol=1e-6)
    for a, b in zip(gp1, gp0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_config_refuses_it_without_squared_relu():
    with pytest.raises(ValueError, match="--use-fused-weighted-squared-relu"):
        tiny_config(hidden_size=32, num_moe_experts=4, moe_router_topk=2, gated_linear_unit=True,
                    activation_func=torch.nn.functional.silu, add_bias_linear=False,
                    use_fused_weighted_squared_relu=True)
