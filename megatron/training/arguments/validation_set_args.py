"""--full-validation, --multiple-validation-sets, --validation-set-names (Megatron 0.19's names and rules): evaluate
the whole validation set each time, and several validation sets one by one (one loss line each)."""


def add_validation_set_args(parser):
    g = parser.add_argument_group(title="validation sets")
    g.add_argument("--full-validation", action="store_true",
                   help="Each evaluation reads the whole validation set once (instead of --eval-iters batches); "
                        "the last batches are padded with samples whose loss mask is zero.")
    g.add_argument("--multiple-validation-sets", action="store_true",
                   help="Evaluate each --valid-data-path prefix (no weights) on its own, each with its own loss "
                        "line and TensorBoard scalars (needs --full-validation, as in Megatron).")
    g.add_argument("--validation-set-names", nargs="*", type=str, default=None,
                   help="Names of the validation sets in the loss lines (`validation-<name> loss at ...`); "
                        "default: their index.")
    return parser


def validate_validation_set_args(args, require):
    if args.multiple_validation_sets:
        require(args.full_validation, "--multiple-validation-sets evaluates each set whole: add --full-validation "
                                      "(as in Megatron)")
        require(bool(args.valid_data_path), "--multiple-validation-sets evaluates each --valid-data-path prefix on "
                                            "its own: pass the sets as --valid-data-path (with --train-data-path)")
    if args.validation_set_names:
        require(args.multiple_validation_sets, "--validation-set-names requires --multiple-validation-sets")
        require(len(args.validation_set_names) == len(args.valid_data_path),
                f"--validation-set-names has {len(args.validation_set_names)} names for "
                f"{len(args.valid_data_path)} --valid-data-path sets; give one name per set")
    if args.full_validation:
        require(getattr(args, "dataloader_type", "single") != "external",
                "--full-validation samples the validation set itself: not with --dataloader-type external")
