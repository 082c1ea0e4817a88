"""Megatron's MoE utility API (megatron.core.transformer.moe.moe_utils and friends) against plain
references, single process, fp32: permutation round trips, padding, gating in the router dtype, the
balancing losses with padding masks, the expert-bias step, random routing for benchmarks, the router
counts reset between steps, and the quantile-balancing dual update."""
import pytest
import torch

from megatron.core.transformer.moe import moe_utils as mu
from tests.fixtures.tiny_gpt import tiny_config

T, E, H, K = 12, 4, 8, 2


def _routing(seed=0):
    torch.manual_seed(seed)
    return mu.topk_routing_with_score_function(torch.randn(T, E), K)


def test_permute_unpermute_match_per_token_sums():
    probs, routing_map = _routing()
    x = torch.randn(T, H)
    permuted, permuted_probs, sorted_indices, pad_offsets, counts = mu.permute(
        x, routing_map, probs, num_out_tokens=T * K, tokens_per_expert=routing_map.sum(0))
    assert pad_offsets is None and torch.equal(counts, routing_map.sum(0))
    # Expert-major rows, token order within an expert: the reference order written out.
    order = [(e, t) for e in range(E) for t in range(T) if routing_map[t, e]]
    assert sorted_indices.tolist() == [t for _, t in order]
    assert torch.equal(permuted_probs, torch.stack([probs[t, e] for e, t in order]))
    restored = mu.unpermute(permuted * 3.0, sorted_indices, x.shape, probs=probs, routing_map=routing_map)
    ref = torch.stack([sum(3.0 * probs[t, e] * x[t] for e in range(E) if routing_map[t, e]) for t in range(T)])
    torch.testing.assert_close(restored, ref, rtol=1e-6, atol=1e-6)  # fp32 sums in another order
    # Without probs: each token comes back once per expert it visited.
    plain = mu.unpermute(permuted, sorted_indices, x.shape, fused=True)
    torch.testing.assert_close(plain, x * K, rtol=1e-6, atol=1e-6)


def test_drop_and_pad_layout_and_sort_chunks():
    probs, routing_map = _routing(1)
    probs, routing_map = mu.apply_router_token_dropping(probs, routing_map, K, 1.0, pad_to_capacity=True)
    capacity = int(routing_map.sum(0)[0])
    x = torch.randn(T, H)
    permuted, permuted_probs, idx, _, _ = mu.permute(x, routing_map, probs, num_out_tokens=capacity * E,
                                                      drop_and_pad=True)
    assert idx.view(E, capacity).tolist() == [[t for t in range(T) if routing_map[t, e]] for e in range(E)]
    back = mu.unpermute(permuted, idx, x.shape, probs=probs, routing_map=routing_map, drop_and_pad=True)
    ref = mu.unpermute(permuted, idx, x.shape, probs=probs, routing_map=routing_map)
    torch.testing.assert_close(back, ref)
    chunks, chunk_probs = mu.sort_chunks_by_idxs(permuted, torch.tensor([capacity] * E), torch.tensor([2, 0, 3, 1]),
                                                 probs=permuted_probs)
    blocks = permuted.view(E, capacity, H)
    assert torch.equal(chunks, torch.cat([blocks[i] for i in (2, 0, 3, 1)]))
    assert torch.equal(chunk_probs, torch.cat([permuted_probs.view(E, capacity)[i] for i in (2, 0, 3, 1)]))


def test_pad_routing_map_and_counts():
    _, routing_map = _routing(2)
    counts = routing_map.sum(0)
    padded = mu.pad_routing_map(routing_map.clone().int(), 4)
    assert (padded.sum(0) % 4 == 0).all() and (padded.sum(0) - counts < 4).all()
    assert ((padded - routing_map.int()) >= 0).all()  # only additions
    total, local, count = mu.get_tokens_per_expert_and_token_count(routing_map, None)
    assert torch.equal(total, counts) and local == T and count == T
    total, local, count = mu.get_tokens_per_expert_and_token_count(routing_map, None, topk=K, with_padding_mask=True)
    assert float(local) == T and float(count) == T


def test_losses_with_padding_masks():
    torch.manual_seed(3)
    logits = torch.randn(T, E)
    pad = torch.zeros(T, dtype=torch.bool)
    pad[-4:] = True  # the last 4 tokens are padding
    z = mu.z_loss_func(logits, 0.5, padding_mask=pad)
    torch.testing.assert_close(z, mu.z_loss_func(logits[:-4], 0.5))
    routing_map, scores = mu.compute_routing_scores_for_aux_loss(logits, K, "softmax", padding_mask=pad)
    assert not routing_map[-4:].any() and not scores[-4:].any()
    counts = routing_map.sum(0)
    masked = mu.switch_load_balancing_loss_func(torch.softmax(logits, -1), counts, T - 4, K, E, 1.0,
                                                padding_mask=~pad)
    ref = mu.switch_load_balancing_loss_func(torch.softmax(logits[:-4], -1), counts, T - 4, K, E, 1.0, fused=True)
    torch.testing.assert_close(masked, ref)


