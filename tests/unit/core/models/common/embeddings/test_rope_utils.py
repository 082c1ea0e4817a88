"""RoPE against the textbook rotation: relative positions, the interleaved layout, the eager
half-by-half path, and the flag that selects the fused kernel."""
import torch

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

S, B = 6, 2


def test_rope_relative_and_interleaved():
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)
    freqs = rope(S)  # [s, 1, 1, 8]
    q = torch.randn(1, 1, 1, 8).expand(S, 1, 1, 8)
    rq = apply_rotary_pos_emb(q, freqs)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    # <R_i q, R_j q> depends only on i - j.
    dots = torch.einsum("sd,td->st", rq[:, 0, 0], rq[:, 0, 0])
    torch.testing.assert_close(dots[1, 0], dots[4, 3], rtol=1e-5, atol=1e-5)
    # Interleaved layout is the same rotation on a permuted channel order.
    perm = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])
    rope_i = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, rotary_interleaved=True)
    ri = apply_rotary_pos_emb(q[..., perm], rope_i(S), rotary_interleaved=True)
    torch.testing.assert_close(ri, rq[..., perm], rtol=1e-5, atol=1e-6)
    # rotary_percent: the last half of the channels passes through untouched.
    half = apply_rotary_pos_emb(q, RotaryEmbedding(8, 0.5)(S))
    torch.testing.assert_close(half[..., 4:], q[..., 4:])


def test_rope_half_by_half_equals_textbook_form():
    """The eager path (--no-rope-fusion) rotates half by half; it must equal t*cos + rotate_half(t)*sin,
    values and gradients, also for a strided view (q out of a fused QKV), partial rotary and cos/sin whose
    halves differ."""
    from megatron.core.models.common.embeddings import rope_utils
    g = torch.Generator().manual_seed(0)
    for rot in (16, 12):
        qkv = torch.randn(5, 2, 3, 48, dtype=torch.float64, generator=g, requires_grad=True)
        q = qkv[..., :16]  # strided view
        freqs = torch.randn(5, 1, 1, rot, dtype=torch.float64, generator=g)
        ref = rope_utils._rope(q, freqs, 0.7, False)
        out = rope_utils._rope_eager(q, freqs, 0.7, False)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        grad = torch.randn(ref.shape, dtype=torch.float64, generator=g)
        (g_ref,), (g_out,) = (torch.autograd.grad(y, qkv, grad) for y in (ref, out))
        torch.testing.assert_close(g_out, g_ref, rtol=1e-12, atol=1e-12)


def test_rope_fusion_flag_selects_the_fused_kernel(monkeypatch):
    """Megatron's default (rope fusion on) reaches the config and picks the compiled RoPE (eager on CPU,
    so equal here); --no-rope-fusion picks the eager one."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.training.arguments import core_transformer_config_from_args
    from tests.unit.training.arguments.test_arguments import _args
    on = core_transformer_config_from_args(_args(""))
    off = core_transformer_config_from_args(_args("--no-rope-fusion"))
    assert on.apply_rope_fusion and not off.apply_rope_fusion
    calls = []
    monkeypatch.setattr(rope_utils, "_rope_fused", lambda *a: calls.append(1) or rope_utils._rope(*a))
    t, freqs = torch.randn(8, 2, 4, 16), torch.randn(8, 1, 1, 12)
    torch.testing.assert_close(rope_utils.apply_rotary_pos_emb(t, freqs, config=on),
                               rope_utils.apply_rotary_pos_emb(t, freqs, config=off))
    assert calls == [1]


def test_cos_sin_kept_for_the_same_freqs_only():
    """Every layer rotates q and k with the model's one freqs tensor: its cos and sin are computed once and
    kept, with the same values as computing them afresh; a different freqs object, an in-place change of the
    same one, another length, dtype or scale computes them again."""
    from megatron.core.models.common.embeddings import rope_utils
    freqs = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(S)
    q, k = torch.randn(S, B, 2, 8), torch.randn(S, B, 1, 8)
    fresh = lambda t, f, m=1.0: rope_utils._rope_eager(t, f[: t.shape[0]], m, False)  # noqa: E731
    rope_utils._COS_SIN.clear()
    assert torch.equal(apply_rotary_pos_emb(q, freqs), fresh(q, freqs))
    kept = rope_utils._COS_SIN["last"]
    assert torch.equal(apply_rotary_pos_emb(k, freqs), fresh(k, freqs))
    assert rope_utils._COS_SIN["last"] is kept  # reused, not recomputed
    assert torch.equal(apply_rotary_pos_emb(q[:4], freqs), fresh(q[:4], freqs))  # another length
    assert rope_utils._COS_SIN["last"] is not kept
    kept = rope_utils._COS_SIN["last"]
    freqs.mul_(2.0)  # in place: the version moves on
    assert torch.equal(apply_rotary_pos_emb(q[:4], freqs), fresh(q[:4], freqs))
    assert rope_utils._COS_SIN["last"] is not kept
    other = freqs.clone()  # equal values, another object
    kept = rope_utils._COS_SIN["last"]
    apply_rotary_pos_emb(q[:4], other)
    assert rope_utils._COS_SIN["last"] is not kept
    assert torch.equal(apply_rotary_pos_emb(q[:4], other, mscale=0.5), fresh(q[:4], other, 0.5))
    assert torch.equal(apply_rotary_pos_emb(q[:4].double(), other), fresh(q[:4].double(), other))
    grad_freqs = other.clone().requires_grad_()  # a freqs that needs a gradient is never kept
    kept = rope_utils._COS_SIN["last"]
    apply_rotary_pos_emb(q[:4], grad_freqs)
    assert rope_utils._COS_SIN["last"] is kept
    del other, grad_freqs, freqs
    assert rope_utils._COS_SIN["last"][0]() is None  # held weakly: a freed freqs never matches


def test_cos_sin_not_kept_for_inference_tensors():
    """A freqs made under torch.inference_mode has no version counter: computed afresh every call."""
    from megatron.core.models.common.embeddings import rope_utils
    rope_utils._COS_SIN.clear()
    with torch.inference_mode():
        freqs = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(S)
        q = torch.randn(S, B, 2, 8)
        assert torch.equal(apply_rotary_pos_emb(q, freqs), rope_utils._rope_eager(q, freqs, 1.0, False))
    assert "last" not in rope_utils._COS_SIN
