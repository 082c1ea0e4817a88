"""Muon's flags (Megatron 0.19's names and defaults) and the optimizer checks: `--optimizer muon` / `dist_muon`."""

OPTIMIZERS = ["adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"]  # Megatron 0.19's choices
BUILT = ("adam", "sgd", "lion", "muon", "dist_muon")


def add_muon_args(parser):
    g = parser.add_argument_group(title="regularization")
    g.add_argument("--muon-momentum", type=float, default=0.9, help="Muon's momentum (EMA of the gradients).")
    g.add_argument("--muon-no-split-qkv", action="store_false", default=True, dest="muon_split_qkv",
                   help="Orthogonalise the fused QKV weight whole instead of as separate q, k and v matrices.")
    g.add_argument("--muon-nesterov", action="store_true", help="Nesterov-style momentum in Muon.")
    g.add_argument("--muon-scale-mode", type=str, default="spectral",
                   choices=["spectral", "unit_rms_norm", "shape_scaling"],
                   help="Scale of the orthogonalised update: sqrt(max(out, in)), sqrt(out / in) or "
                        "sqrt(max(1, out / in)).")
    g.add_argument("--muon-fp32-matmul-prec", type=str, default="medium", choices=["low", "medium", "high"],
                   help="Newton-Schulz precision: medium runs it in bf16, high in fp32 (TF32 on CUDA).")
    g.add_argument("--muon-coefficient-type", type=str, default="quintic",
                   help="Newton-Schulz coefficients: simple, quintic, polar_express, cans or aol.")
    g.add_argument("--muon-num-ns-steps", type=int, default=5, help="Newton-Schulz iterations.")
    g.add_argument("--muon-tp-mode", type=str, default="blockwise", choices=["blockwise", "duplicated", "distributed"],
                   help="TP-split weights: orthogonalise each shard (blockwise), the whole matrix gathered over "
                        "TP (duplicated), or the whole matrix from the shards with all-reduced Gram matrices "
                        "(distributed).")
    g.add_argument("--muon-extra-scale-factor", type=float, default=1.0, help="Extra factor on Muon's update.")
    g.add_argument("--lion-beta1", type=float, default=0.95,
                   help="Lion (--optimizer lion): weight of the momentum in the sign of the update.")
    g.add_argument("--lion-beta2", type=float, default=0.98, help="Lion: decay of the momentum.")
    g.add_argument("--muon-scalar-optimizer", type=str, default="adam", choices=["adam", "lion"],
                   help="Optimizer of the params Muon does not take (embeddings, output layer, norms, biases).")
    return parser


def validate_optimizer_args(args, require, warn):
    """Megatron 0.19's mapping: `dist_muon`, and `muon` with --use-distributed-optimizer, become muon with
    the layer-wise distributed optimizer (`use_layer_wise_distributed_optimizer`), and
    `use_distributed_optimizer` is turned off (the layer-wise optimizer owns the DP sharding)."""
    require(args.optimizer in BUILT, f"--optimizer {args.optimizer} is not supported; use {', '.join(BUILT)}")
    if args.no_weight_decay_cond_type == "apply_wd_to_qk_layernorm":
        warn(args, "--no-weight-decay-cond-type apply_wd_to_qk_layernorm is deprecated in Megatron; it is "
                   "--apply-wd-to-qk-layernorm")
        args.apply_wd_to_qk_layernorm = True
    args.use_layer_wise_distributed_optimizer = False
    if args.optimizer not in ("muon", "dist_muon"):
        return
    if args.optimizer == "dist_muon":
        warn(args, "--optimizer dist_muon is deprecated in Megatron; it is --optimizer muon "
                   "--use-distributed-optimizer")
        args.optimizer = "muon"
        args.use_layer_wise_distributed_optimizer = True
    if args.use_distributed_optimizer:
        args.use_layer_wise_distributed_optimizer = True
        args.use_distributed_optimizer = False
    require(not args.fp16, "--optimizer muon does not support --fp16 (as in Megatron); use --bf16")
    require(not args.use_torch_fsdp2 and not args.use_megatron_fsdp,
            "--optimizer muon does not support --use-torch-fsdp2 / --use-megatron-fsdp (as in Megatron); use DDP, "
            "optionally --use-distributed-optimizer")
    require(args.muon_fp32_matmul_prec != "low",
            "--muon-fp32-matmul-prec low is not supported (torch has no fp32 matmul precision below medium); "
            "use medium or high")
    require(args.muon_num_ns_steps >= 1, f"--muon-num-ns-steps must be >= 1, got {args.muon_num_ns_steps}")
    require(not (args.use_layer_wise_distributed_optimizer and args.ckpt_format == "torch"),
            "--optimizer dist_muon (muon with --use-distributed-optimizer) saves with --ckpt-format torch_dist; "
            "drop --ckpt-format torch")
