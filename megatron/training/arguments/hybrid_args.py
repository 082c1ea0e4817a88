"""Flags of hybrid models (pretrain_hybrid.py / pretrain_mamba.py): the layer pattern, Mamba-2 and Gated
DeltaNet shapes (Megatron 0.19.2 names and defaults), and their one-line checks."""
from megatron.core.models.hybrid.hybrid_layer_allocation import (
    Symbols,
    get_hybrid_total_layer_count,
    get_hybrid_total_pipeline_segment_count,
    parse_hybrid_pattern,
)
from megatron.core.ssm.gated_delta_net import check_gdn_shapes
from megatron.core.ssm.mamba_mixer import check_mamba_shapes
from megatron.core.transformer.transformer_config import check_attention_variant

from .moe_args import moe_freq_type


def add_hybrid_args(parser):
    g = parser.add_argument_group(title="hybrid models")
    g.add_argument("--is-hybrid-model", action="store_true",
                   help="The model is a hybrid stack (set by pretrain_hybrid.py / pretrain_mamba.py).")
    g.add_argument("--hybrid-layer-pattern", type=str, default=None,
                   help="One symbol per layer: M Mamba-2, G Gated DeltaNet, * attention, - MLP, E MoE; '|' "
                        "between pipeline stages. Sets --num-layers.")
    g.add_argument("--hybrid-override-pattern", type=str, default=None,
                   help="Deprecated spelling of --hybrid-layer-pattern.")
    g.add_argument("--mtp-hybrid-override-pattern", type=str, default=None,
                   help="Deprecated: one multi-token prediction depth's layers (e.g. '*-'); with --mtp-num-layers N "
                        "it becomes N '/'-separated copies after the main --hybrid-layer-pattern.")
    g.add_argument("--mamba-state-dim", type=int, default=128, help="Mamba-2 state size per head (n).")
    g.add_argument("--mamba-head-dim", type=int, default=64, help="Mamba-2 head dim (p).")
    g.add_argument("--mamba-num-groups", type=int, default=8, help="Mamba-2 B/C groups (G).")
    g.add_argument("--mamba-num-heads", type=int, default=None,
                   help="Mamba-2 heads; default 2 * --hidden-size / --mamba-head-dim.")
    g.add_argument("--linear-conv-kernel-dim", type=int, default=4, help="Gated DeltaNet short-conv width.")
    g.add_argument("--linear-key-head-dim", type=int, default=128, help="Gated DeltaNet query/key head dim.")
    g.add_argument("--linear-value-head-dim", type=int, default=128, help="Gated DeltaNet value head dim.")
    g.add_argument("--linear-num-key-heads", type=int, default=16, help="Gated DeltaNet query/key heads.")
    g.add_argument("--linear-num-value-heads", type=int, default=32, help="Gated DeltaNet value heads.")
    g.add_argument("--experimental-attention-variant", type=str, default=None, choices=["gated_delta_net", "dsa"],
                   help="gated_delta_net: in a GPT model, the layers --linear-attention-freq marks run Gated DeltaNet "
                        "linear attention instead of softmax attention (Qwen3-Next); dsa is not built.")
    g.add_argument("--linear-attention-freq", type=moe_freq_type, default=None,
                   help="With --experimental-attention-variant: an int N (every N-th layer keeps softmax attention, "
                        "the N - 1 before it are linear) or a 0/1 list per layer, 1 = linear, e.g. ([1]*3+[0])*2.")
    return parser


