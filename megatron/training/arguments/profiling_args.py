"""Profiling flags, Megatron 0.19.2's names and defaults; diagnostics/profiler.py does the work."""
import torch


def add_profiling_args(parser):
    g = parser.add_argument_group(title="profiling")
    g.add_argument("--profile", action="store_true",
                   help="Profile iterations [--profile-step-start, --profile-step-end): an nsys capture range "
                        "(cudaProfilerStart/Stop, NVTX ranges), or a torch.profiler trace with "
                        "--use-pytorch-profiler.")
    g.add_argument("--profile-step-start", type=int, default=10, help="First profiled iteration.")
    g.add_argument("--profile-step-end", type=int, default=12, help="Iteration the profiling window ends before.")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="The window is recorded by torch.profiler; Chrome traces per rank under --tensorboard-dir.")
    g.add_argument("--pytorch-profiler-collect-shapes", action="store_true",
                   help="The trace records operator input shapes.")
    g.add_argument("--pytorch-profiler-collect-callstack", action="store_true",
                   help="The trace records Python call stacks.")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[],
                   help="Ranks that profile (default: rank 0).")
    g.add_argument("--record-memory-history", action="store_true",
                   help="Record CUDA allocations and write a snapshot to --memory-snapshot-path.")
    g.add_argument("--memory-snapshot-path", type=str, default="snapshot.pickle",
                   help="Where the CUDA memory snapshot goes (open it at pytorch.org/memory_viz).")
    g.add_argument("--record-shapes", action="store_true",
                   help="Record operator input shapes in the profiler's trace or NVTX ranges.")
    g.add_argument("--nvtx-ranges", action="store_true",
                   help="NVTX ranges (forward, backward, optimizer, collectives, operators) for the whole run, "
                        "for an nsys capture without a capture range.")
    return parser


def validate_profiling_args(args, require) -> None:
    """``require(condition, message)`` raises the parser's one-line error."""
    if args.profile:
        require(0 <= args.profile_step_start < args.profile_step_end,
                f"--profile-step-start ({args.profile_step_start}) must be >= 0 and below --profile-step-end "
                f"({args.profile_step_end})")
        require(args.use_pytorch_profiler or torch.cuda.is_available(),
                "--profile without --use-pytorch-profiler is an nsys capture range and needs a GPU; "
                "add --use-pytorch-profiler for a torch.profiler trace on CPU")
    if args.use_pytorch_profiler:
        require(args.profile, "--use-pytorch-profiler needs --profile (it chooses the profiler of the window)")
        require(args.tensorboard_dir is not None,
                "--use-pytorch-profiler writes its traces under --tensorboard-dir: set it")
    require(not args.nvtx_ranges or torch.cuda.is_available(),
            "--nvtx-ranges annotates a CUDA run for nsys and this run has no GPU: drop the flag")
    require(not args.record_memory_history or torch.cuda.is_available(),
            "--record-memory-history records CUDA allocations and this run has no GPU: drop the flag")
