"""FLOPs per global batch with Megatron's dense-GPT formula (COMPAT.md 3.4), for TFLOP/s/GPU and MFU."""
import torch


def gated_mlp(args) -> bool:
    """The MLP's fc1 emits [gate; up] (--swiglu, --quick-geglu): 1.5x the GEMM work of a plain one."""
    return bool(getattr(args, "swiglu", False) or getattr(args, "quick_geglu", False))


def num_floating_point_operations(args, batch_size):
    """Training FLOPs (forward + both backward GEMMs) for `batch_size` samples of `args.seq_length` tokens.

    Per token: 6*h*f*E*L (MLP, E=3 for SwiGLU else 2; MoE layers count the active width, see
    `active_mlp_ffn_sum`) + 6*L*(h*(d_q + 2*d_kv) + d_q*h) (QKV and output projections) + 6*h*V (logits)
    + 6*s*d_q*L for causal core attention (QK^T and AV, halved for the mask). 6 = 3 GEMMs (fwd, wgrad,
    dgrad) x 2 FLOPs per multiply-add. Multi-latent attention replaces the attention terms
    (`mla_flops_per_token`); multi-token prediction adds its depths as layers (of the last decoder layer's
    kind), their norms and eh_proj, and one logits pass each (Megatron's formula).
    Megatron's API: ``args`` may be any namespace with the dense-GPT fields; later features read as off.
    """
    if getattr(args, "is_hybrid_model", False) and getattr(args, "hybrid_layer_pattern", None):
        return hybrid_floating_point_operations(args, batch_size)
    h, s = args.hidden_size, args.seq_length
    mtp = getattr(args, "mtp_num_layers", None) or 0
    L = args.num_layers + mtp  # each MTP depth is one more transformer layer
    heads = args.num_attention_heads
    kv_channels = args.kv_channels if args.kv_channels is not None else h // heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    d_q, d_kv = kv_channels * heads, kv_channels * groups
    ffn = args.ffn_hidden_size if args.ffn_hidden_size is not None else 4 * h
    expansion = 3 if gated_mlp(args) else 2
    vocab = getattr(args, "padded_vocab_size", None) or args.vocab_size
    tokens = batch_size * s
    if getattr(args, "multi_latent_attention", False):
        attention = L * mla_flops_per_token(args)
    else:
        gate = d_q if getattr(args, "attention_output_gate", False) else 0  # linear_qkv also projects the gate
        linear = _linear_attention_layers(args)
        attention = (L - linear) * (6 * (h * (d_q + gate + 2 * d_kv) + d_q * h) + 6 * s * d_q)
        if linear:
            attention += linear * 3 * gated_delta_net_forward_flops(args)
    mlp_width = active_mlp_ffn_sum(args, ffn) + mtp * _last_layer_ffn(args, ffn)
    per_token = (6 * h * expansion * mlp_width
                 + latent_moe_flops_per_token(args)
                 + attention
                 + 6 * mtp * (3 * h + 2 * h * h)  # MTP norms and eh_proj
                 + 6 * h * vocab * (1 + mtp))  # one output head pass per prediction depth
    return tokens * per_token