def test_dense_output_precomputed_indices_and_sqrtsoftplus():
    torch.manual_seed(4)
    logits = torch.randn(T, E)
    probs, idx = mu.topk_routing_with_score_function(logits, K, score_function="sqrtsoftplus", dense_output=True)
    scores = torch.nn.functional.softplus(logits).sqrt()
    ref_vals, ref_idx = scores.topk(K, dim=1)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(probs, ref_vals / ref_vals.sum(-1, keepdim=True))
    forced = torch.tensor([[0, 1]] * T)
    sparse, routing_map = mu.topk_routing_with_score_function(logits, K, precomputed_indices=forced)
    assert routing_map[:, :2].all() and not routing_map[:, 2:].any()
    torch.testing.assert_close(sparse[:, :2], torch.softmax(logits[:, :2], -1))


def test_router_gating_linear_matches_fp64_autograd():
    torch.manual_seed(5)
    x = torch.randn(3, 2, H, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(E, H, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(E, dtype=torch.bfloat16, requires_grad=True)
    out = mu.router_gating_linear(x, w, b, torch.float32)
    assert out.dtype == torch.float32 and out.shape == (3, 2, E)
    g = torch.randn_like(out)
    out.backward(g)
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    (torch.nn.functional.linear(xr, wr, br) * g.double()).sum().backward()
    torch.testing.assert_close(out.double(), torch.nn.functional.linear(xr, wr, br), rtol=1e-5, atol=1e-5)
    for mine, ref in ((x, xr), (w, wr), (b, br)):  # bf16 gradients: 3 significant digits
        assert mine.grad.dtype == torch.bfloat16
        torch.testing.assert_close(mine.grad.double(), ref.grad, rtol=2e-2, atol=2e-2)


def test_expert_bias_step_and_small_helpers():
    counts = torch.tensor([[1.0, 5.0, 3.0, 3.0]])
    bias = mu.get_updated_expert_bias(counts, torch.zeros(1, 4), 0.1)
    assert torch.equal(bias, torch.tensor([[0.1, -0.1, 0.0, 0.0]]))
    t = torch.ones(2)
    assert mu.maybe_move_tensor_to_cpu(t) is t
    config = tiny_config(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=4)
    assert mu.get_align_size_for_quantization(config) == 0 and not mu.skip_routed_expert_padding(config)
    from megatron.core import parallel_state as ps
    pgs = mu.get_default_pg_collection()  # parallel_state's groups (None where not initialized)
    initialized = ps.model_parallel_is_initialized()
    assert pgs.tp is (ps.get_tensor_model_parallel_group() if initialized else None)
    assert pgs.ep is (ps.get_expert_model_parallel_group() if initialized else None)


def test_random_logits_keep_router_gradient_and_bias_is_cached():
    logits = torch.zeros(T, E, requires_grad=True)
    out = mu.apply_random_logits(logits)
    assert out.std() > 0.5
    out.sum().backward()
    assert torch.equal(logits.grad, torch.ones(T, E))  # straight-through
    mu.RandomSTEShared._cache.pop(99, None)
    biased = mu.apply_biased_logits(torch.zeros(T, E), -1.0, layer_number=99)  # std < 0: drawn once ...
    bias = mu.RandomSTEShared._cache[99]
    assert bias.shape == (E,) and torch.equal(mu.RandomSTEShared.apply(torch.zeros(T, E), -1.0, 99),
                                              bias.expand(T, E))  # ... and reused
    assert biased.shape == (T, E)


def test_tracker_names_and_log_string():
    mu.clear_aux_losses_tracker()
    mu.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(0.5), 1, 2)
    mu.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(1.5), 2, 2)
    assert mu.get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].tolist() == [0.5, 1.5]
    totals = {}
    line = mu.track_moe_metrics(1.0, 1, total_loss_dict=totals, track_names=["load_balancing_loss"], num_layers=2)
    assert float(totals["load_balancing_loss"]) == 1.0  # mean over the 2 MoE layers
    assert "moe max load" in line and "load_balancing_loss" not in line


def _moe_config(**kw):
    base = dict(hidden_size=H, num_attention_heads=2, num_moe_experts=E, moe_router_topk=K, add_bias_linear=False,
                moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16)
    base.update(kw)
    return tiny_config(**base)


