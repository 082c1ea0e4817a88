"""Memory estimate on the most loaded rank (Megatron's "Theoretical memory" line) and the fuller
--dry-run style estimate (weights, optimizer, activations, logits, FLOPs) printed by tools/benchmark.py."""
import torch

from megatron.training.flops import active_mlp_ffn_sum, gated_mlp, moe_layer_counts, num_floating_point_operations

NUM_BYTES_IN_MEGABYTE = 1024 * 1024


def compute_weight_and_optimizer_memory(args, verbose=False):
    """Bytes for params, grads and Adam state on the first pipeline stage (it holds the embedding)."""
    h, L = args.hidden_size, args.num_layers
    heads = args.num_attention_heads
    kv = args.kv_channels or h // heads
    groups = args.num_query_groups if args.group_query_attention else heads
    ffn = args.ffn_hidden_size or 4 * h
    glu = 3 if gated_mlp(args) else 2
    attention = h * kv * (heads + 2 * groups) + kv * heads * h
    if args.multi_latent_attention:
        attention = mla_params_per_layer(args)
    per_layer = attention + glu * h * ffn + 4 * h
    if args.num_experts is not None:
        per_layer = _moe_average_layer_params(args, per_layer - glu * h * ffn, glu)
    mtp = args.mtp_num_layers or 0
    if getattr(args, "mtp_use_repeated_layer", False):
        mtp = min(mtp, 1)  # one MTP layer's weights, applied at every depth
    L = L + mtp  # MTP depths: a layer each (+ eh_proj and norms below), on the last stage
    per_layer_extra = mtp * (2 * h * h + 3 * h)
    vocab = args.padded_vocab_size or args.vocab_size or 0
    embedding = vocab * h + (args.max_position_embeddings * h if args.position_embedding_type == "learned_absolute"
                             else 0)
    untied = 0 if not args.untie_embeddings_and_output_weights else vocab * h
    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    first_stage = (per_layer * L / pp + per_layer_extra + embedding + (untied if pp == 1 else 0)) / tp
    if verbose:
        print(f"Number of parameters in most loaded shard in billions: {first_stage / 1e9:.4f}", flush=True)
    # 16-bit params + fp32 grads + fp32 main params + Adam m, v = 18 B; distributed optimizer shards 12 B (the
    # precision-aware optimizer's 16-bit grads, master weights or moments take 2 B each instead of 4).
    # The distributed optimizer shards over DP x CP (CP ranks hold the same weights).
    size = lambda name: getattr(getattr(args, name, None), "itemsize", 4)  # noqa: E731  (fp32 unless set)
    sharded = size("main_params_dtype") + size("exp_avg_dtype") + size("exp_avg_sq_dtype")
    unsharded = 2 + size("main_grads_dtype")
    shards = args.data_parallel_size * args.context_parallel_size
    bytes_per_param = unsharded + sharded / (shards if args.use_distributed_optimizer else 1)
    return first_stage * bytes_per_param


def _moe_average_layer_params(args, attention_and_norms, glu):
    """Params per layer on one rank, averaged over the layers, in units of the dense TP split: MoE layers
    hold E/EP experts split over expert-TP (scaled back to a TP divisor), a shared expert and a router."""
    h, ffn = args.hidden_size, args.ffn_hidden_size or 4 * args.hidden_size
    dense, moe = moe_layer_counts(args)
    moe_ffn = args.moe_ffn_hidden_size or ffn
    tp, etp = args.tensor_model_parallel_size, args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    experts = glu * h * moe_ffn * args.num_experts / args.expert_model_parallel_size * tp / etp
    moe_mlp = experts + glu * h * (args.moe_shared_expert_intermediate_size or 0) + args.num_experts * h * tp
    return attention_and_norms + (dense * glu * h * ffn + moe * moe_mlp) / args.num_layers


def mla_params_per_layer(args):
    """Multi-latent attention weights of one layer: q (low-rank + norm, or full), kv down/up + norm, proj."""
    h, n = args.hidden_size, args.num_attention_heads
    d_qk = args.qk_head_dim + args.qk_pos_emb_head_dim
    q = h * n * d_qk if args.q_lora_rank is None else args.q_lora_rank * (h + 1 + n * d_qk)
    kv = h * (args.kv_lora_rank + args.qk_pos_emb_head_dim) + args.kv_lora_rank * (
        1 + n * (args.qk_head_dim + args.v_head_dim))
    return q + kv + n * args.v_head_dim * h


