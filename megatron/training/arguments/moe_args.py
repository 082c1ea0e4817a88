"""Mixture-of-Experts flags (Megatron 0.19 names, types and defaults) and their validation."""
import argparse
import os
import re
from types import SimpleNamespace

from megatron.core.transformer.moe.config_checks import check_ep_overlap, check_moe_config


def moe_freq_type(value):
    """--moe-layer-freq: an int N (every N-th layer is MoE) or a Python list expression of 0/1 such as
    '([0]*1+[1]*3)' or '[1,1,0,1]' (only digits, brackets, '*', '+' and commas are accepted)."""
    if isinstance(value, int):
        return value
    text = value.strip()
    if re.fullmatch(r"\d+", text):
        return int(text)
    if not re.fullmatch(r"[\[\]\(\)\d\s\*\+,]+", text):
        raise argparse.ArgumentTypeError(f"'{value}': use an int or a list pattern like ([0]*1+[1]*3)")
    try:
        pattern = eval(text, {"__builtins__": {}}, {})  # noqa: S307 (characters restricted above)
    except Exception:
        raise argparse.ArgumentTypeError(f"'{value}' is not a valid pattern such as ([0]*1+[1]*3)") from None
    if not isinstance(pattern, list):
        raise argparse.ArgumentTypeError(f"'{value}' must evaluate to a list of 0/1")
    return pattern


def add_moe_args(parser):
    g = parser.add_argument_group(title="moe")
    g.add_argument("--num-experts", type=int, default=None, help="Experts per MoE layer (None: dense model).")
    g.add_argument("--moe-layer-freq", type=moe_freq_type, default=1,
                   help="MoE every N layers (int) or a 0/1 pattern per layer, e.g. ([0]*1+[1]*3).")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="Expert FFN size (default --ffn-hidden-size).")
    g.add_argument("--moe-latent-size", type=int, default=None,
                   help="Latent MoE: the routed experts work in this width; the layer projects its tokens down "
                        "before the dispatch and the combined output back up (router and shared expert see the "
                        "hidden size).")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="FFN size of the shared expert(s) every token passes through.")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="Scale the shared experts' output per token by a learned sigmoid gate (Qwen2-MoE).")
    g.add_argument("--moe-shared-expert-overlap", action="store_true",
                   help="Run the shared expert on a side CUDA stream, overlapping the token dispatch.")
    g.add_argument("--moe-router-load-balancing-type", type=str, nargs="+", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"],
                   help="Load balancing: one type or several (each with its --moe-aux-loss-coeff).")
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0, help="Aux loss coefficient(s).")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None, help="Router z-loss coefficient.")
    g.add_argument("--moe-router-topk", type=int, default=2, help="Experts per token.")
    g.add_argument("--moe-router-score-function", type=str, default="softmax",
                   choices=["softmax", "sigmoid", "sqrtsoftplus"],
                   help="Router score function (sqrtsoftplus: sqrt(softplus(logit)) per expert, like sigmoid).")
    g.add_argument("--moe-router-pre-softmax", action="store_true", help="Softmax over all experts before top-k.")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="Multiply the top-k routing weights by this factor.")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="Aux-loss-free balancing: a per-expert bias shifts expert selection (sigmoid router).")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3, help="Expert bias step per iteration.")
    g.add_argument("--moe-router-num-groups", type=int, default=None, help="Expert groups (group-limited routing).")
    g.add_argument("--moe-router-group-topk", type=int, default=None, help="Groups each token may use.")
    g.add_argument("--moe-router-dtype", type=str, default=None, choices=["fp32", "fp64"],
                   help="Router gating and scores in this dtype.")
    g.add_argument("--moe-token-dispatcher-type", type=str, default="allgather",
                   choices=["allgather", "alltoall", "flex"], help="Token dispatcher.")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="Capacity per expert = ceil(tokens * topk / experts * factor); None: no dropping.")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="Pad every expert's input to its capacity.")
    g.add_argument("--moe-token-drop-policy", type=str, default="probs", choices=["probs", "position"],
                   help="Which tokens an over-capacity expert drops: lowest probs, or latest positions.")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="All local experts in two grouped GEMMs (torch._grouped_mm on Hopper bf16).")
    g.add_argument("--moe-permute-fusion", action="store_true",
                   help="The token permutation as one Triton kernel per direction on CUDA for exactly top-k "
                        "routing (index-based eager otherwise).")
    g.add_argument("--use-fused-weighted-squared-relu", action="store_true",
                   help="The experts' squared-ReLU activation times the routing probability in fp32 as one "
                        "compiled kernel per direction on CUDA (needs --squared-relu and --num-experts).")
    g.add_argument("--overlap-moe-expert-parallel-comm", action="store_true",
                   help="Run each micro-batch's forward beside the previous one's backward, so the expert-"
                        "parallel all-to-all of one hides behind the other's compute (EP x DP, no pipelining).")
    g.add_argument("--delay-wgrad-compute", action="store_true",
                   help="Compute the grouped experts' weight gradients while the backward dispatch "
                        "all-to-all is in flight, after their input gradients.")
    g.add_argument("--moe-router-fusion", action="store_true",
                   help="Top-k routing and the balancing-loss scores as one Triton kernel per direction on "
                        "CUDA (the same values; eager fallback).")
    g.add_argument("--moe-apply-probs-on-input", action="store_true",
                   help="Multiply each token's expert input by its routing probability instead of the "
                        "expert's activation (needs --moe-router-topk 1).")
    g.add_argument("--moe-per-layer-logging", action="store_true", help="MoE losses per layer in TensorBoard/W&B.")
    g.add_argument("--moe-input-jitter-eps", type=float, default=None, help="Multiplicative router input jitter.")
    g.add_argument("--moe-router-force-load-balancing", action="store_true",
                   help="Benchmark aid: random router logits, so experts get a balanced load.")
    g.add_argument("--moe-router-force-biased", type=float, default=None,
                   help="Benchmark aid: random router logits plus a random per-expert bias of this std shared "
                        "by all ranks (negative: drawn once per layer), for a skewed load.")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="Tensor parallelism inside experts (default: --tensor-model-parallel-size).")
    return parser


