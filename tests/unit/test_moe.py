"""MoE pieces against plain per-token references (single process, fp32): top-k routing, capacity
dropping, both token dispatchers with grouped and sequential experts, and the flag validation."""
import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_moe_module_spec
from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping, topk_routing_with_score_function
from megatron.core.transformer.spec_utils import build_module
from megatron.training.arguments import ArgumentError
from tests.fixtures.tiny_gpt import tiny_config
from tests.unit.test_arguments import _args

T, E, H = 24, 8, 32


def _reference_routing(logits, k, pre_softmax=False, score="softmax", bias=None, groups=None, group_topk=None,
                       scale=None):
    """One token at a time, written from the definitions."""
    probs = torch.zeros_like(logits)
    for t in range(logits.shape[0]):
        row = logits[t]
        scores = torch.softmax(row, -1) if (score == "softmax" and pre_softmax) else (
            torch.sigmoid(row) if score == "sigmoid" else row)
        select = scores + (bias if bias is not None else 0)
        allowed = list(range(E))
        if groups:
            size = E // groups
            group_score = [sorted(select[g * size:(g + 1) * size].tolist(), reverse=True)[:k // group_topk]
                           for g in range(groups)]
            best = sorted(range(groups), key=lambda g: -sum(group_score[g]))[:group_topk]
            allowed = [e for e in range(E) if e // size in best]
        chosen = sorted(allowed, key=lambda e: -float(select[e]))[:k]
        w = scores[chosen]
        if score == "softmax" and not pre_softmax:
            w = torch.softmax(w, -1)
        elif score == "sigmoid" and k > 1:
            w = w / w.sum()
        probs[t, chosen] = w * (scale or 1.0)
    return probs


@pytest.mark.parametrize("kw", [dict(), dict(pre_softmax=True), dict(score="sigmoid"), dict(scale=2.5),
                                dict(score="sigmoid", bias=True), dict(score="sigmoid", groups=4, group_topk=2)])
def test_topk_routing_matches_per_token_reference(kw):
    torch.manual_seed(0)
    logits = torch.randn(T, E)
    bias = torch.randn(E) * 0.5 if kw.pop("bias", False) else None
    ref = _reference_routing(logits, 4, bias=bias, **kw)
    probs, routing_map = topk_routing_with_score_function(
        logits, 4, use_pre_softmax=kw.get("pre_softmax", False), num_groups=kw.get("groups"),
        group_topk=kw.get("group_topk"), scaling_factor=kw.get("scale"), score_function=kw.get("score", "softmax"),
        expert_bias=bias)
    torch.testing.assert_close(probs, ref, rtol=1e-6, atol=1e-7)  # same fp32 formulas, reordered
    assert torch.equal(routing_map, ref > 0)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_dropping_keeps_best_tokens_per_expert(policy):
    torch.manual_seed(1)
    probs, routing_map = topk_routing_with_score_function(torch.randn(T, E), 2)
    kept_probs, kept_map = apply_router_token_dropping(probs, routing_map, 2, 0.5, policy)
    capacity = 3  # ceil(24 * 2 / 8 * 0.5)
    for e in range(E):
        tokens = [t for t in range(T) if routing_map[t, e]]
        key = (lambda t: -float(probs[t, e])) if policy == "probs" else (lambda t: t)
        expected = sorted(sorted(tokens, key=key)[:capacity])
        assert [t for t in range(T) if kept_map[t, e]] == expected
    assert torch.equal(kept_probs, probs * kept_map)
    padded_probs, padded_map = apply_router_token_dropping(probs, routing_map, 2, 0.5, policy, pad_to_capacity=True)
    assert padded_map.sum(0).tolist() == [capacity] * E and torch.equal(padded_probs, kept_probs)


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


@pytest.mark.parametrize("flags,world,message", [
    ("--num-experts 4 --moe-router-topk 5", 1, "--moe-router-topk (5)"),
    ("--num-experts 6 --expert-model-parallel-size 4", 4, "--num-experts (6) must be divisible"),
    ("--num-experts 4 --expert-model-parallel-size 4 --tensor-model-parallel-size 2", 4, "world size (4)"),
    ("--num-experts 4 --moe-layer-freq ([0]*1+[1]*3)", 1, "--moe-layer-freq pattern"),
    ("--num-experts 4 --moe-expert-capacity-factor 0", 1, "--moe-expert-capacity-factor (0.0) must be > 0"),
    ("--num-experts 4 --moe-token-dispatcher-type flex", 1, "flex needs DeepEP"),
    ("--expert-model-parallel-size 2", 2, "needs --num-experts"),
    ("--num-experts 4 --moe-apply-probs-on-input", 1, "--moe-apply-probs-on-input needs --moe-router-topk 1"),
])
def test_bad_moe_flags_give_one_line(flags, world, message):
    with pytest.raises(ArgumentError) as err:
        _args(flags, world_size=world)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_moe_layer_freq_pattern_and_flags_reach_config(capsys):
    from megatron.training.arguments import core_transformer_config_from_args
    a = _args("--num-experts 4 --moe-layer-freq ([0]*1+[1]*1) --moe-router-load-balancing-type seq_aux_loss "
              "--moe-aux-loss-coeff 1e-3 --moe-router-score-function sigmoid --moe-router-enable-expert-bias")
    c = core_transformer_config_from_args(a)
    assert c.num_moe_experts == 4 and c.moe_layer_freq == [0, 1] and c.moe_router_enable_expert_bias
    assert c.moe_router_load_balancing_type == "seq_aux_loss" and c.moe_aux_loss_coeff == 1e-3
    with pytest.raises(SystemExit):
        _args("--num-experts 4 --moe-layer-freq [x]")
    assert "argument --moe-layer-freq: '[x]': use an int or a list pattern" in capsys.readouterr().err


def test_flops_count_active_experts():
    """Megatron's MoE formula: MLP FLOPs of a MoE layer use top-k x moe_ffn + the shared expert width."""
    from types import SimpleNamespace

    from megatron.training.flops import num_floating_point_operations
    base = dict(hidden_size=64, num_layers=4, seq_length=32, num_attention_heads=4, kv_channels=None,
                group_query_attention=False, num_query_groups=1, ffn_hidden_size=256, swiglu=True,
                padded_vocab_size=512, vocab_size=512)
    dense = num_floating_point_operations(SimpleNamespace(**base, num_experts=None), 2)
    moe = SimpleNamespace(**base, num_experts=16, moe_layer_freq=[0, 1, 1, 1], moe_router_topk=4,
                          moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=64)
    # 3 MoE layers: active width 4 * 32 + 64 = 192 instead of 256; per token 6 * h * 3 (SwiGLU) * delta.
    assert num_floating_point_operations(moe, 2) == dense - 2 * 32 * 6 * 64 * 3 * (256 - 192) * 3


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


@pytest.mark.parametrize("k", [1, 2, 6])
def test_token_major_permutation_equals_scatter_path(k):
    """The exact-top-k permutation (gather backward, token-major k-way sum) equals the index_add path in
    forward and in the gradients of the tokens and the probs (fp32: only summation order differs)."""
    from megatron.core.transformer.moe.moe_utils import _permute, _unpermute
    torch.manual_seed(0)
    T, E, h = 37, 8, 16
    scores = torch.randn(T, E)
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, scores.topk(k, dim=1).indices, True)
    results = []
    for topk in (None, k):
        x = torch.randn(T, h, generator=torch.Generator().manual_seed(1)).requires_grad_()
        probs = torch.softmax(scores, -1).masked_fill(~routing_map, 0).requires_grad_()
        permuted, pprobs, idx = _permute(x, routing_map, probs, num_out_tokens=T * k, topk=topk)
        y = permuted * torch.arange(1, permuted.shape[0] + 1.0)[:, None]  # row-dependent "experts"
        out = _unpermute(y, idx, (T, h), probs=pprobs, topk=topk)
        out.backward(torch.randn(T, h, generator=torch.Generator().manual_seed(2)))
        results.append((out.detach(), x.grad, probs.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
