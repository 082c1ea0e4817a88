"""--tp-comm-overlap: overlap the sequence-parallel all-gathers / reduce-scatters with the TP GEMMs.

Our own chunked ring over torch.distributed (megatron/core/tensor_parallel/overlap.py); Megatron's
Transformer Engine userbuffer tuning knobs have no counterpart (megatron_flags.py lists them), and its
userbuffer config file (--tp-comm-overlap-cfg) is accepted and has no effect: there are no userbuffers."""
import os


def add_tp_overlap_args(parser):
    g = parser.add_argument_group(title="tensor-parallel communication overlap")
    g.add_argument("--tp-comm-overlap", action="store_true", default=False,
                   help="Pipeline the sequence-parallel all-gather / reduce-scatter with the column- / row-parallel "
                        "GEMMs (needs --sequence-parallel and TP > 1).")
    g.add_argument("--no-tp-comm-overlap-ag", "--disable-tp-comm-overlap-ag", action="store_false",
                   dest="tp_comm_overlap_ag", help="With --tp-comm-overlap: keep the all-gathers unpipelined.")
    g.add_argument("--no-tp-comm-overlap-rs", "--disable-tp-comm-overlap-rs", action="store_false",
                   dest="tp_comm_overlap_rs", help="With --tp-comm-overlap: keep the forward reduce-scatter "
                                                   "unpipelined.")
    g.add_argument("--no-tp-comm-bulk-dgrad", "--disable-tp-comm-bulk-dgrad", action="store_false",
                   dest="tp_comm_bulk_dgrad", help="With --tp-comm-overlap: do not run the backward re-gather of "
                                                   "the input behind the dgrad GEMM.")
    g.add_argument("--no-tp-comm-bulk-wgrad", "--disable-tp-comm-bulk-wgrad", action="store_false",
                   dest="tp_comm_bulk_wgrad", help="With --tp-comm-overlap: do not run the backward dgrad "
                                                   "reduce-scatter behind the wgrad GEMM.")
    g.add_argument("--tp-comm-overlap-cfg", type=str, default=None,
                   help="Transformer Engine userbuffer config (YAML): accepted and has no effect here (no "
                        "userbuffers; --tp-comm-overlap runs a chunked ring over the TP group).")
    return parser


def validate_tp_overlap_args(args, require, say=print):
    """``say`` logs a start-up line (rank 0)."""
    cfg = args.tp_comm_overlap_cfg
    if cfg is not None:
        require(os.path.isfile(cfg), f"--tp-comm-overlap-cfg {cfg}: no such file; pass the path of the YAML "
                                     "userbuffer config or drop the flag")
        if args.rank == 0:
            say(f"--tp-comm-overlap-cfg {cfg} has no effect here: it configures Transformer Engine userbuffers, "
                "and --tp-comm-overlap here runs a chunked ring over the TP group with no userbuffers")
    if not args.tp_comm_overlap:
        return
    require(args.sequence_parallel and args.tensor_model_parallel_size > 1,
            "--tp-comm-overlap overlaps the sequence-parallel communication: add --sequence-parallel with "
            "--tensor-model-parallel-size > 1, or drop the flag")
