"""--log-energy and --test-mode (Megatron's names): watching the hardware while a run trains, through the GPUs'
energy counters and by checking that parameters every replica must hold identically are identical."""
from megatron.core.energy_monitor import nvml_missing_reason


def add_health_args(parser):
    g = parser.add_argument_group(title="hardware health")
    g.add_argument("--log-energy", action="store_true",
                   help="Energy per GPU per iteration (J) and power per GPU (W) in the log line, and the run's "
                        "total GPU energy at the end, from NVML's energy counters (needs CUDA and nvidia-ml-py); "
                        "evaluation and checkpoint saves are left out.")
    g.add_argument("--test-mode", action="store_true",
                   help="Every --log-interval iterations (and at the start), check that replicated parameters are "
                        "bitwise identical: all of them across data-parallel ranks (expert parameters across the "
                        "expert data-parallel ranks), norms and other unsplit ones across tensor-parallel ranks; "
                        "a mismatch (silent memory or network corruption) stops the run, naming the parameter.")
    return parser


def validate_health_args(args, require):
    if args.log_energy:
        reason = nvml_missing_reason()
        require(reason is None, f"--log-energy: {reason}")
    if args.test_mode:
        require(not args.use_torch_fsdp2, "--test-mode compares whole parameters across data-parallel ranks, which "
                                          "FSDP shards: drop --test-mode, or FSDP (--use-torch-fsdp2; "
                                          "--use-megatron-fsdp sharding grads or params)")
