"""Experts: grouped and sequential experts agree, the grouped-GEMM function equals the per-expert loop,
and --moe-grouped-gemm leaves the model unchanged."""
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


def test_grouped_and_sequential_experts_agree():
    torch.manual_seed(3)
    grouped = build_module(get_moe_module_spec(num_experts=E, moe_grouped_gemm=True),
                           config=_config(moe_grouped_gemm=True))
    seq = build_module(get_moe_module_spec(num_experts=E), config=_config())
    with torch.no_grad():
        seq.router.weight.copy_(grouped.router.weight)
        for e, expert in enumerate(seq.experts.local_experts):
            expert.linear_fc1.weight.copy_(grouped.experts.weight1[e])
            expert.linear_fc2.weight.copy_(grouped.experts.weight2[e])
    x = torch.randn(8, 2, H)
    torch.testing.assert_close(grouped(x)[0], seq(x)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_grouped_linear_matches_expert_loop():
    """The grouped-GEMM autograd function (the GPU fast path) against the per-expert loop, forward and
    both gradients, with an expert that gets no tokens; torch runs _grouped_mm on CPU in fp32 here."""
    from megatron.core.transformer.moe.experts import grouped_gemm
    torch.manual_seed(4)
    x = torch.randn(10, 16, requires_grad=True)
    w = torch.randn(3, 24, 16, requires_grad=True)
    tokens = torch.tensor([3, 0, 7])
    try:
        y = grouped_gemm(x, w, tokens, torch.cumsum(tokens, 0).to(torch.int32))
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"_grouped_mm not available on CPU in this torch: {e}")
    g = torch.randn_like(y)
    y.backward(g)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    grouped_gemm(x2, w2, tokens).backward(g)
    torch.testing.assert_close(y, grouped_gemm(x2, w2, tokens))
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


def test_grouped_gemm_flag_does_not_change_the_model():
    """GroupedMLP initializes each expert like SequentialMLP's expert linears: same GPT, same logits."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    out = []
    for grouped in (False, True):
        c = _config(moe_grouped_gemm=grouped, moe_layer_freq=[0, 1])
        model = GPTModel(c, get_gpt_decoder_block_spec(c), vocab_size=64, max_sequence_length=16)
        tokens = torch.arange(32).view(2, 16) % 64
        out.append(model(tokens, torch.arange(16).expand(2, 16), None))
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-5)
