"""FLOPs formula (COMPAT.md 3.4) against hand-computed values, MoE and MTP included; the throughput line
(tokens/s, MFU) and the bf16 peak table it uses."""
from types import SimpleNamespace

import pytest

from megatron.training import flops
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


def test_moe_flops_count_active_experts_and_mtp_depth():
    from types import SimpleNamespace

    from megatron.training.flops import num_floating_point_operations
    base = dict(hidden_size=32, num_layers=3, seq_length=16, num_attention_heads=4, kv_channels=8,
                group_query_attention=False, num_query_groups=4, ffn_hidden_size=64, swiglu=True,
                padded_vocab_size=128, vocab_size=128, mtp_num_layers=1, multi_latent_attention=False)
    dense = num_floating_point_operations(SimpleNamespace(**base, num_experts=None), 2)
    moe = num_floating_point_operations(SimpleNamespace(**base, num_experts=8, moe_layer_freq=[0, 1, 1],
                                                        moe_ffn_hidden_size=16, moe_router_topk=2,
                                                        moe_shared_expert_intermediate_size=16), 2)
    # 1 dense layer keeps 64; 2 MoE layers + the MTP depth (the last layer is MoE) run 2 x 16 + 16 = 48.
    assert moe - dense == 2 * 16 * 6 * 32 * 3 * (64 + 3 * 48 - 4 * 64)


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


def test_throughput_line_h100():
    line = flops.format_throughput_line(8192, 0.2, 1, 494.5, "NVIDIA H100 80GB HBM3")
    assert line == (" throughput: tokens/s: 40960 | tokens/s/GPU: 40960 | "
                    "MFU: 50.0% (peak 989 TFLOP/s, NVIDIA H100 80GB HBM3) |")


def test_throughput_line_cpu_has_no_mfu():
    line = flops.format_throughput_line(1000, 0.5, 4, 0.01, "cpu")
    assert line == " throughput: tokens/s: 2000 | tokens/s/GPU: 500 | MFU: n/a (no bf16 peak known for cpu) |"


def test_peak_table_moved_to_flops():
    assert flops.dense_bf16_peak("NVIDIA H200") == 989.0
    assert flops.dense_bf16_peak("NVIDIA H100 PCIe") == 756.0
    assert flops.dense_bf16_peak("cpu") is None


def test_hybrid_formula_counts_each_layer_kind():
    """Megatron's hybrid formula, each layer kind's forward FLOPs worked out by hand (Nemotron-H-like
    numbers), times 3 for forward, wgrad and dgrad."""
    from types import SimpleNamespace
    args = SimpleNamespace(
        is_hybrid_model=True, hybrid_layer_pattern="M-M*|GE", hidden_size=4096, seq_length=8192,
        num_attention_heads=32, num_query_groups=8, group_query_attention=True, kv_channels=128,
        ffn_hidden_size=21504, swiglu=False, moe_ffn_hidden_size=1024, moe_router_topk=2,
        moe_shared_expert_intermediate_size=512, mamba_state_dim=128, mamba_head_dim=64, mamba_num_groups=8,
        mamba_num_heads=128, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_conv_kernel_dim=4, padded_vocab_size=131072, vocab_size=None)
    h, s, t = 4096, 8192, 2 * 8192
    attention = 4 * t * h * (h + h * 8 / 32) + 2 * (2 * s * s) * h
    mlp = 4 * t * h * 21504
    moe = 4 * t * h * (1024 * 2 + 512)
    mamba = 2 * t * h * (2 * 2 * h + 2 * 8 * 128 + 128) + 7 * t * 2 * h * 128 + 2 * t * 2 * h * h
    qk, v = 128 * 16, 128 * 32
    gdn = 2 * t * (h * (2 * qk + 2 * v + 64) + 4 * (2 * qk + v) + 32 * 128 ** 2 * 4 + h * v)
    logits = 2 * t * h * 131072
    expected = 3 * (2 * mamba + mlp + attention + gdn + moe + logits)
    assert num_floating_point_operations(args, 2) == pytest.approx(expected, rel=1e-12)