def test_experts_apply_permuted_probs_like_megatrons_interface():
    """experts(x, counts, probs) == experts(x * 1, counts) rows scaled by probs (linear fc2, no bias)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.spec_utils import build_module
    torch.manual_seed(6)
    x, counts, probs = torch.randn(10, H), torch.tensor([3, 0, 5, 2]), torch.rand(10)
    for grouped in (False, True):
        experts = build_module(LocalSpecProvider().grouped_mlp_modules(grouped), E, _moe_config(), name="experts")
        plain, _ = experts(x, counts)
        scaled, _ = experts(x, counts, probs)
        torch.testing.assert_close(scaled, plain * probs.unsqueeze(-1), rtol=1e-5, atol=1e-6)  # fp32 reordering


def test_moe_spec_for_backend_shared_gate_and_forced_balancing():
    from megatron.core.models.backends import LocalSpecProvider, get_backend
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec, get_moe_module_spec_for_backend
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.spec_utils import build_module
    torch.manual_seed(7)
    config = _moe_config(moe_shared_expert_gate=True, moe_grouped_gemm=True)
    layer = build_module(get_moe_module_spec_for_backend(get_backend("transformer_engine"), E, True), config=config,
                         layer_number=1)
    assert isinstance(layer.experts, TEGroupedMLP) and layer.shared_experts.gate_weight.shape == (1, H)
    x = torch.randn(4, 2, H)
    shared = layer.shared_experts
    ungated = super(type(shared), shared).forward(x)[0]
    gate = torch.sigmoid(x @ shared.gate_weight.t())
    torch.testing.assert_close(shared(x), ungated * gate)
    # Random router logits (benchmark aid): every expert gets tokens, gradients still reach the router.
    forced = build_module(get_moe_module_spec(True, E, False), config=_moe_config(moe_router_force_load_balancing=True),
                          layer_number=1)
    out, _ = forced(torch.randn(64, 2, H))
    out.sum().backward()
    assert forced.router.weight.grad is not None
    probs, routing_map = forced.router(torch.randn(64, 2, H))
    assert (routing_map.sum(0) > 0).all()
    assert LocalSpecProvider().layer_norm(rms_norm=True) is LocalSpecProvider().layer_norm()


def test_sqrtsoftplus_router_with_expert_bias():
    from megatron.core.transformer.moe.router import TopKRouter
    torch.manual_seed(8)
    router = TopKRouter(_moe_config(moe_router_score_function="sqrtsoftplus", moe_router_enable_expert_bias=True))
    router.set_layer_number(1)
    x = torch.randn(5, 2, H)
    probs, routing_map = router(x)
    scores = torch.nn.functional.softplus(x.reshape(-1, H) @ router.weight.t()).sqrt()
    top = scores.topk(K, dim=1)
    ref = torch.zeros_like(scores).scatter(1, top.indices, top.values / top.values.sum(-1, keepdim=True))
    torch.testing.assert_close(probs, ref)
    assert torch.equal(routing_map, ref > 0)


def test_reset_model_temporary_tensors_clears_router_counts():
    from megatron.core.distributed.finalize_model_grads import reset_model_temporary_tensors
    from megatron.core.transformer.moe.router import TopKRouter
    cfg = tiny_config(num_layers=1, hidden_size=8, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                      moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                      moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.01,
                      use_cpu_initialization=True)
    router = TopKRouter(cfg)
    router.set_layer_number(1)
    router(torch.randn(5, 1, 8))
    assert router.local_tokens_per_expert.sum() == 10 and router.ga_steps == 1  # 5 tokens x top-2
    reset_model_temporary_tensors(cfg, [router])
    assert router.local_tokens_per_expert.sum() == 0 and router.global_tokens_per_expert.sum() == 0
    assert router.ga_steps == 0


def test_qb_dual_update_against_per_column_quantiles():
    """Indices: each token's k best biased scores (by sorting); new bias: per expert, the (target+1)-th
    largest of scores - alpha over tokens (alpha: each token's (k+1)-th best biased score)."""
    from megatron.core.transformer.moe.moe_utils import qb_dual_update
    m, n, k = 12, 4, 2
    g = torch.Generator().manual_seed(3)
    scores, beta = torch.randn(m, n, generator=g), torch.randn(n, generator=g) * 0.1
    indices, new_beta = qb_dual_update(scores, k, beta)
    biased = (scores - beta).tolist()
    alpha = []
    for t in range(m):
        order = sorted(range(n), key=lambda j: -biased[t][j])
        assert indices[t].tolist() == order[:k]
        alpha.append(biased[t][order[k]])
    target = m * k // n  # tokens per expert
    expected = [sorted((float(scores[t, j]) - alpha[t] for t in range(m)), reverse=True)[target] for j in range(n)]
    torch.testing.assert_close(new_beta, torch.tensor(expected))
    same_indices, unchanged = qb_dual_update(scores, k, beta, update_beta=False)
    assert torch.equal(same_indices, indices) and unchanged is beta
    with pytest.raises(ValueError, match="do not split evenly"):
        qb_dual_update(scores[:11], k, beta)
