"""Flags for multi-latent attention, YaRN and multi-token prediction (Megatron 0.19.2 names and defaults)."""
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig


def add_mla_args(parser):
    g = parser.add_argument_group(title="mla")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="Multi-latent attention (DeepSeek-V2/V3) instead of standard attention.")
    g.add_argument("--q-lora-rank", type=int, default=None,
                   help="Rank of the query down-projection; unset: one full-rank query projection.")
    g.add_argument("--kv-lora-rank", type=int, default=32, help="Rank of the shared key/value latent.")
    g.add_argument("--qk-head-dim", type=int, default=128, help="Query/key head dim without RoPE.")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64, help="Query/key head dim that carries RoPE.")
    g.add_argument("--v-head-dim", type=int, default=128, help="Value head dim.")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0, help="YaRN context extension factor.")
    g.add_argument("--mscale", type=float, default=1.0, help="YaRN mscale (cos/sin concentration).")
    g.add_argument("--mscale-all-dim", type=float, default=0.0,
                   help="YaRN mscale_all_dim (also squared into the softmax scale).")
    g.add_argument("--rope-type", type=str, default=None, choices=["rope", "yarn"],
                   help="RoPE of multi-latent attention; default yarn (Megatron's MLATransformerConfig).")
    g.add_argument("--yarn-original-max-position-embeddings", type=int, default=None,
                   help="YaRN: context length of the original model (default 4096).")
    g.add_argument("--yarn-beta-fast", type=float, default=None, help="YaRN beta_fast (default 32).")
    g.add_argument("--yarn-beta-slow", type=float, default=None, help="YaRN beta_slow (default 1).")
    g.add_argument("--yarn-correction-range-round-to-int", action="store_true", default=None,
                   dest="yarn_correction_range_round_to_int", help="YaRN: round the ramp bounds (default).")
    g.add_argument("--no-yarn-correction-range-round-to-int", action="store_false",
                   dest="yarn_correction_range_round_to_int", help="YaRN: keep fractional ramp bounds.")
    g = parser.add_argument_group(title="multi-token prediction")
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="Multi-token prediction depths on the last stage (DeepSeek-V3 uses 1).")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="Weight of the mean MTP loss added to the LM loss.")
    g.add_argument("--mtp-use-repeated-layer", action="store_true",
                   help="Build one MTP layer and apply it at each of the --mtp-num-layers depths (shared weights; "
                        "checkpoints hold mtp.layers.0 only).")
    return parser


def mla_config_class(args):
    """MLATransformerConfig with --multi-latent-attention, else TransformerConfig."""
    return MLATransformerConfig if args.multi_latent_attention else TransformerConfig


def mla_config_overrides(args) -> dict:
    """Config fields whose flag has another name, set only when the flag is (the config default otherwise)."""
    if not args.multi_latent_attention:
        return {}
    out = {"rope_type": MLATransformerConfig.rope_type}  # Megatron: --rope-type unset keeps MLA's yarn
    for flag_dest, field in (("rope_type", "rope_type"),
                             ("yarn_original_max_position_embeddings", "original_max_position_embeddings"),
                             ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                             ("yarn_correction_range_round_to_int", "correction_range_round_to_int")):
        if getattr(args, flag_dest, None) is not None:
            out[field] = getattr(args, flag_dest)
    return out


# Largest query/key head dim each SDPA backend list takes on CUDA (values are zero-padded to it).
_MAX_HEAD_DIM = {"flash": 256}


def validate_mla_args(args, require):
    """One-line errors for MLA / YaRN / MTP flags; ``require(cond, message)`` raises ArgumentError."""
    pe = args.position_embedding_type
    if not args.multi_latent_attention:
        require(pe != "yarn", "--position-embedding-type yarn is supported with --multi-latent-attention only; "
                              "use rope for standard attention")
        require(args.rope_type in (None, "rope"), f"--rope-type {args.rope_type} needs --multi-latent-attention")
    else:
        require(not args.attention_output_gate, "--attention-output-gate is not supported with "
                                                "--multi-latent-attention; drop one of them")
        require(args.context_parallel_size == 1,
                "--multi-latent-attention is not supported with --context-parallel-size > 1 yet; use CP=1")
        require(args.kv_lora_rank is not None and args.kv_lora_rank > 0,
                f"--kv-lora-rank ({args.kv_lora_rank}) must be set to a positive rank with --multi-latent-attention")
        require(args.q_lora_rank is None or args.q_lora_rank > 0,
                f"--q-lora-rank ({args.q_lora_rank}) must be positive, or left unset for a full-rank query")
        require(not args.group_query_attention,
                "--group-query-attention cannot be combined with --multi-latent-attention (MLA shares one latent)")
        require(pe != "yarn" or args.rope_type in (None, "yarn"),
                "--position-embedding-type yarn conflicts with --rope-type rope; drop one of them")
        q_dim = args.qk_head_dim + args.qk_pos_emb_head_dim
        backend = str(args.attention_backend)
        limit = _MAX_HEAD_DIM.get(backend)
        require(limit is None or q_dim <= limit,
                f"--attention-backend {backend} takes head dims up to {limit}, but MLA's query/key head dim is "
                f"{q_dim} (--qk-head-dim + --qk-pos-emb-head-dim); use --attention-backend auto or unfused")
        require(backend not in ("flash", "fused") or q_dim % 8 == 0,
                f"--attention-backend {backend} needs head dims that are multiples of 8, but MLA's query/key head "
                f"dim is {q_dim}; use --attention-backend auto or unfused")
        require(backend not in ("flash", "fused") or args.v_head_dim <= q_dim,
                f"--attention-backend {backend} needs --v-head-dim ({args.v_head_dim}) <= the query/key head dim "
                f"({q_dim}); use --attention-backend auto or unfused")
    require(not args.mtp_use_repeated_layer or args.mtp_num_layers is not None,
            "--mtp-use-repeated-layer repeats the MTP layer over --mtp-num-layers depths: pass --mtp-num-layers")
    if args.mtp_num_layers is not None:
        require(args.mtp_num_layers >= 1, f"--mtp-num-layers ({args.mtp_num_layers}) must be >= 1")
        require(args.context_parallel_size == 1,
                "--mtp-num-layers is not supported with --context-parallel-size > 1 yet (rolling the tokens "
                "crosses CP ranks); use CP=1")
        require(args.pipeline_model_parallel_size == 1,
                "--mtp-num-layers is not supported with --pipeline-model-parallel-size > 1 (the MTP depths need "
                "the word embedding on the last stage); use pipeline size 1")
