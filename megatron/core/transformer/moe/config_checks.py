"""Consistency checks of the MoE fields of a TransformerConfig (also run on the flags by validate_args).

Each failure is a ValueError/NotImplementedError with one line naming the flag and the fix."""
from megatron.core.transformer.moe.moe_utils import moe_layer_pattern

_LB_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")


def _as_list(value):
    return list(value) if isinstance(value, (list, tuple)) else [value]


def check_moe_config(c) -> None:
    """``c`` has TransformerConfig's field names (num_moe_experts, moe_*, expert_*_parallel_size...)."""
    E, k = c.num_moe_experts, c.moe_router_topk
    if E < 1:
        raise ValueError(f"--num-experts ({E}) must be >= 1")
    if not 1 <= k <= E:
        raise ValueError(f"--moe-router-topk ({k}) must be between 1 and --num-experts ({E})")
    latent = getattr(c, "moe_latent_size", None)
    if latent is not None and latent < 1:
        raise ValueError(f"--moe-latent-size ({latent}) must be >= 1")
    if latent is not None and getattr(c, "overlap_moe_expert_parallel_comm", False):
        raise NotImplementedError("--moe-latent-size with --overlap-moe-expert-parallel-comm is not built yet: the "
                                  "overlapped schedule dispatches the hidden-size tokens; drop one")
    ep = c.expert_model_parallel_size
    if E % ep:
        raise ValueError(f"--num-experts ({E}) must be divisible by --expert-model-parallel-size ({ep})")
    if getattr(c, "moe_ffn_hidden_size", None) is None:
        c.moe_ffn_hidden_size = c.ffn_hidden_size
    etp = c.expert_tensor_parallel_size or c.tensor_model_parallel_size
    if c.moe_ffn_hidden_size % etp:
        raise ValueError(f"--moe-ffn-hidden-size ({c.moe_ffn_hidden_size}) must be divisible by "
                         f"--expert-tensor-parallel-size ({etp})")
    if etp > 1 and c.add_bias_linear:
        raise NotImplementedError("--expert-tensor-parallel-size > 1 with linear biases is not supported; "
                                  "pass --disable-bias-linear")
    if c.moe_grouped_gemm and c.add_bias_linear:
        raise ValueError("--moe-grouped-gemm experts have no biases; pass --disable-bias-linear")
    moe_layer_pattern(c.moe_layer_freq, c.num_layers)
    _check_router(c, E, k)
    _check_capacity(c)
    if c.moe_token_dispatcher_type == "flex":
        raise NotImplementedError("--moe-token-dispatcher-type flex needs DeepEP/HybridEP kernels, which this "
                                  "build does not have; use alltoall")
    if c.moe_token_dispatcher_type not in ("allgather", "alltoall"):
        raise ValueError(f"--moe-token-dispatcher-type {c.moe_token_dispatcher_type}: use allgather or alltoall")