def hybrid_floating_point_operations(args, batch_size):
    """Megatron's hybrid-model formula: forward FLOPs per layer kind of the pattern, times 3 (forward,
    wgrad, dgrad). Per token, with h hidden, 2 FLOPs per multiply-add:
      attention  4 h p (h + h g/n) + 2 s h p   (projections; causal QK^T and AV, p = kv_channels n / h)
      MLP        4 h f (x 3/2 with SwiGLU);   MoE: 4 h (topk f_moe + f_shared) (x 3/2 with SwiGLU)
      Mamba-2    2 h (2 d_in + 2 G n + H) + 7 d_in n + 2 d_in h   (in_proj, scan estimate, out_proj; d_in = H p)
      GDN        2 (h (2 qk + 2 v + 2 nv) + w (2 qk + v) + 4 nv dv^2 + h v)
      logits     2 h V, once per prediction depth (1 + --mtp-num-layers)
    Layers of the MTP depths count like the main ones; multi-latent attention layers ('+') count nothing, as
    in Megatron's formula (its hybrid FLOPs have no MLA term).
    """
    # lazy: megatron.core.models imports the whole model stack; only hybrid runs need the pattern parser
    from megatron.core.models.hybrid.hybrid_layer_allocation import get_hybrid_layer_counts  # lazy: see above
    counts = get_hybrid_layer_counts(args.hybrid_layer_pattern)
    h, s = args.hidden_size, args.seq_length
    tokens = batch_size * s
    heads = args.num_attention_heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    p = (args.kv_channels * heads / h) if args.kv_channels else 1
    attention = 4 * h * p * (h + h * groups / heads) + 2 * s * h * p
    glu = 1.5 if gated_mlp(args) else 1.0
    ffn = args.ffn_hidden_size if args.ffn_hidden_size is not None else 4 * h
    mlp = 4 * h * ffn * glu
    moe_ffn = getattr(args, "moe_ffn_hidden_size", None) or ffn
    moe = 4 * h * glu * (moe_ffn * getattr(args, "moe_router_topk", 1) * _latent_fraction(args)
                         + (getattr(args, "moe_shared_expert_intermediate_size", None) or 0))
    moe += 4 * h * (getattr(args, "moe_latent_size", None) or 0)  # --moe-latent-size's down and up projections
    n_state, groups_m = args.mamba_state_dim, args.mamba_num_groups
    m_heads = args.mamba_num_heads or (2 * h) // args.mamba_head_dim
    d_in = 2 * h  # Megatron's formula takes the Mamba inner width as 2 h
    mamba = 2 * h * (2 * d_in + 2 * groups_m * n_state + m_heads) + 7 * d_in * n_state + 2 * d_in * h
    gdn = gated_delta_net_forward_flops(args)
    vocab = getattr(args, "padded_vocab_size", None) or args.vocab_size
    mtp = getattr(args, "mtp_num_layers", None) or 0
    forward = (counts["*"] * attention + counts["-"] * mlp + counts["E"] * moe + counts["M"] * mamba
               + counts["G"] * gdn + 2 * h * vocab * (1 + mtp))  # one output head pass per prediction depth
    return 3 * tokens * forward


def gated_delta_net_forward_flops(args):
    """Forward FLOPs per token of one Gated DeltaNet layer (Megatron's term): in_proj, the short conv, the delta
    rule's four head-dim products per value head, out_proj."""
    h, nv = args.hidden_size, args.linear_num_value_heads
    qk, v = args.linear_key_head_dim * args.linear_num_key_heads, args.linear_value_head_dim * nv
    return 2 * (h * (2 * qk + 2 * v + 2 * nv) + args.linear_conv_kernel_dim * (2 * qk + v)
                + 4 * nv * args.linear_value_head_dim ** 2 + h * v)


def _linear_attention_layers(args) -> int:
    """Layers of a GPT model that --experimental-attention-variant gated_delta_net makes linear (0 without it)."""
    if getattr(args, "experimental_attention_variant", None) is None:
        return 0
    from megatron.core.transformer.transformer_config import linear_attention_pattern  # lazy: the variant only
    return sum(linear_attention_pattern(args.linear_attention_freq, args.num_layers))


def _last_layer_ffn(args, ffn):
    """Active FFN width of the last decoder layer (the kind every MTP depth repeats)."""
    dense, moe = moe_layer_counts(args)
    if not moe:
        return ffn
    freq = args.moe_layer_freq
    if not ((args.num_layers - 1) % freq == 0 if isinstance(freq, int) else list(freq)[-1]):
        return ffn
    moe_ffn = args.moe_ffn_hidden_size if args.moe_ffn_hidden_size is not None else ffn
    return moe_ffn * args.moe_router_topk + (args.moe_shared_expert_intermediate_size or 0)


