"""--adlr-autoresume: the cluster's autoresume service (``userlib.auto_resume.AutoResume``, found on the
``SUBMIT_SCRIPTS`` path) is polled every --adlr-autoresume-interval iterations; when it asks the job
to stop, the run saves a checkpoint (with --save), requests its resumption and exits 0."""


def add_autoresume_args(parser):
    g = parser.add_argument_group(title="autoresume")
    g.add_argument("--adlr-autoresume", action="store_true", help="Enable autoresume on adlr cluster.")
    g.add_argument("--adlr-autoresume-interval", type=int, default=1000,
                   help="Intervals over which check for autoresume termination signal")
    return parser


def validate_autoresume_args(args, require):
    if args.adlr_autoresume:
        require(args.adlr_autoresume_interval > 0,
                f"--adlr-autoresume-interval {args.adlr_autoresume_interval}: pass a positive number of iterations")
