"""Estimate of weight + optimizer memory on the most loaded rank (Megatron's "Theoretical memory" line)."""

NUM_BYTES_IN_MEGABYTE = 1024 * 1024


def compute_weight_and_optimizer_memory(args, verbose=False):
    """Bytes for params, grads and Adam state on the first pipeline stage (it holds the embedding)."""
    h, L = args.hidden_size, args.num_layers
    heads = args.num_attention_heads
    kv = args.kv_channels or h // heads
    groups = args.num_query_groups if args.group_query_attention else heads
    ffn = args.ffn_hidden_size or 4 * h
    glu = 3 if args.swiglu else 2
    per_layer = h * kv * (heads + 2 * groups) + kv * heads * h + glu * h * ffn + 4 * h
    vocab = getattr(args, "padded_vocab_size", None) or args.vocab_size or 0
    embedding = vocab * h + (args.max_position_embeddings * h if args.position_embedding_type == "learned_absolute"
                             else 0)
    untied = 0 if not args.untie_embeddings_and_output_weights else vocab * h
    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    first_stage = (per_layer * L / pp + embedding + (untied if pp == 1 else 0)) / tp
    if verbose:
        print(f"Number of parameters in most loaded shard in billions: {first_stage / 1e9:.4f}", flush=True)
    # 16-bit params + fp32 grads + fp32 main params + Adam m, v = 18 B; distributed optimizer shards 12 B.
    bytes_per_param = 18 if not args.use_distributed_optimizer else 6 + 12 / args.data_parallel_size
    return first_stage * bytes_per_param


def report_theoretical_memory(args, num_microbatches=None, verbose=False):
    weight_and_optimizer = compute_weight_and_optimizer_memory(args, verbose) / NUM_BYTES_IN_MEGABYTE
    print(f"Theoretical memory footprints: weight and optimizer={weight_and_optimizer:.2f} MB", flush=True)
