"""--use-precision-aware-optimizer and its dtypes (Megatron 0.19's names, choices and rules): Adam's moments, the
main params and the main grads in 16 bits (megatron/core/optimizer/precision_aware_adam.py)."""
import torch

from megatron.core.optimizer.optimizer_config import as_optimizer_dtype, check_precision_aware

FLAGS = {"main_grads_dtype": ("--main-grads-dtype", ["fp32", "bf16"]),
         "main_params_dtype": ("--main-params-dtype", ["fp32", "fp16"]),
         "exp_avg_dtype": ("--exp-avg-dtype", ["fp32", "fp16", "bf16", "fp8"]),
         "exp_avg_sq_dtype": ("--exp-avg-sq-dtype", ["fp32", "fp16", "bf16", "fp8"])}


def add_precision_aware_args(parser):
    g = parser.add_argument_group(title="precision-aware optimizer")
    g.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="Let the optimizer keep its tensors in 16 bits (the dtypes below); Adam with "
                        "--use-distributed-optimizer. The update is computed in fp32 and rounded to each dtype.")
    helps = {"main_grads_dtype": "Gradients the optimizer reads: bf16 keeps the DDP gradient buffer in bf16 (reduced "
                                 "in bf16; no fp32 accumulation).",
             "main_params_dtype": "Master copies of the 16-bit params.",
             "exp_avg_dtype": "Adam's first moment (fp16 and fp8, which need a scale per tensor, are not built "
                              "here).",
             "exp_avg_sq_dtype": "Adam's second moment (fp16 and fp8 are not built here)."}
    for dest, (flag, choices) in FLAGS.items():
        g.add_argument(flag, type=str, default="fp32", choices=choices, help=helps[dest])
    return parser


def validate_precision_aware_args(args, require):
    """Map the dtype names to torch dtypes (as Megatron's args hold them), then the library's own check
    (OptimizerConfig runs the same one) and what only the flags know."""
    for dest in FLAGS:
        setattr(args, dest, as_optimizer_dtype(getattr(args, dest)))
    try:
        check_precision_aware(args)
    except ValueError as e:
        require(False, str(e))
    if not args.use_precision_aware_optimizer:
        return
    require(args.main_params_dtype == torch.float32 or args.bf16 or args.fp16,
            "--main-params-dtype fp16 keeps master copies of 16-bit params: pass --bf16 or --fp16")
    if args.main_grads_dtype != torch.float32:
        require(not args.accumulate_allreduce_grads_in_fp32,
                "--main-grads-dtype bf16 keeps the gradients in bf16: drop --accumulate-allreduce-grads-in-fp32")
