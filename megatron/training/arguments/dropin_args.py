"""Megatron flags common in launch scripts: --use-cpu-initialization, --no-initialization, --deterministic-mode,
--yaml-cfg, --use-megatron-fsdp with --data-parallel-sharding-strategy, --torch-fsdp2-no-reshard-after-forward,
--dist-ckpt-strictness and --no-data-sharding.

Megatron-FSDP's sharding strategies run on our data-parallel engines (ZeRO stages):
    no_shard            -> DDP (replicated params, grads and optimizer state)
    optim               -> DDP + distributed optimizer (ZeRO-1: optimizer state and fp32 main params sharded)
    optim_grads         -> FSDP2 without resharding after forward (ZeRO-2: grads and optimizer state sharded;
                           params gathered once per step and kept from forward to backward)
    optim_grads_params  -> FSDP2 resharding after forward (ZeRO-3: params gathered again for backward)
optim_grads runs on FSDP2 rather than the distributed optimizer because the distributed optimizer keeps a
full-size gradient buffer on every rank: only FSDP2 actually shards gradient memory, which is what
optim_grads promises; its communication volume (one all-gather, one reduce-scatter) is ZeRO-2's.
"""
import os

import torch

SHARDING_STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
# Megatron accepts these NCCL algorithms in deterministic mode (all are run-to-run deterministic).
DETERMINISTIC_NCCL_ALGOS = ["Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS"]
CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS is deterministic with a fixed workspace (CUDA docs)
STRICTNESS = ["assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
              "return_unexpected", "return_all", "ignore_all"]
# A torch_dist load reads exactly the tensors the model asks for: a tensor missing from the checkpoint is
# an error, or kept at its current value (logged with log_all); keys the model does not ask for are never
# read, so the modes that list or refuse such unexpected keys are not built.
STRICTNESS_BUILT = ("assume_ok_unexpected", "log_all", "ignore_all")


def add_dropin_args(parser):
    g = parser.add_argument_group(title="drop-in Megatron options")
    g.add_argument("--use-cpu-initialization", action="store_true", default=None,
                   help="Create and initialize parameters on the CPU, then move them to the device (same values "
                        "as a CPU run: initialization depends only on --seed and the parameter's name).")
    g.add_argument("--no-initialization", action="store_false", dest="perform_initialization",
                   help="Skip parameter initialization (the weights come from --load).")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="Bitwise reproducible runs: deterministic torch algorithms, cuBLAS workspace, NCCL "
                        "algorithm and SDPA kernels (see docs/migrating.md for the cost).")
    g.add_argument("--yaml-cfg", type=str, default=None,
                   help="Megatron's YAML config (language_model:, model_parallel: and top-level keys; "
                        "${ENV} expanded). Its values override the command line.")
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="Shard over data parallelism per --data-parallel-sharding-strategy, on DDP, the "
                        "distributed optimizer or torch FSDP2 (composes with TP).")
    g.add_argument("--data-parallel-sharding-strategy", type=str, default="optim_grads_params",
                   choices=SHARDING_STRATEGIES,
                   help="With --use-megatron-fsdp: no_shard (DDP), optim (distributed optimizer), optim_grads "
                        "(FSDP2, no reshard after forward), optim_grads_params (FSDP2).")
    g.add_argument("--torch-fsdp2-no-reshard-after-forward", action="store_false",
                   dest="torch_fsdp2_reshard_after_forward",
                   help="FSDP2 keeps gathered params from forward to backward (less communication, more memory).")
    g.add_argument("--dist-ckpt-strictness", type=str, default="assume_ok_unexpected", choices=STRICTNESS,
                   help="torch_dist load: a tensor missing from the checkpoint raises (assume_ok_unexpected), is "
                        "logged and kept (log_all) or kept (ignore_all).")
    g.add_argument("--no-data-sharding", action="store_false", dest="data_sharding",
                   help="With --dataloader-type cyclic: every data-parallel rank samples the whole dataset "
                        "instead of its own contiguous bucket.")
    return parser


def validate_dropin_args(args, require, log):
    """Map Megatron-FSDP onto our engines and set up deterministic mode; runs before the parallel checks.

    ``require(cond, message)`` raises the one-line ArgumentError; ``log(message)`` prints on rank 0."""
    args.use_cpu_initialization = bool(args.use_cpu_initialization)
    require(args.dist_ckpt_strictness in STRICTNESS_BUILT,
            f"--dist-ckpt-strictness {args.dist_ckpt_strictness}: checks of unexpected checkpoint keys are not "
            f"built; use {', '.join(STRICTNESS_BUILT)}")
    if args.use_megatron_fsdp:
        _map_megatron_fsdp(args, require, log)
    if args.deterministic_mode:
        _deterministic_mode(args, require, log)


def _map_megatron_fsdp(args, require, log):
    strategy = args.data_parallel_sharding_strategy
    flag = f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy}"
    require(not args.use_torch_fsdp2, "--use-megatron-fsdp and --use-torch-fsdp2 are exclusive; pass one")
    # Megatron-FSDP scripts pass --use-distributed-optimizer too: here the strategy decides.
    args.use_distributed_optimizer = strategy == "optim"
    if strategy in ("optim_grads", "optim_grads_params"):
        require(args.pipeline_model_parallel_size == 1,
                f"{flag} runs on FSDP2, which does not support --pipeline-model-parallel-size > 1; use "
                "--data-parallel-sharding-strategy optim (distributed optimizer) with pipeline parallelism")
        args.use_torch_fsdp2 = True
        args.torch_fsdp2_reshard_after_forward = strategy == "optim_grads_params"
        # FSDP2 prefetches all-gathers and reduce-scatters in backward by itself.
        args.overlap_grad_reduce = args.overlap_param_gather = False
        engine = f"torch FSDP2, reshard after forward: {args.torch_fsdp2_reshard_after_forward}"
    else:
        args.overlap_param_gather = args.overlap_param_gather and strategy == "optim"
        engine = "DDP with the distributed optimizer" if strategy == "optim" else "DDP"
    log(f"{flag}: running on {engine}")


def _deterministic_mode(args, require, log):
    """Megatron's checks, plus the settings it leaves to the user (cuBLAS workspace, NCCL algorithm)."""
    require(not args.torch_compile,
            "--deterministic-mode with --torch-compile: generated kernels are not checked for determinism; "
            "drop --torch-compile")
    algo = os.environ.setdefault("NCCL_ALGO", "Ring")
    require(algo in DETERMINISTIC_NCCL_ALGOS,
            f"--deterministic-mode: NCCL_ALGO={algo} may not be deterministic; unset it or use one of "
            f"{', '.join(DETERMINISTIC_NCCL_ALGOS)}")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    require(os.environ["CUBLAS_WORKSPACE_CONFIG"] in (":4096:8", ":16:8"),
            f"--deterministic-mode: CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']} is not "
            "deterministic; unset it or use :4096:8 or :16:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    log(f"deterministic mode: torch deterministic algorithms, NCCL_ALGO={algo}, "
        f"CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']}, deterministic SDPA kernels")
