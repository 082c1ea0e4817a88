"""QK-clip and the max attention logit: Megatron 0.19's `--qk-clip`, `--qk-clip-alpha`, `--qk-clip-threshold`
(its 'transformer configuration' group) and `--log-max-attention-logit` (its 'logging' group)."""


def add_qk_clip_args(parser):
    g = parser.add_argument_group(title="qk clip")
    g.add_argument("--qk-clip", action="store_true",
                   help="QK-clip (MuonClip): after each optimizer step, scale the query and key rows of linear_qkv "
                        "of every query group whose max pre-softmax attention logit exceeded --qk-clip-threshold "
                        "by eta^alpha and eta^(1-alpha), eta = threshold / max logit. Works with any optimizer.")
    g.add_argument("--qk-clip-alpha", type=float, default=0.5,
                   help="How QK-clip splits the shrink between queries (eta^alpha) and keys (eta^(1-alpha)).")
    g.add_argument("--qk-clip-threshold", type=float, default=100,
                   help="QK-clip's threshold on the max attention logit.")
    g.add_argument("--log-max-attention-logit", action="store_true",
                   help="Record the max pre-softmax attention logit of every step (over all layers and heads) "
                        "and log it: 'max attention logit' in the log line, 'max_attention_logit' in "
                        "TensorBoard / W&B.")
    return parser


def validate_qk_clip_args(args, require):
    """Megatron's range checks, and the layouts where the weights or the recorded maxima cannot be reached."""
    if args.qk_clip:
        require(0.0 < args.qk_clip_alpha < 1.0,
                f"--qk-clip-alpha must be between 0.0 and 1.0 when using --qk-clip, got {args.qk_clip_alpha}")
        require(args.qk_clip_threshold > 0,
                f"--qk-clip-threshold must be greater than 0 when using --qk-clip, got {args.qk_clip_threshold}")
        require(not (args.use_torch_fsdp2 or args.use_megatron_fsdp),
                "--qk-clip does not support --use-torch-fsdp2 / --use-megatron-fsdp (the QKV weights are sharded "
                "DTensors); use DDP or --use-distributed-optimizer")
        require(not args.multi_latent_attention,
                "--qk-clip with --multi-latent-attention is not supported yet (QK-clip rescales linear_qkv); drop "
                "--qk-clip (--log-max-attention-logit works)")
    if args.qk_clip or args.log_max_attention_logit:
        flag = "--qk-clip" if args.qk_clip else "--log-max-attention-logit"
        require(args.cuda_graph_impl == "none",
                f"{flag} does not support --cuda-graph-impl {args.cuda_graph_impl} (the max logit is recorded "
                "and reset from Python each step); drop one of them")