def test_hybrid_formula_counts_mtp_depths():
    """With MTP depths ('/' in the pattern) the depths' layers count like the main ones and the output head
    runs once per prediction depth, as in Megatron's hybrid formula."""
    from types import SimpleNamespace
    common = dict(is_hybrid_model=True, hidden_size=256, seq_length=128, num_attention_heads=4, num_query_groups=4,
                  group_query_attention=False, kv_channels=64, ffn_hidden_size=512, swiglu=False,
                  moe_ffn_hidden_size=None, moe_router_topk=1, moe_shared_expert_intermediate_size=None,
                  mamba_state_dim=16, mamba_head_dim=32, mamba_num_groups=2, mamba_num_heads=16,
                  linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_conv_kernel_dim=4, padded_vocab_size=1024, vocab_size=None)
    plain = num_floating_point_operations(SimpleNamespace(hybrid_layer_pattern="M*-M*-", mtp_num_layers=None,
                                                          **common), 1)
    main = num_floating_point_operations(SimpleNamespace(hybrid_layer_pattern="M*-", mtp_num_layers=None, **common), 1)
    with_mtp = num_floating_point_operations(SimpleNamespace(hybrid_layer_pattern="M*-/M*-", mtp_num_layers=1,
                                                             **common), 1)
    logits = 3 * 2 * 128 * 256 * 1024
    assert with_mtp == pytest.approx(plain + logits, rel=1e-12)  # the depth's layers plus one more head pass
    assert with_mtp > main


def test_gpt_with_gated_delta_net_layers_counts_like_the_hybrid_stack():
    """--experimental-attention-variant gated_delta_net: the linear layers count Megatron's Gated DeltaNet term
    instead of softmax attention; a GPT model [GDN + MLP, attention + MLP] x 2 counts what the hybrid stack
    'G-*-G-*-' (the same layers, each split in two) does."""
    common = dict(hidden_size=256, seq_length=128, num_attention_heads=4, num_query_groups=2,
                  group_query_attention=True, kv_channels=64, ffn_hidden_size=512, swiglu=True,
                  linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_conv_kernel_dim=4, padded_vocab_size=1024, vocab_size=None, mamba_state_dim=16,
                  mamba_head_dim=32, mamba_num_groups=2, mamba_num_heads=16)
    gpt = SimpleNamespace(num_layers=4, experimental_attention_variant="gated_delta_net", linear_attention_freq=2,
                          **common)
    hybrid = SimpleNamespace(is_hybrid_model=True, hybrid_layer_pattern="G-*-G-*-", num_layers=8,
                             mtp_num_layers=None, **common)
    assert num_floating_point_operations(gpt, 3) == pytest.approx(num_floating_point_operations(hybrid, 3), rel=1e-12)
    plain = SimpleNamespace(num_layers=4, **common)
    assert num_floating_point_operations(gpt, 3) < num_floating_point_operations(plain, 3)


def test_latent_moe_counts_the_experts_at_the_latent_width_and_the_projections():
    """--moe-latent-size l (Megatron's term): the routed experts' GEMMs are l wide instead of h, and each MoE layer
    adds its down and up projections, 2 h l per token (x 6: forward and both backward GEMMs)."""
    common = dict(num_layers=2, num_experts=4, moe_layer_freq=1, moe_ffn_hidden_size=48, moe_router_topk=2,
                  moe_shared_expert_intermediate_size=None, mtp_num_layers=None)
    plain = num_floating_point_operations(_args(**common), 1)
    latent = num_floating_point_operations(_args(moe_latent_size=16, **common), 1)
    h, s, layers, routed = 64, 64, 2, 48 * 2
    expected = plain - 6 * s * layers * h * 2 * routed * (1 - 16 / h) + 6 * s * layers * 2 * h * 16
    assert latent == pytest.approx(expected, rel=1e-12)