def validate_hybrid_args(args, require):
    """Resolve the pattern (the deprecated spelling included) and set --num-layers from it; one-line errors
    for bad symbols, a --num-layers that disagrees, shapes TP cannot split and layouts not built here."""
    if args.hybrid_override_pattern is not None:
        require(args.hybrid_layer_pattern is None, "--hybrid-override-pattern and --hybrid-layer-pattern cannot "
                                                   "both be set; keep --hybrid-layer-pattern")
        args.hybrid_layer_pattern, args.hybrid_override_pattern = args.hybrid_override_pattern, None
    if args.mtp_hybrid_override_pattern is not None:  # Megatron's older MTP spelling -> the unified pattern
        require(args.hybrid_layer_pattern is not None and Symbols.MTP_SEPARATOR not in args.hybrid_layer_pattern,
                "--mtp-hybrid-override-pattern needs a --hybrid-layer-pattern without '/' MTP depths; write the "
                "depths into --hybrid-layer-pattern instead ('<main>/<mtp>/<mtp>...')")
        require(bool(args.mtp_num_layers), "--mtp-hybrid-override-pattern needs --mtp-num-layers (the depths)")
        args.hybrid_layer_pattern += (Symbols.MTP_SEPARATOR + args.mtp_hybrid_override_pattern) * args.mtp_num_layers
        args.mtp_hybrid_override_pattern = None
    _validate_linear_attention(args, require)
    pattern = args.hybrid_layer_pattern
    if pattern is None:
        require(not args.is_hybrid_model, "a hybrid model needs --hybrid-layer-pattern (e.g. 'M-M*-')")
        return
    require(args.is_hybrid_model, "--hybrid-layer-pattern needs a hybrid model: run pretrain_hybrid.py or "
                                  "pretrain_mamba.py")
    try:
        parsed = parse_hybrid_pattern(pattern)
    except ValueError as e:
        require(False, str(e))
    if parsed.mtp_num_depths:  # Megatron: the pattern's depth count wins over --mtp-num-layers
        if args.mtp_num_layers not in (None, parsed.mtp_num_depths) and getattr(args, "rank", 0) == 0:
            print(f"WARNING: --mtp-num-layers {args.mtp_num_layers} disagrees with the {parsed.mtp_num_depths} "
                  f"MTP depths of --hybrid-layer-pattern; using {parsed.mtp_num_depths}", flush=True)
        args.mtp_num_layers = parsed.mtp_num_depths
    else:
        require(not args.mtp_num_layers, f"--mtp-num-layers {args.mtp_num_layers} in a hybrid model needs the MTP "
                                         "layers in --hybrid-layer-pattern: '<main>/<mtp>/<mtp>...' (e.g. "
                                         "'M*M-/*-/*-')")
    n = get_hybrid_total_layer_count(pattern)
    require(n > 0, "--hybrid-layer-pattern has no layers")
    require(args.num_layers is None or args.num_layers == n,
            f"--hybrid-layer-pattern has {n} layers but --num-layers is {args.num_layers}; make them equal or drop "
            "--num-layers")
    args.num_layers = n
    pp = args.pipeline_model_parallel_size
    segments = get_hybrid_total_pipeline_segment_count(pattern)
    if segments > 1:
        require(segments == pp, f"--hybrid-layer-pattern has {segments} '|'-separated segments; it needs one per "
                                f"pipeline stage (--pipeline-model-parallel-size {pp}); virtual pipeline stages "
                                "from '|' are not supported yet")
        require(args.decoder_first_pipeline_num_layers is None and args.decoder_last_pipeline_num_layers is None,
                "--decoder-first/last-pipeline-num-layers cannot be combined with '|' in --hybrid-layer-pattern")
    require(args.num_layers_per_virtual_pipeline_stage is None and args.num_virtual_stages_per_pipeline_rank is None,
            "virtual pipeline stages are not supported with --hybrid-layer-pattern yet")
    require(not args.first_last_layers_bf16,
            "--first-last-layers-bf16 keeps transformer layers 16-bit; in a hybrid stack it is not built yet: drop "
            "it or --fp8-format")
    require(args.pipeline_model_parallel_layout is None,
            "--pipeline-model-parallel-layout does not place hybrid layers: put '|' between the pipeline stages "
            "in --hybrid-layer-pattern")
    main = (parsed.main_pattern or "") + (parsed.mtp_pattern or "")  # every layer kind the model builds
    tp = args.tensor_model_parallel_size
    try:
        if Symbols.MAMBA in main:
            heads = args.mamba_num_heads or (2 * args.hidden_size) // args.mamba_head_dim
            check_mamba_shapes(heads, args.mamba_num_groups, tp, args.context_parallel_size)
        if Symbols.GDN in main:
            check_gdn_shapes(args.linear_num_key_heads, args.linear_num_value_heads, tp, args.context_parallel_size)
    except ValueError as e:
        require(False, str(e))
    require(Symbols.MLA not in main or args.multi_latent_attention,
            "--hybrid-layer-pattern has multi-latent attention layers (+): pass --multi-latent-attention with its "
            "sizes (--q-lora-rank, --kv-lora-rank, --qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim)")
    require(Symbols.MOE not in main or args.num_experts is not None,
            "--hybrid-layer-pattern has MoE layers (E): set --num-experts")
    require(args.num_experts is None or Symbols.MOE in main,
            "--num-experts is set but --hybrid-layer-pattern has no MoE layer (E)")


def _validate_linear_attention(args, require):
    """--experimental-attention-variant gated_delta_net in a GPT model: its pattern and the Gated DeltaNet shapes
    (a hybrid model places its G layers with --hybrid-layer-pattern instead)."""
    try:
        variant = check_attention_variant(args.experimental_attention_variant, args.linear_attention_freq,
                                          args.num_layers, args.multi_latent_attention)
        if variant is not None:
            require(not args.is_hybrid_model, "--experimental-attention-variant is for GPT models; a hybrid model "
                                              "places its Gated DeltaNet layers with 'G' in --hybrid-layer-pattern")
            check_gdn_shapes(args.linear_num_key_heads, args.linear_num_value_heads, args.tensor_model_parallel_size,
                             args.context_parallel_size)
    except (ValueError, NotImplementedError) as e:
        require(False, str(e))


def hybrid_pipeline_placed_by_pattern(args) -> bool:
    """True when '|' markers place the layers on pipeline stages (the even-split check does not apply)."""
    pattern = getattr(args, "hybrid_layer_pattern", None)
    return bool(pattern) and get_hybrid_total_pipeline_segment_count(pattern) > 1
