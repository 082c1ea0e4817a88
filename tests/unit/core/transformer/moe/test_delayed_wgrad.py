"""--delay-wgrad-compute: the experts' backward leaves the weight gradients parked until the store is
flushed (by the dispatcher's backward), and the flushed gradients equal autograd's (fp32; the same
per-expert sums, 1e-6 relative)."""
import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_moe_module_spec
from megatron.core.transformer.moe.delayed_wgrad import DelayedWgrad
from megatron.core.transformer.moe.experts import grouped_gemm
from megatron.core.transformer.spec_utils import build_module
from tests.fixtures.tiny_gpt import tiny_config

H, E = 32, 4


def _grouped(x, w, tokens, store, use_offs):
    offs = torch.cumsum(tokens, 0).to(torch.int32) if use_offs else None
    return grouped_gemm(x, w, tokens, offs, store)


@pytest.mark.parametrize("use_offs", [False, True])
def test_grouped_gemm_parks_the_weight_gradient(use_offs):
    torch.manual_seed(0)
    x = torch.randn(10, 16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(3, 24, 16))
    tokens = torch.tensor([3, 0, 7])
    hooked = []
    w.register_post_accumulate_grad_hook(lambda p: hooked.append(p.grad is not None))
    store = DelayedWgrad()
    try:
        y = _grouped(x, w, tokens, store, use_offs)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"_grouped_mm not available on CPU in this torch: {e}")
    g = torch.randn_like(y)
    y.backward(g)
    assert w.grad is None and store.pending and x.grad is not None
    store.flush()
    assert not store.pending and hooked[-1] is True  # the hook saw the gradient once it landed
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    _grouped(x2, w2, tokens, None, use_offs).backward(g)
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-6, atol=1e-6)


def _layer(delay):
    torch.manual_seed(5)
    config = tiny_config(hidden_size=H, num_moe_experts=E, moe_router_topk=2, gated_linear_unit=True,
                         activation_func=torch.nn.functional.silu, add_bias_linear=False,
                         moe_aux_loss_coeff=0.0, moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall",
                         delay_wgrad_compute=delay)
    return build_module(get_moe_module_spec(num_experts=E, moe_grouped_gemm=True), config=config)


def test_moe_layer_flushes_in_its_backward():
    """Without expert parallelism the permutation's backward flushes the store: after backward every
    expert weight has its gradient, equal to the run without the flag."""
    ref, delayed = _layer(False), _layer(True)
    delayed.load_state_dict(ref.state_dict())
    assert delayed.experts.weight1.delay_wgrad and not hasattr(ref.experts.weight1, "delay_wgrad")
    x = torch.randn(8, 2, H)
    g = torch.randn(8, 2, H)
    for layer in (ref, delayed):
        layer(x.clone().requires_grad_())[0].backward(g)
    assert not delayed.experts.wgrad_store.pending
    for (name, p), q in zip(ref.named_parameters(), delayed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-6, msg=name)