def validate_moe_args(args, require):
    """Derived defaults and one-line errors for the MoE flags (``require(cond, message)`` raises)."""
    ep, tp, pp = args.expert_model_parallel_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    require(ep >= 1, f"--expert-model-parallel-size ({ep}) must be >= 1")
    etp_defaulted = args.expert_tensor_parallel_size is None
    if etp_defaulted:
        args.expert_tensor_parallel_size = tp
    etp = args.expert_tensor_parallel_size
    require(etp >= 1, f"--expert-tensor-parallel-size ({etp}) must be >= 1")
    require(not args.use_fused_weighted_squared_relu or (args.num_experts and args.squared_relu and not args.swiglu),
            "--use-fused-weighted-squared-relu fuses the MoE experts' squared-ReLU activation with the routing "
            "probability: it needs --squared-relu (no --swiglu) and --num-experts")
    if args.num_experts is None:
        require(ep == 1, f"--expert-model-parallel-size ({ep}) > 1 needs --num-experts")
        for flag in ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute"):
            require(not getattr(args, flag), f"--{flag.replace('_', '-')} is for MoE models: it needs --num-experts")
        return
    # The expert grid has its own tensor axis (Megatron's rule): with EP over the TP ranks (TP=2, EP=2 on 2
    # ranks) the default ETP = TP asks for ETP x EP = 4 ranks; say so, since the user never typed that ETP.
    require(args.world_size % (etp * ep * pp) == 0,
            f"world size ({args.world_size}) must be divisible by --expert-tensor-parallel-size ({etp}"
            f"{', its default: --tensor-model-parallel-size' if etp_defaulted else ''}) x "
            f"--expert-model-parallel-size ({ep}) x --pipeline-model-parallel-size ({pp})")
    require(not args.use_torch_fsdp2,
            "--use-torch-fsdp2 with --num-experts is not supported; use DDP or --use-distributed-optimizer")
    if tp > 1 and not args.sequence_parallel:
        require(args.seq_length is None or args.seq_length % tp == 0,
                f"--seq-length ({args.seq_length}) must be divisible by --tensor-model-parallel-size ({tp}) "
                "in MoE layers (tokens are split over TP)")
    ffn = args.ffn_hidden_size if args.ffn_hidden_size is not None else 4 * args.hidden_size
    view = SimpleNamespace(**{k: v for k, v in vars(args).items() if k.startswith("moe_")},
                           num_moe_experts=args.num_experts, num_layers=args.num_layers, ffn_hidden_size=ffn,
                           expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                           tensor_model_parallel_size=tp, add_bias_linear=args.add_bias_linear,
                           overlap_moe_expert_parallel_comm=args.overlap_moe_expert_parallel_comm)
    try:
        check_moe_config(view)
        check_ep_overlap(overlap=args.overlap_moe_expert_parallel_comm, delay_wgrad=args.delay_wgrad_compute,
                         ep=ep, etp=etp, tp=tp, cp=args.context_parallel_size, pp=pp,
                         dispatcher=args.moe_token_dispatcher_type, grouped_gemm=args.moe_grouped_gemm,
                         recompute_granularity=args.recompute_granularity,
                         recompute_modules=getattr(args, "recompute_modules", None) or (),
                         cuda_graph_impl=getattr(args, "cuda_graph_impl", "none"),
                         max_connections=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
    except (ValueError, NotImplementedError) as e:
        require(False, str(e))
    if isinstance(args.moe_router_load_balancing_type, list) and len(args.moe_router_load_balancing_type) == 1:
        args.moe_router_load_balancing_type = args.moe_router_load_balancing_type[0]
    if isinstance(args.moe_aux_loss_coeff, list) and len(args.moe_aux_loss_coeff) == 1:
        args.moe_aux_loss_coeff = args.moe_aux_loss_coeff[0]
