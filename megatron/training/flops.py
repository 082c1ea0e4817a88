"""FLOPs per global batch with Megatron's dense-GPT formula (COMPAT.md 3.4), for TFLOP/s/GPU and MFU."""


def num_floating_point_operations(args, batch_size):
    """Training FLOPs (forward + both backward GEMMs) for `batch_size` samples of `args.seq_length` tokens.

    Per token: 6*h*f*E*L (MLP, E=3 for SwiGLU else 2) + 6*L*(h*(d_q + 2*d_kv) + d_q*h) (QKV and output
    projections) + 6*h*V (logits); plus per sample 6*s^2*d_q*L for causal core attention (QK^T and AV,
    halved for the mask). 6 = 3 GEMMs (fwd, wgrad, dgrad) x 2 FLOPs per multiply-add.
    """
    h, L, s = args.hidden_size, args.num_layers, args.seq_length
    heads = args.num_attention_heads
    kv_channels = args.kv_channels if args.kv_channels is not None else h // heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    d_q, d_kv = kv_channels * heads, kv_channels * groups
    ffn = args.ffn_hidden_size if args.ffn_hidden_size is not None else 4 * h
    expansion = 3 if getattr(args, "swiglu", False) else 2
    vocab = getattr(args, "padded_vocab_size", None) or args.vocab_size
    tokens = batch_size * s
    per_token = (6 * h * ffn * expansion * L
                 + 6 * L * (h * (d_q + 2 * d_kv) + d_q * h)
                 + 6 * h * vocab)
    return tokens * per_token + batch_size * s * s * 6 * d_q * L


def throughput_tflops_per_gpu(args, batch_size, seconds_per_iteration, world_size):
    """TFLOP/s/GPU = FLOPs(one global batch) / (seconds per iteration * 1e12 * world size)."""
    return num_floating_point_operations(args, batch_size) / (seconds_per_iteration * 1e12 * world_size)