def mla_flops_per_token(args):
    """Training FLOPs of one multi-latent attention layer per token (Megatron's MLA term): the q and kv
    down/up projections (+ their norms), the shared rope key, linear_proj, and causal core attention
    over q/k head dim qk + pe and v head dim hv."""
    h, n, s = args.hidden_size, args.num_attention_heads, args.seq_length
    d_qk = args.qk_head_dim + args.qk_pos_emb_head_dim
    if args.q_lora_rank is None:
        q_term = h * n * d_qk
    else:
        q_term = args.q_lora_rank * (h + n * d_qk + 1)
    kv_term = args.kv_lora_rank * (h + n * (args.qk_head_dim + args.v_head_dim) + 1) + h * args.qk_pos_emb_head_dim
    core = s * n * d_qk / 2 + s * n * args.v_head_dim / 2  # QK^T and AV, half under the causal mask
    return 6 * (q_term + kv_term + n * args.v_head_dim * h + core)


def moe_layer_counts(args):
    """(dense MLP layers, MoE layers) from --num-experts and --moe-layer-freq (int N or 0/1 list)."""
    L = args.num_layers
    if getattr(args, "num_experts", None) is None:
        return L, 0
    freq = args.moe_layer_freq
    pattern = [1 if i % freq == 0 else 0 for i in range(L)] if isinstance(freq, int) else list(freq)
    return L - sum(pattern), sum(pattern)


def active_mlp_ffn_sum(args, ffn):
    """Sum over layers of the FFN width a token passes through (Megatron's MoE FLOPs formula): ffn in
    dense layers; top-k routed experts of --moe-ffn-hidden-size plus the shared expert in MoE layers."""
    dense, moe = moe_layer_counts(args)
    if not moe:
        return ffn * dense
    moe_ffn = args.moe_ffn_hidden_size if args.moe_ffn_hidden_size is not None else ffn
    shared = args.moe_shared_expert_intermediate_size or 0
    # --moe-latent-size: the routed experts' GEMMs are latent wide instead of h (the projections: `latent_moe_flops`).
    routed = moe_ffn * args.moe_router_topk * _latent_fraction(args)
    return ffn * dense + (routed + shared) * moe


def _latent_fraction(args) -> float:
    latent = getattr(args, "moe_latent_size", None)
    return latent / args.hidden_size if latent else 1.0


def latent_moe_flops_per_token(args) -> float:
    """Training FLOPs per token of --moe-latent-size's down and up projections over the MoE layers (Megatron's
    term: 2 x h x latent per layer, forward and both backward GEMMs)."""
    latent = getattr(args, "moe_latent_size", None)
    return 6 * 2 * args.hidden_size * latent * moe_layer_counts(args)[1] if latent else 0


def throughput_tflops_per_gpu(args, batch_size, seconds_per_iteration, world_size):
    """TFLOP/s/GPU = FLOPs(one global batch) / (seconds per iteration * 1e12 * world size)."""
    return num_floating_point_operations(args, batch_size) / (seconds_per_iteration * 1e12 * world_size)


# Dense (no sparsity) bf16 tensor-core peaks from the vendors' datasheets, TFLOP/s, matched against
# torch.cuda.get_device_name() in order (first hit wins). Used for MFU in the log and tools/benchmark.py.
DENSE_BF16_PEAK_TFLOPS = [
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0),
    ("H800", 989.0), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("A10G", 70.0),
]


def dense_bf16_peak(device_name: str):
    """Peak dense bf16 TFLOP/s of a device name, or None when it is not in the table (CPU included)."""
    for key, peak in DENSE_BF16_PEAK_TFLOPS:
        if key in device_name:
            return peak
    return None


def current_device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def format_throughput_line(tokens_per_iteration, seconds_per_iteration, world_size, tflops_per_gpu,
                           device_name):
    """The line printed after the training log line with --log-throughput (tokens/s and MFU)."""
    tokens_per_s = tokens_per_iteration / seconds_per_iteration
    peak = dense_bf16_peak(device_name)
    if peak:
        mfu = f"{100.0 * tflops_per_gpu / peak:.1f}% (peak {peak:.0f} TFLOP/s, {device_name})"
    else:
        mfu = f"n/a (no bf16 peak known for {device_name})"
    return (f" throughput: tokens/s: {tokens_per_s:.0f} | tokens/s/GPU: {tokens_per_s / world_size:.0f} | "
            f"MFU: {mfu} |")
