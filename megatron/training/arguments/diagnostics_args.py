"""Flags that help diagnose a failing run: hang dumps (NCCL flight recorder), straggler reports and the
rerun state machine (NaN / spiky loss / large grads). Megatron 0.19.2's names, types and defaults."""

def add_diagnostics_args(parser):
    g = parser.add_argument_group(title="diagnostics")
    g.add_argument("--distributed-timeout-seconds-after-init", type=int, default=None,
                   help="Collective timeout (seconds) once start-up is done; also when the hang watchdog dumps.")
    g.add_argument("--flight-recorder-dump-path", type=str, default=None,
                   help="Prefix of the hang dumps: <prefix><rank>.stacks.txt, and NCCL's trace <prefix><rank>.")
    g.add_argument("--flight-recorder-trace-buffer-size", type=int, default=2000,
                   help="NCCL flight recorder entries (TORCH_NCCL_TRACE_BUFFER_SIZE).")
    g.add_argument("--no-flight-recorder-dump-on-timeout", "--disable-flight-recorder-dump-on-timeout",
                   action="store_false", dest="flight_recorder_dump_on_timeout",
                   help="Do not dump the NCCL flight recorder at a timeout.")
    g.add_argument("--flight-recorder-include-stack-trace", action="store_true",
                   help="NCCL flight recorder entries carry the Python stack (TORCH_INCLUDE_STACK_TRACE).")
    g.add_argument("--no-flight-recorder-include-only-active", "--disable-flight-recorder-include-only-active",
                   action="store_false", dest="flight_recorder_include_only_active",
                   help="Dump completed NCCL collectives too.")
    g.add_argument("--no-flight-recorder-extra-dump-on-exec", "--disable-flight-recorder-extra-dump-on-exec",
                   action="store_false", dest="flight_recorder_extra_dump_on_exec",
                   help="No extra NCCL dump on an exception.")
    g = parser.add_argument_group(title="straggler")
    g.add_argument("--log-straggler", action="store_true",
                   help="Report the slowest and fastest ranks' step times at each log interval.")
    g.add_argument("--straggler-ctrlr-port", type=int, default=65535,
                   help="Rank 0 port where an HTTP request toggles the report (curl <host>:<port>); 0: a free one.")
    g.add_argument("--straggler-minmax-count", type=int, default=1,
                   help="How many slowest and fastest ranks to report.")
    g.add_argument("--disable-straggler-on-startup", action="store_true",
                   help="Start with the report off; toggle it through --straggler-ctrlr-port.")
    g = parser.add_argument_group(title="rerun engine")
    g.add_argument("--rerun-mode", type=str, default="validate_results",
                   choices=["disabled", "validate_results", "report_stats"],
                   help="On a NaN, spiky loss or large grad: re-run the step to tell a transient fault from a "
                        "reproducible one (validate_results), re-run every step and report differences "
                        "(report_stats), or only check (disabled).")
    g.add_argument("--check-for-spiky-loss", action="store_true",
                   help="Validate that the loss stays below 10x the largest loss seen so far.")
    g.add_argument("--check-for-large-grads", action="store_true",
                   help="Validate that the grad norm is finite and below 10x the largest seen so far.")
    g.add_argument("--error-injection-rate", type=int, default=0,
                   help="Inject a NaN into every Nth validated result (testing the rerun engine); 0: never.")
    g.add_argument("--error-injection-type", type=str, default="transient_error",
                   choices=["correct_result", "transient_error", "persistent_error"],
                   help="transient_error: only the first run sees the NaN; the others: every re-run too.")
    g.add_argument("--result-rejected-tracker-filename", type=str, default=None,
                   help="Append one line per rejected result (iteration, rank, diagnosis) to this file.")
    return parser


def validate_diagnostics_args(args, require):
    """``require(condition, message)`` raises ArgumentError (validation.py passes its own)."""
    for flag, value, low in (
            ("--distributed-timeout-seconds-after-init", args.distributed_timeout_seconds_after_init, 1),
            ("--distributed-timeout-minutes", args.distributed_timeout_minutes, 1),
            ("--straggler-minmax-count", args.straggler_minmax_count, 1),
            ("--error-injection-rate", args.error_injection_rate, 0),
            ("--flight-recorder-trace-buffer-size", args.flight_recorder_trace_buffer_size, 0)):
        require(value is None or value >= low, f"{flag} ({value}) must be >= {low}")
    require(0 <= args.straggler_ctrlr_port < 65536,
            f"--straggler-ctrlr-port ({args.straggler_ctrlr_port}) must be in 0..65535 (0: any free port)")
    require(not (args.error_injection_rate and args.rerun_mode == "report_stats"),
            "--error-injection-rate needs --rerun-mode validate_results or disabled")
