"""--moe-router-fusion: the routing and balancing-score functions trace into one graph each (no graph
break, checked on CPU with dynamo's aot_eager backend) and give the eager results; the flag reaches the
router and, on CPU, the eager functions run."""
import pytest
import torch

from megatron.core.transformer.moe import moe_utils


@pytest.mark.parametrize("kw", [dict(score_function="softmax"), dict(score_function="softmax", use_pre_softmax=True),
                                dict(score_function="sigmoid", scaling_factor=2.5),
                                dict(score_function="sigmoid", num_groups=4, group_topk=2)],
                         ids=["softmax", "pre-softmax", "sigmoid-scaled", "sigmoid-groups"])
def test_routing_traces_whole_and_matches_eager(kw):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(96, 16, generator=g, requires_grad=True)
    bias = torch.randn(16, generator=g) * 0.1 if kw["score_function"] == "sigmoid" else None
    fn = moe_utils.topk_routing_with_score_function
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    probs, routing_map = compiled(logits, 4, expert_bias=bias, **kw)
    ref_logits = logits.detach().clone().requires_grad_()
    ref_probs, ref_map = fn(ref_logits, 4, expert_bias=bias, **kw)
    assert torch.equal(routing_map, ref_map)
    torch.testing.assert_close(probs, ref_probs)
    probs.pow(2).sum().backward()
    ref_probs.pow(2).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)
    scores_fn = torch.compile(moe_utils.compute_routing_scores_for_aux_loss, backend="aot_eager", fullgraph=True)
    m, s = scores_fn(logits.detach(), 4, kw["score_function"])
    rm, rs = moe_utils.compute_routing_scores_for_aux_loss(logits.detach(), 4, kw["score_function"])
    assert torch.equal(m, rm)
    torch.testing.assert_close(s, rs)


def test_flag_reaches_the_router_and_cpu_runs_eager():
    from megatron.training.arguments import parse_args
    args = parse_args(argv=["--moe-router-fusion", "--num-experts", "8"])
    assert args.moe_router_fusion
    route, scores = moe_utils.fused_router_fns()
    logits = torch.randn(32, 8)
    probs, routing_map = route(logits, 2)
    ref_probs, ref_map = moe_utils.topk_routing_with_score_function(logits, 2)
    assert torch.equal(probs, ref_probs) and torch.equal(routing_map, ref_map)
    assert route.state["fn"] is not moe_utils.topk_routing_with_score_function  # the compiled wrapper, eager on CPU
