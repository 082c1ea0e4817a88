"""FLOPs formula (COMPAT.md 3.4) against hand-computed values."""
from types import SimpleNamespace

import pytest

from megatron.training.flops import num_floating_point_operations, throughput_tflops_per_gpu


def _args(**kw):
    base = dict(hidden_size=64, num_layers=4, seq_length=64, num_attention_heads=4, kv_channels=None,
                group_query_attention=False, num_query_groups=1, ffn_hidden_size=None, swiglu=False,
                padded_vocab_size=512, vocab_size=512)
    base.update(kw)
    return SimpleNamespace(**base)


def test_classic_gpt_closed_form():
    # MHA, f = 4h, GeLU: 72 * B * s * L * h^2 * (1 + s/(12h) + V/(12 h L)).
    B, s, L, h, V = 8, 64, 4, 64, 512
    expected = 72 * B * s * L * h * h * (1 + s / (12 * h) + V / (12 * h * L))
    assert num_floating_point_operations(_args(), B) == pytest.approx(expected, rel=1e-12)


def test_gpt2_small_by_hand():
    # 125M-class: h=768, L=12, s=1024, V=50304, B=1.
    B, s, L, h, V = 1, 1024, 12, 768, 50304
    per_token = 6 * h * 4 * h * 2 * L + 6 * L * (h * 3 * h + h * h) + 6 * h * V
    expected = B * s * per_token + B * s * s * 6 * h * L
    got = num_floating_point_operations(_args(hidden_size=h, num_layers=L, seq_length=s, num_attention_heads=12,
                                              padded_vocab_size=V), B)
    assert got == expected


def test_swiglu_and_gqa():
    h, L, s, V, heads, groups, f = 64, 2, 16, 128, 8, 2, 176
    d_q, d_kv = 8 * heads, 8 * groups
    per_token = 6 * h * f * 3 * L + 6 * L * (h * (d_q + 2 * d_kv) + d_q * h) + 6 * h * V
    expected = 2 * s * per_token + 2 * s * s * 6 * d_q * L
    args = _args(hidden_size=h, num_layers=L, seq_length=s, num_attention_heads=heads, swiglu=True,
                 ffn_hidden_size=f, group_query_attention=True, num_query_groups=groups, padded_vocab_size=V)
    assert num_floating_point_operations(args, 2) == expected


def test_throughput_units():
    args = _args()
    flops = num_floating_point_operations(args, 8)
    assert throughput_tflops_per_gpu(args, 8, 0.5, 2) == pytest.approx(flops / (0.5 * 1e12 * 2))
