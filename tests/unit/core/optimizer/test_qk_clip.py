"""QK-clip's step equals a float64 reference of Megatron's formula (per query group, eta = threshold / max logit,
queries x eta^alpha, keys x eta^(1-alpha)), on the weight and on fp32 main copies (whole or a flat shard);
after a clip the recomputed max logit of a clipped group is the threshold; clip_qk resets the records."""
import pytest
import torch

from megatron.core.optimizer.qk_clip import clip_qk
from megatron.core.transformer.attention import _scale_rows_of_range
from tests.fixtures.tiny_gpt import short_batch, short_gpt, single_rank, tiny_config

THRESHOLD, ALPHA = 2.0, 0.3


def _model(**overrides):
    cfg = tiny_config(num_query_groups=2, qk_clip=True, qk_clip_threshold=THRESHOLD, qk_clip_alpha=ALPHA,
                      use_cpu_initialization=True, **overrides)
    return short_gpt(cfg, position_embedding_type="rope")


def _reference(weight, max_logits, ng, hn, gated=False):
    """Megatron's _clip_linear_qkv in float64 on the [ng, rows per group, hidden] view."""
    w = weight.double().clone().view(ng, -1, weight.shape[1])
    per_group = max_logits.numel() // ng
    grouped = max_logits.double().view(ng, per_group).amax(dim=1)
    eta = torch.where(grouped > THRESHOLD, THRESHOLD / grouped, torch.ones_like(grouped))[:, None, None]
    q_rows = per_group * hn
    k0 = q_rows * (2 if gated else 1)
    w[:, :q_rows] *= eta ** ALPHA
    w[:, k0:k0 + hn] *= eta ** (1 - ALPHA)
    return w.view_as(weight)


@pytest.mark.parametrize("gated", [False, True])
def test_clip_equals_float64_reference_on_weight_and_main_copies(gated):
    model = _model(attention_output_gate=gated)
    attn = model.decoder.layers[0].self_attention
    weight = attn.linear_qkv.weight
    before = weight.detach().clone()
    maxima = torch.tensor([1.0, 5.0, -3.0, 1.5])  # group 0 exceeds (5 > 2), group 1 does not
    attn.core_attention.current_max_attn_logits = maxima.clone()
    whole = before.clone()  # a whole fp32 main copy
    start, end = 37, 37 + 3 * weight.shape[1] + 11  # a distributed optimizer's shard: partial rows both ends
    shard = before.view(-1)[start:end].clone()
    attn.clip_qk([(whole, 0, weight.numel()), (shard, start, end)])
    want = _reference(before, maxima, attn.ng, attn.hn, gated).float()
    torch.testing.assert_close(weight.detach(), want, rtol=1e-6, atol=0)
    torch.testing.assert_close(whole, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(shard, want.view(-1)[start:end], rtol=1e-6, atol=0)
    assert not torch.equal(want, before.float())
    assert attn.core_attention.current_max_attn_logits is None


def test_scale_rows_of_range_every_split():
    rows, cols = 5, 4
    scale = torch.arange(1.0, rows + 1)
    full = torch.ones(rows, cols)
    for start in range(rows * cols):
        for end in range(start, rows * cols + 1):
            flat = torch.ones(end - start)
            _scale_rows_of_range(flat, start, cols, scale)
            torch.testing.assert_close(flat, (full * scale[:, None]).view(-1)[start:end])


def _max_logits(model, tokens, pos):
    model.train()
    with torch.no_grad():
        model(tokens, pos, None)
    return [layer.self_attention.core_attention.current_max_attn_logits.clone() for layer in model.decoder.layers]


def test_after_clip_the_clipped_group_max_is_the_threshold():
    """Without biases and QK-norm a head's logits scale by eta exactly (RoPE is linear), so the first layer's
    clipped group lands on the threshold and its unclipped group keeps its logits (later layers see inputs the
    first layer's clip changed)."""
    single_rank()
    model = _model(add_bias_linear=False)
    tokens, pos = short_batch()
    before = _max_logits(model, tokens, pos)
    groups = before[0].view(2, 2).amax(dim=1)
    threshold = float(groups.mean())  # between the two groups' maxima: exactly one group is clipped
    model.config.qk_clip_threshold = threshold
    logged = clip_qk([model])
    assert logged == pytest.approx(max(float(m.max()) for m in before), rel=1e-6)
    for layer in model.decoder.layers:
        assert layer.self_attention.core_attention.current_max_attn_logits is None
    after = _max_logits(model, tokens, pos)[0].view(2, 2).amax(dim=1)
    for g in range(2):
        want = threshold if groups[g] > threshold else float(groups[g])
        assert float(after[g]) == pytest.approx(want, rel=1e-5)
    assert float(after.max()) == pytest.approx(threshold, rel=1e-5)


def test_log_only_resets_without_touching_weights():
    single_rank()
    cfg = tiny_config(num_query_groups=2, log_max_attention_logit=True, use_cpu_initialization=True)
    model = short_gpt(cfg)
    tokens, pos = short_batch()
    maxima = _max_logits(model, tokens, pos)
    weights = [p.detach().clone() for p in model.parameters()]
    assert clip_qk([model], log_max_only=True) == pytest.approx(max(0.0, max(float(m.max()) for m in maxima)))
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    assert all(layer.self_attention.core_attention.current_max_attn_logits is None for layer in model.decoder.layers)
    with pytest.raises(ValueError, match="--qk-clip"):
        model.decoder.layers[0].self_attention.clip_qk()


@pytest.mark.parametrize("field,value,needle", [("qk_clip_alpha", 1.0, "qk-clip-alpha"),
                                                ("qk_clip_threshold", 0.0, "qk-clip-threshold")])
def test_config_ranges(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        tiny_config(qk_clip=True, **{field: value})