def compute_activation_memory(args):
    """Bytes of activations saved for backward by one micro-batch on the first stage (16-bit activations).

    Per layer and token, what our layers keep: both norm inputs and outputs (4h), Q/K/V (d_q + 2 d_kv),
    the attention output twice (SDPA's output and the projection input, 2 d_q; flash kernels keep no
    s x s scores), and the MLP hidden: fc1 output + activation output (2f), or for SwiGLU fc1's [gate; up],
    silu(gate) and the product (4f). For GPT with f = 4h this is Megatron's 34*s*b*h bytes.
    Full recompute keeps only each layer's input (plus one layer's set while recomputing).
    Context parallelism divides the tokens per rank (and so these bytes) by CP.
    """
    h, L = args.hidden_size, args.num_layers
    heads = args.num_attention_heads
    kv = args.kv_channels or h // heads
    groups = args.num_query_groups if args.group_query_attention else heads
    ffn = args.ffn_hidden_size or 4 * h
    d_q, d_kv = kv * heads, kv * groups
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    tokens = args.seq_length * args.micro_batch_size / args.context_parallel_size  # CP: s / CP
    attention = (d_q + 2 * d_kv) / tp + 2 * d_q / tp
    if args.multi_latent_attention:
        # Latents before and after their norm (replicated), then q, k, v and the attention output twice.
        n, d_qk = args.num_attention_heads, args.qk_head_dim + args.qk_pos_emb_head_dim
        latents = 2 * ((args.q_lora_rank or 0) + args.kv_lora_rank + args.qk_pos_emb_head_dim)
        attention = latents + n * (2 * d_qk + 3 * args.v_head_dim) / tp
    dispatch = 0
    if args.num_experts is not None:
        # MoE: each token's top-k expert activations plus the shared expert (the active FFN width), and
        # the permuted copies of the token (dispatch input, combine input: 2 k h), averaged over layers.
        ffn = active_mlp_ffn_sum(args, ffn) / L
        dispatch = 2 * args.moe_router_topk * h * moe_layer_counts(args)[1] / L
    per_layer = 2 * tokens * (4 * h + dispatch + attention + (4 if gated_mlp(args) else 2) * ffn / tp)
    layers = (L + (args.mtp_num_layers or 0)) / pp
    granularity = args.recompute_granularity
    if granularity == "full":
        return layers * 2 * tokens * h + per_layer
    if granularity == "selective" and "mlp" in (args.recompute_modules or []):
        per_layer -= 2 * tokens * (4 if gated_mlp(args) else 2) * ffn / tp
    # Micro-batches in flight on the first stage under 1F1B: pp of them (one when pp == 1); an upper bound
    # when a step has fewer micro-batches than stages.
    return layers * per_layer * pp


def compute_logits_memory(args):
    """Peak bytes of the output layer + loss for one micro-batch: 16-bit logits and their 16-bit grad,
    plus with the eager loss the fp32 copies (upcast, shifted logits, softmax, fp32 grad)."""
    vocab = args.padded_vocab_size or args.vocab_size or 0
    cp = args.context_parallel_size
    n = args.seq_length / cp * args.micro_batch_size * vocab / args.tensor_model_parallel_size
    # The chunked loss is also the default for 16-bit logits on CUDA (same math, no fp32 copies).
    sixteen_bit = args.bf16 or args.fp16
    fused = args.cross_entropy_loss_fusion or (
        sixteen_bit and torch.cuda.is_available() and not args.fp16_lm_cross_entropy)
    return n * (2 + 2) + (0 if fused else n * 4 * 3)


def estimate_memory_and_flops(args):
    """Dict of byte counts (weights_and_optimizer, activations, logits, total) and flops_per_iteration."""
    est = {"weights_and_optimizer": compute_weight_and_optimizer_memory(args),
           "activations": compute_activation_memory(args), "logits": compute_logits_memory(args)}
    est["total"] = sum(est.values())
    est["flops_per_iteration"] = num_floating_point_operations(args, args.global_batch_size)
    return est


def print_estimate(est):
    gib = 1024 ** 3
    print(f"Estimate (most loaded rank): weights+grads+optimizer {est['weights_and_optimizer'] / gib:.2f} GiB, "
          f"activations {est['activations'] / gib:.2f} GiB, logits+loss {est['logits'] / gib:.2f} GiB, "
          f"total {est['total'] / gib:.2f} GiB; {est['flops_per_iteration'] / 1e12:.1f} TFLOP per iteration",
          flush=True)


def report_theoretical_memory(args, num_microbatches=None, verbose=False):
    weight_and_optimizer = compute_weight_and_optimizer_memory(args, verbose) / NUM_BYTES_IN_MEGABYTE
    activation = (compute_activation_memory(args) + compute_logits_memory(args)) / NUM_BYTES_IN_MEGABYTE
    print(f"Theoretical memory footprints: weight and optimizer={weight_and_optimizer:.2f} MB, "
          f"activation={activation:.2f} MB, total={weight_and_optimizer + activation:.2f} MB", flush=True)
