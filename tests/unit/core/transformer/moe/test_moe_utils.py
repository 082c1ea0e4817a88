"""Routing functions: top-k routing, capacity dropping and the token-major permutation against per-token
references (fp32); the routing and balancing-score functions trace into one graph each under torch.compile (no
graph break, checked on CPU with dynamo's aot_eager backend: --torch-compile compiles them inside the layer) and
give the eager results; --moe-router-fusion reaches the router and, on CPU, the eager functions run."""
import pytest
import torch

from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping, topk_routing_with_score_function


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
    assert route.state["fn"] is moe_utils._fused_topk_routing  # the kernels' wrapper, eager on CPU


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


@pytest.mark.parametrize("scaled", [True, False])
@pytest.mark.parametrize("k", [1, 2, 6])
def test_token_major_permutation_equals_scatter_path(k, scaled):
    """The exact-top-k permutation (gather backward, token-major k-way sum) equals the index_add path in
    forward and in the gradients of the tokens and the probs (fp32: only summation order differs), with the probs
    applied at the unpermutation or not (the MoE layer's way: the experts applied them)."""
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
        if not scaled:
            y = y * pprobs[:, None]
        out = _unpermute(y, idx, (T, h), probs=pprobs if scaled else None, topk=topk)
        out.backward(torch.randn(T, h, generator=torch.Generator().manual_seed(2)))
        results.append((out.detach(), x.grad, probs.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes", [[3, 0, 5, 2, 1, 4], [0, 0, 0, 0], [7], [1, 2, 3, 4, 5, 6, 0, 8, 9, 1, 1, 2]])
def test_chunk_sort_gather_equals_split_and_cat(sizes):
    """The dispatcher's expert-major regroup as one gather: the same rows as _sort_chunks' split + cat, its
    inverse restores the input, and the backward hands each row its own gradient (a gather, not a scatter)."""
    from megatron.core.transformer.moe.moe_utils import _PermuteRows, _sort_chunks, chunk_sort_indices

    gen = torch.Generator().manual_seed(len(sizes))
    order = torch.randperm(len(sizes), generator=gen).tolist()
    total = sum(sizes)
    x = torch.randn(total, 3, generator=gen, requires_grad=True)
    gather, inverse = chunk_sort_indices(torch.tensor(sizes), torch.tensor(order), total)
    y = _PermuteRows.apply(x, gather, inverse)
    assert torch.equal(y, _sort_chunks(x.detach(), sizes, order))
    assert torch.equal(y.detach().index_select(0, inverse), x.detach())
    weights = torch.randn(total, 3, generator=gen)
    (y * weights).sum().backward()
    assert torch.equal(x.grad, weights.index_select(0, inverse))


def test_static_chunk_gather_is_made_once_per_shape():
    """Padded to capacity the regroup's indices depend only on the split sizes: made once (in the warm-up
    steps) and reused, so a captured step replays tensors that exist and allocates nothing on the host path."""
    from megatron.core.transformer.moe.moe_utils import _sort_chunks
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    d = object.__new__(MoEAlltoAllTokenDispatcher)
    El, ep = 3, 2
    d.num_local_experts, d.ep_size, d.etp_size, d.ep_rank, d.num_experts = El, ep, 1, 1, El * ep
    d.chunk_sizes = [4] * (El * ep)
    d.sorted_idxs = [j * El + l for l in range(El) for j in range(ep)]
    first = d._chunk_gather(None, torch.device("cpu"))
    again = d._chunk_gather(None, torch.device("cpu"))
    assert first[0] is again[0] and first[1] is again[1]
    x = torch.arange(sum(d.chunk_sizes), dtype=torch.float32).unsqueeze(1)
    assert torch.equal(x.index_select(0, first[0]), _sort_chunks(x, d.chunk_sizes, d.sorted_idxs))
    # From exchanged counts [etp, ep, E]: this rank's (m = 1) columns, chunks [j][l].
    counts = torch.arange(ep * El * ep, dtype=torch.int64)
    d.chunk_sizes = counts.view(1, ep, El * ep)[:, :, El:].reshape(-1).tolist()
    gather, inverse = d._chunk_gather(counts, torch.device("cpu"))
    y = torch.arange(sum(d.chunk_sizes), dtype=torch.float32).unsqueeze(1)
    assert torch.equal(y.index_select(0, gather), _sort_chunks(y, d.chunk_sizes, d.sorted_idxs))
    assert torch.equal(y.index_select(0, gather).index_select(0, inverse), y)


def test_token_major_order_is_sorted_once_per_micro_batch(monkeypatch):
    """`_permute` leaves the rows' token-major order on its sorted_indices and `_unpermute` reuses it."""
    calls = []
    order_fn = moe_utils._token_major_order
    monkeypatch.setattr(moe_utils, "_token_major_order", lambda *a: calls.append(1) or order_fn(*a))
    x = torch.randn(10, 4, requires_grad=True)
    routing_map = torch.zeros(10, 6, dtype=torch.bool).scatter_(1, torch.rand(10, 6).topk(2).indices, True)
    rows, _, sorted_indices = moe_utils._permute(x, routing_map, num_out_tokens=20, topk=2)
    out = moe_utils._unpermute(rows, sorted_indices, x.shape, topk=2)
    torch.testing.assert_close(out, 2 * x)
    assert len(calls) == 1


def test_deterministic_mode_fixes_the_timed_choice(monkeypatch):
    """--deterministic-mode: the experts' weight gradients take one fixed way, where a timing could pick either
    (their roundings differ), so two runs stay bitwise equal. (The call is made with CPU tensors: the mode is
    checked before anything CUDA.)"""
    from megatron.core.fusions import grouped_wgrad
    rows = torch.randn(6, 4)
    monkeypatch.setattr(grouped_wgrad, "_CHOICE", {})
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert grouped_wgrad._choose(torch.zeros(2, 3, 4), rows, rows, torch.tensor([6, 6])) == ("grouped_mm", None)
    finally:
        torch.use_deterministic_algorithms(was)
    assert not grouped_wgrad._CHOICE
