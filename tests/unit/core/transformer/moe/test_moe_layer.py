"""The MoE layer against plain per-token references (single process, fp32): both token dispatchers with
grouped and sequential experts, with and without a capacity, and probabilities applied on the input."""
import pytest
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


def _expert_fn(layer, e):
    """Expert e of the layer as a plain function of one token."""
    c = layer.config
    if hasattr(layer.experts, "weight1"):
        w1, w2 = layer.experts.weight1[e], layer.experts.weight2[e]
    else:
        w1 = layer.experts.local_experts[e].linear_fc1.weight
        w2 = layer.experts.local_experts[e].linear_fc2.weight
    def f(x):
        gate, up = torch.chunk(w1 @ x, 2)
        return w2 @ (c.activation_func(gate) * up)
    return f


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("capacity", [None, 0.5])
def test_moe_layer_matches_per_token_reference(dispatcher, grouped, capacity):
    torch.manual_seed(2)
    config = _config(moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=grouped,
                     moe_expert_capacity_factor=capacity, moe_shared_expert_intermediate_size=16)
    layer = build_module(get_moe_module_spec(num_experts=E, moe_grouped_gemm=grouped), config=config)
    x = torch.randn(6, 4, H, requires_grad=True)  # [s, b, h]
    out, bias = layer(x)
    assert bias is None and out.shape == x.shape
    probs, routing_map = layer.router(x.detach())
    flat = x.detach().reshape(-1, H)
    experts = [_expert_fn(layer, e) for e in range(E)]
    ref = torch.stack([sum(probs[t, e] * experts[e](flat[t]) for e in range(E) if routing_map[t, e])
                       + layer.shared_experts(flat[t:t + 1]).squeeze(0) for t in range(flat.shape[0])])
    torch.testing.assert_close(out.reshape(-1, H), ref.detach(), rtol=1e-5, atol=1e-6)  # fp32 sums reordered
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_probs_on_input_matches_per_token_reference(dispatcher):
    """--moe-apply-probs-on-input (top-1): token t's output is expert_e(p_t * x_t), not p_t * expert_e(x_t)."""
    torch.manual_seed(4)
    config = _config(moe_token_dispatcher_type=dispatcher, moe_router_topk=1, moe_apply_probs_on_input=True,
                     moe_grouped_gemm=True)
    layer = build_module(get_moe_module_spec(num_experts=E, moe_grouped_gemm=True), config=config)
    x = torch.randn(6, 4, H)
    out, _ = layer(x)
    probs, routing_map = layer.router(x)
    flat = x.reshape(-1, H)
    experts = [_expert_fn(layer, e) for e in range(E)]
    ref = torch.stack([sum(experts[e](probs[t, e] * flat[t]) for e in range(E) if routing_map[t, e])
                       for t in range(flat.shape[0])])
    torch.testing.assert_close(out.reshape(-1, H), ref.detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="--moe-apply-probs-on-input needs --moe-router-topk 1"):
        from megatron.core.transformer.moe.config_checks import check_moe_config
        check_moe_config(_config(moe_router_topk=2, moe_apply_probs_on_input=True))


def _graph_holding_attributes(module):
    """(owner path, attribute) of every tensor that a submodule, or a plain helper object it owns (the token
    dispatcher), keeps and that belongs to an autograd graph."""
    held = []
    for path, sub in module.named_modules():
        owners = [(path, sub)] + [(f"{path}.{name}", v) for name, v in vars(sub).items()
                                  if hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, torch.Tensor))]
        for where, owner in owners:
            for name, value in vars(owner).items():
                if torch.is_tensor(value) and value.grad_fn is not None:
                    held.append((where, name))
    return held


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("capacity", [None, 1.0])
def test_layer_keeps_no_autograd_graph_after_the_step(dispatcher, capacity):
    """After forward and backward no submodule holds a tensor of the step's graph. One held keeps the graph,
    and every AccumulateGrad node on it, alive into the next step; under --cuda-graph-impl full_iteration the
    capture then reuses warm-up nodes (the routing probabilities the dispatchers kept did so)."""
    config = _config(moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=True, moe_aux_loss_coeff=1e-2,
                     moe_expert_capacity_factor=capacity, moe_pad_expert_input_to_capacity=capacity is not None)
    layer = build_module(get_moe_module_spec(num_experts=E, moe_grouped_gemm=True), config=config)
    x = torch.randn(6, 4, H, requires_grad=True)
    out, _ = layer(x)
    out.sum().backward()
    assert _graph_holding_attributes(layer) == []


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize("grouped", [False, True])
def test_latent_moe_matches_per_token_reference(dispatcher, grouped):
    """--moe-latent-size 16: the router and the shared expert see the hidden state, the routed experts a down-
    projected one (latent 16 wide, their weights [.., 16]), and the combined output is projected back up:
    out_t = W_up sum_e p_te expert_e(W_down x_t) + shared(x_t)."""
    torch.manual_seed(3)
    config = _config(moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=grouped, moe_latent_size=16,
                     moe_shared_expert_intermediate_size=16)
    layer = build_module(get_moe_module_spec(num_experts=E, moe_grouped_gemm=grouped), config=config)
    names = dict(layer.named_parameters())
    assert names["fc1_latent_proj.weight"].shape == (16, H) and names["fc2_latent_proj.weight"].shape == (H, 16)
    x = torch.randn(6, 4, H, requires_grad=True)
    out, _ = layer(x)
    probs, routing_map = layer.router(x.detach())
    flat = x.detach().reshape(-1, H)
    down, up = layer.fc1_latent_proj.weight.detach(), layer.fc2_latent_proj.weight.detach()
    experts = [_expert_fn(layer, e) for e in range(E)]
    ref = torch.stack([up @ sum(probs[t, e] * experts[e](down @ flat[t]) for e in range(E) if routing_map[t, e])
                       + layer.shared_experts(flat[t:t + 1]).squeeze(0) for t in range(flat.shape[0])])
    torch.testing.assert_close(out.reshape(-1, H), ref.detach(), rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    for p in (layer.fc1_latent_proj.weight, layer.fc2_latent_proj.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0 and p.sequence_parallel
