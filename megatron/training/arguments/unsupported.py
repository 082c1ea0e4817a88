"""Megatron flags users commonly pass that this project does not implement yet.

They are registered so a user gets one clear line ("--num-experts is not supported yet: ...")
instead of argparse's generic "unrecognized arguments", and never a silently ignored flag.
"""

# flag -> (argparse kwargs, what to do instead)
UNSUPPORTED_FLAGS = {
    "--num-experts": (dict(type=int), "MoE is not built yet; train a dense model"),
    "--moe-router-topk": (dict(type=int), "MoE is not built yet"),
    "--moe-grouped-gemm": (dict(action="store_true"), "MoE is not built yet"),
    "--moe-token-dispatcher-type": (dict(type=str), "MoE is not built yet"),
    "--moe-aux-loss-coeff": (dict(type=float, nargs="+"), "MoE is not built yet"),
    "--expert-tensor-parallel-size": (dict(type=int), "expert parallelism is not built yet"),
    "--multi-latent-attention": (dict(action="store_true"), "MLA is not built yet"),
    "--mtp-num-layers": (dict(type=int), "multi-token prediction is not built yet"),
    "--fp4-format": (dict(type=str), "FP4 is not supported"),
    "--yaml-cfg": (dict(type=str), "YAML configs are not supported; pass command-line flags"),
    "--use-megatron-fsdp": (dict(action="store_true"), "Megatron-FSDP is not supported; use DDP"),
    "--tp-comm-overlap": (dict(action="store_true"), "TP communication overlap needs Transformer Engine"),
    "--spec": (dict(nargs="*"), "custom layer specs are not supported; the local spec is used"),
    "--heterogeneous-layers-config-path": (dict(type=str), "heterogeneous layers are not supported"),
    "--step-batch-size-schedule": (dict(type=str), "use --rampup-batch-size"),
    "--full-validation": (dict(action="store_true"), "use --eval-iters"),
    "--multiple-validation-sets": (dict(action="store_true"), "use a single validation blend"),
    "--eval-global-batch-size": (dict(type=int), "evaluation uses --global-batch-size"),
    "--eval-micro-batch-size": (dict(type=int), "evaluation uses --micro-batch-size"),
    "--profile": (dict(action="store_true"), "profiling hooks are not built yet"),
    "--use-pytorch-profiler": (dict(action="store_true"), "profiling hooks are not built yet"),
    "--log-progress": (dict(action="store_true"), "progress files are not written yet"),
    "--log-energy": (dict(action="store_true"), "energy monitoring is not supported"),
    "--manual-gc": (dict(action="store_true"), "manual GC is not supported"),
    "--cpu-offloading-num-layers": (dict(type=int), "activation offloading is not supported"),
    "--fim-data": (dict(action="store_true"), "fill-in-the-middle data is not supported"),
    "--sft": (dict(action="store_true"), "SFT data is not supported"),
    "--window-size": (dict(type=int, nargs=2), "sliding-window attention is not built yet"),
    "--quick-geglu": (dict(action="store_true"), "use --swiglu or the default GeLU"),
    "--hierarchical-context-parallel-sizes": (dict(type=int, nargs="+"), "context parallelism is not built yet"),
    "--pipeline-model-parallel-layout": (dict(type=str), "custom pipeline layouts are not built yet"),
}


def _dest(flag):
    return flag.lstrip("-").replace("-", "_")


def add_unsupported_args(parser):
    g = parser.add_argument_group(title="not supported yet (rejected with a message)")
    for flag, (kwargs, _) in UNSUPPORTED_FLAGS.items():
        kwargs = dict(kwargs)
        kwargs.setdefault("default", False if kwargs.get("action") == "store_true" else None)
        g.add_argument(flag, dest=_dest(flag), help="Not supported yet.", **kwargs)
    return parser


def unsupported_flag_used(args):
    """(flag, hint) of the first unsupported flag set on the command line, else None."""
    for flag, (kwargs, hint) in UNSUPPORTED_FLAGS.items():
        value = getattr(args, _dest(flag), None)
        if value not in (None, False):
            return flag, hint
    return None