def _check_router(c, E, k):
    types = _as_list(c.moe_router_load_balancing_type)
    for t in types:
        if t not in _LB_TYPES:
            raise ValueError(f"--moe-router-load-balancing-type {t}: use one of {', '.join(_LB_TYPES)}")
    coeffs = _as_list(c.moe_aux_loss_coeff)
    if len(coeffs) not in (1, len(types)):
        raise ValueError(f"--moe-aux-loss-coeff has {len(coeffs)} values for {len(types)} "
                         "--moe-router-load-balancing-type entries; give one or one per type")
    if "sinkhorn" in types and len(types) > 1:
        raise ValueError("--moe-router-load-balancing-type sinkhorn cannot be combined with other types")
    if c.moe_router_score_function not in ("softmax", "sigmoid", "sqrtsoftplus"):
        raise ValueError(f"--moe-router-score-function {c.moe_router_score_function} unknown; use softmax, "
                         "sigmoid or sqrtsoftplus")
    if c.moe_router_enable_expert_bias and c.moe_router_score_function == "softmax":
        raise ValueError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid or sqrtsoftplus")
    if c.moe_router_dtype not in (None, "fp32", "fp64"):
        raise ValueError(f"--moe-router-dtype {c.moe_router_dtype}: use fp32 or fp64")
    if c.moe_apply_probs_on_input and k != 1:
        raise ValueError(f"--moe-apply-probs-on-input needs --moe-router-topk 1 (got {k}): with several experts "
                         "per token the input cannot carry one probability")
    groups, group_topk = c.moe_router_num_groups, c.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise ValueError("--moe-router-num-groups and --moe-router-group-topk must be given together")
    if groups is not None:
        if E % groups or not 1 <= group_topk <= groups:
            raise ValueError(f"--moe-router-num-groups ({groups}) must divide --num-experts ({E}) and "
                             f"--moe-router-group-topk ({group_topk}) must be in [1, {groups}]")
        if k % group_topk or k // group_topk > E // groups:
            raise ValueError(f"--moe-router-topk ({k}) must be a multiple of --moe-router-group-topk "
                             f"({group_topk}) with at most {E // groups} experts per group")


def _check_capacity(c):
    cf = c.moe_expert_capacity_factor
    if cf is not None and cf <= 0:
        raise ValueError(f"--moe-expert-capacity-factor ({cf}) must be > 0")
    if c.moe_pad_expert_input_to_capacity and cf is None:
        raise ValueError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    if cf is not None and c.moe_token_drop_policy not in ("probs", "position"):
        raise ValueError(f"--moe-token-drop-policy {c.moe_token_drop_policy}: use probs or position")


def check_ep_overlap(*, overlap: bool, delay_wgrad: bool, ep: int, etp: int, tp: int, cp: int, pp: int,
                     dispatcher: str, grouped_gemm: bool, recompute_granularity=None, recompute_modules=(),
                     cuda_graph_impl: str = "none", max_connections=None) -> None:
    """--overlap-moe-expert-parallel-comm and --delay-wgrad-compute: what each needs, one line per refusal.

    The overlap runs one micro-batch's forward beside the previous one's backward in the schedule without
    pipelining (pipeline_parallel/combined_1f1b.py); the two may share no communicator but the EP one,
    which gets a twin for the backward, hence EP x DP only."""
    if overlap:
        flag = "--overlap-moe-expert-parallel-comm"
        if ep < 2 or dispatcher != "alltoall":
            raise ValueError(f"{flag} overlaps the expert-parallel all-to-all: it needs "
                             "--expert-model-parallel-size > 1 and --moe-token-dispatcher-type alltoall")
        if tp > 1 or etp > 1 or cp > 1 or pp > 1:
            raise NotImplementedError(
                f"{flag} is built for EP x DP without pipelining (the next micro-batch's forward beside this "
                f"one's backward); TP ({tp}), expert-TP ({etp}), CP ({cp}) and PP ({pp}) > 1 are not supported")
        modules = recompute_modules or ()
        if recompute_granularity == "full" or (recompute_granularity == "selective" and "moe" in modules):
            raise ValueError(f"{flag}: recomputing the MoE layer would rerun its forward exchange inside the "
                             "backward; drop --recompute-granularity full / 'moe' from --recompute-modules")
        if cuda_graph_impl != "none":
            raise ValueError(f"{flag} runs two micro-batches on two host threads, which one CUDA graph cannot "
                             "capture; drop --cuda-graph-impl")
        if str(max_connections) == "1":
            raise ValueError(f"{flag} runs the backward's all-to-all beside the forward's on a second stream: "
                             "unset CUDA_DEVICE_MAX_CONNECTIONS or set it above 1")
    if delay_wgrad and not grouped_gemm:
        raise ValueError("--delay-wgrad-compute defers the grouped experts' weight gradients: pass "
                         "--moe-grouped-gemm")
