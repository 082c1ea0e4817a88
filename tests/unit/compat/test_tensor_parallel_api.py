"""Megatron's tensor-parallel names against plain references, one process: recompute without output,
the frozen-weight linear, the vocab-parallel cross-entropy steps (composed as Megatron's fused cross
entropy composes them, and over two vocab halves written out), the RNG tracker helpers and T5's mask and
position helpers."""

import pytest
import torch
import torch.nn.functional as F


def test_checkpoint_without_output_matches_plain_backward():
    """Recomputed dropout output (same RNG states) gives the plain graph's gradients exactly; the
    output's storage is freed until the recompute hook runs."""
    from megatron.core.tensor_parallel import CheckpointWithoutOutput
    from megatron.core.tensor_parallel.random import is_checkpointing
    seen = []

    def f(a, w):
        seen.append(is_checkpointing())
        return F.dropout(torch.tanh(a @ w), 0.3)

    def tail(y):
        return (y * y).sum(-1, keepdim=True) * y  # saves y for its backward

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    torch.manual_seed(1)
    ref = torch.autograd.grad(tail(f(x, w)).sum(), (x, w))
    torch.manual_seed(1)
    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(f, x, w)
    z = tail(y)
    ckpt.discard_output_and_register_recompute(z)
    assert y.untyped_storage().size() == 0
    torch.manual_seed(7)  # the recompute must not depend on the RNG state at backward time
    got = torch.autograd.grad(z.sum(), (x, w))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # same ops, same masks: bitwise equal
    assert seen == [False, True, True] and not is_checkpointing()


def test_frozen_weight_linear_and_cross_entropy_steps():
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as S
    from megatron.core.tensor_parallel.layers import linear_with_frozen_weight
    x, w, b = torch.randn(3, 2, 5, requires_grad=True), torch.randn(7, 5, requires_grad=True), torch.randn(7)
    y = linear_with_frozen_weight(x, w, b, False, False, False, None)
    torch.testing.assert_close(y, F.linear(x, w, b))
    y.sum().backward()
    assert w.grad is None
    torch.testing.assert_close(x.grad, torch.ones(3, 2, 7) @ w.detach())
    # Megatron's step functions composed as its fused cross entropy composes them (one rank).
    z, t = torch.randn(4, 11), torch.randint(0, 11, (4,))
    logits, mx = S.calculate_logits_max(z)
    mask, mt1d, pred, sum_exp, exp = S.calculate_predicted_logits(logits, t, mx, 0, 11)
    softmax, loss = S.calculate_cross_entropy_loss(exp, pred, sum_exp)
    torch.testing.assert_close(loss, F.cross_entropy(z, t, reduction="none"))
    g2d, ar, upd, gin = S.prepare_gradient_calculation_operands(softmax, mask)
    grad = S.calculate_gradients(g2d, ar, mt1d, upd, gin, torch.ones(4))
    zz = z.clone().requires_grad_()
    F.cross_entropy(zz, t, reduction="sum").backward()
    torch.testing.assert_close(grad, zz.grad)


def test_rng_tracker_and_t5_helpers():
    from megatron.core.models.T5.t5_model import t5_extended_attention_mask, t5_position_ids
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, initialize_rng_tracker
    tracker = get_cuda_rng_tracker()
    states = tracker.get_states()
    try:
        tracker.add("api-test-rng", 1234)
        initialize_rng_tracker()  # initialized: left alone, as in Megatron
        assert "api-test-rng" in tracker.get_states()
        initialize_rng_tracker(force_reset=True)
        assert not tracker.is_initialized()
        with pytest.raises(NotImplementedError, match="use_te_rng_tracker"):
            initialize_rng_tracker(use_te_rng_tracker=True)
    finally:
        tracker.reset()
        tracker.set_states(states)
    ids = torch.zeros(2, 5, dtype=torch.long)
    assert torch.equal(t5_position_ids(ids), torch.arange(5).expand(2, 5))
    m = torch.ones(2, 5, 5, dtype=torch.bool)
    out = t5_extended_attention_mask([m, None])
    assert out[0].shape == (2, 1, 5, 5) and out[1] is None


def test_get_all_rng_states_is_the_trackers():
    from megatron.core.tensor_parallel.random import get_all_rng_states, get_cuda_rng_tracker
    assert get_all_rng_states() is get_cuda_rng_tracker().states_


def test_fused_cross_entropy_blocks_assemble_vocab_parallel_loss():
    """Two vocab halves (TP=2 written out: the all-reduces are a max and a sum over the halves) give
    F.cross_entropy's loss (fp32, 1e-6) and its gradient (returned in bf16: 1e-2)."""
    from megatron.core.fusions import fused_cross_entropy as fce
    torch.manual_seed(0)
    logits, target = torch.randn(5, 3, 11), torch.randint(0, 11, (5, 3))
    ranges = [(0, 6), (6, 11)]
    shards = [fce.calculate_logits_max(logits[..., a:b].clone()) for a, b in ranges]
    logits_max = torch.maximum(shards[0][1], shards[1][1])
    parts = [fce.calculate_predicted_logits(z, target, logits_max, a, b) for (z, _), (a, b) in zip(shards, ranges)]
    reduced = parts[0][2] + parts[1][2]
    results = [fce.calculate_cross_entropy_loss(p[3], reduced.clone()) for p in parts]
    ref = F.cross_entropy(logits.view(-1, 11), target.view(-1), reduction="none").view(5, 3)
    torch.testing.assert_close(results[0][1], ref, rtol=1e-6, atol=1e-6)
    grad_out = torch.rand(5, 3)
    x = logits.clone().requires_grad_()
    (F.cross_entropy(x.view(-1, 11), target.view(-1), reduction="none").view(5, 3) * grad_out).sum().backward()
    grads = torch.cat([fce.calculate_gradients(r[0], grad_out, p[0], p[1]) for r, p in zip(results, parts)], -1)
    assert grads.dtype == torch.bfloat16
    torch.testing.assert_close(grads.float(), x.grad, rtol=1e-2, atol=1e-2)
