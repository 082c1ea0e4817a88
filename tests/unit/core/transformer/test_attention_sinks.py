"""--softmax-type: attention with a per-head sink logit equals the fp64 formula (softmax over [sink, scores] without
the sink's column), with causal, explicit and GQA masks, forward and gradients (the sink's too); off-by-one is a sink
of 0; a learnable sink trains and splits over TP with the heads (generation: test_engine.py's gpt-oss case)."""
import pytest
import torch

from megatron.core.transformer.attention_sinks import reference_sink_attention, with_sink
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from tests.fixtures.tiny_gpt import single_rank, tiny_config, tiny_gpt

B, N, S, D = 2, 4, 9, 16


@pytest.mark.parametrize("case", ["causal", "mask", "none"])
def test_with_sink_equals_the_formula(case):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, N, S, D, requires_grad=True) for _ in range(3))
    sink = torch.randn(N, requires_grad=True)
    scale = D ** -0.5
    allowed = {"causal": torch.ones(S, S, dtype=torch.bool).tril(), "mask": torch.rand(S, S) > 0.3,
               "none": None}[case]
    if allowed is not None:
        allowed[:, 0] = True  # every query sees some key
    q2, k2, v2, m = with_sink(q, k, v, sink, scale, None if case == "causal" else allowed, case == "causal")
    out = torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, attn_mask=m, scale=scale)[..., :D]
    ref = reference_sink_attention(q, k, v, sink, scale, allowed)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sink), g)
    want = torch.autograd.grad(ref, (q, k, v, sink), g.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-5, atol=1e-5)


def _core(softmax_type, **cfg):
    single_rank()
    config = tiny_config(num_attention_heads=4, num_query_groups=2, softmax_type=softmax_type, **cfg)
    return DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal), config


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
def test_core_attention_with_gqa_equals_the_formula(softmax_type):
    torch.manual_seed(1)
    core, config = _core(softmax_type)
    hn = config.kv_channels
    q = torch.randn(S, B, 4, hn)
    k, v = torch.randn(S, B, 2, hn), torch.randn(S, B, 2, hn)
    out = core(q, k, v, None).view(S, B, 4, hn).permute(1, 2, 0, 3)
    kr, vr = (t.permute(1, 2, 0, 3).repeat_interleave(2, dim=1) for t in (k, v))
    sink = core.softmax_offset.detach()
    if softmax_type == "off-by-one":
        assert torch.equal(sink, torch.zeros(4)) and not list(core.parameters())
    else:
        assert [p is core.softmax_offset for p in core.parameters()] == [True]
    ref = reference_sink_attention(q.permute(1, 2, 0, 3), kr, vr, sink, hn ** -0.5,
                                   torch.ones(S, S, dtype=torch.bool).tril())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


def test_learnable_sink_gets_a_gradient_and_is_tp_split():
    core, _ = _core("learnable")
    p = core.softmax_offset
    assert p.tensor_model_parallel and p.partition_dim == 0 and p.shape == (4,)
    q = torch.randn(S, B, 4, 8)
    core(q, torch.randn(S, B, 2, 8), torch.randn(S, B, 2, 8), None).sum().backward()
    assert p.grad is not None and p.grad.abs().sum() > 0


def test_gpt_with_sinks_trains():
    single_rank()
    torch.manual_seed(2)
    model = tiny_gpt(tiny_config(softmax_type="learnable"), position_embedding_type="rope")
    names = [n for n, _ in model.named_parameters() if n.endswith("core_attention.softmax_offset")]
    assert len(names) == 2  # one per layer, Megatron's name
    tokens = torch.randint(0, 64, (2, 16))
    loss = model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens).mean()
    loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n in names)


def test_unknown_softmax_type_is_refused():
    with pytest.raises(ValueError, match="--softmax-type"):
        tiny_config(softmax_type="sparsemax")
