"""--tp-comm-overlap: overlap the sequence-parallel all-gathers / reduce-scatters with the TP GEMMs.

Our own chunked ring over torch.distributed (megatron/core/tensor_parallel/overlap.py); Megatron's
Transformer Engine userbuffer tuning knobs have no counterpart (megatron_flags.py lists them)."""


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
    return parser


def validate_tp_overlap_args(args, require):
    if not args.tp_comm_overlap:
        return
    require(args.sequence_parallel and args.tensor_model_parallel_size > 1,
            "--tp-comm-overlap overlaps the sequence-parallel communication: add --sequence-parallel with "
            "--tensor-model-parallel-size > 1, or drop the flag")
